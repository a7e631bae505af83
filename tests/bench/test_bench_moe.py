"""``hybridserve bench throughput --compare-hf`` on a tiny MoE model picked by name
(``tiny:PRESET``): the HF baseline loads HF's MoE classes and its greedy tokens are
hybridserve's."""

from __future__ import annotations

import json

import pytest

from hybridserve.cli import main
from hybridserve.errors import ConfigError
from hybridserve.model.tiny import write_tiny_checkpoint


def test_compare_hf_on_a_named_tiny_moe_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "tiny:moe-a", "--num-prompts", "4", "--prompt-len", "8-24",
               "--output-len", "3-6", "--compare-hf", "--hf-batch-size", "2", "--threads", "2",
               "--output", str(out), "--no-progress"])
    assert rc == 0
    assert (tmp_path / "cache" / "tiny-moe-a-seed0" / "config.json").exists()
    c = json.loads(out.read_text())["compare_hf"]
    for key in ("tokens_vs_hf_single", "tokens_vs_hf_static"):
        assert c[key]["requests"] == 4 and c[key]["all_identical"], c[key]["mismatches"]
    assert "4/4" in capsys.readouterr().out


@pytest.mark.parametrize("vl", [False, True])
def test_hf_baseline_loads_the_moe_classes(tmp_path, vl):
    import transformers

    from hybridserve.bench.hf_baseline import load_hf_model

    d = write_tiny_checkpoint(tmp_path / "m", preset="moe-b", seed=1, vl_naming=vl)
    m = load_hf_model(d)
    want = transformers.Qwen3_5MoeForConditionalGeneration if vl else transformers.Qwen3_5MoeForCausalLM
    assert type(m) is want
    # Every expert tensor came from the checkpoint (none left at its random init).
    from safetensors.torch import load_file
    raw = load_file(f"{d}/model.safetensors")
    prefix = "model.language_model." if vl else "model."
    layers = m.model.language_model.layers if vl else m.model.layers
    assert (layers[2].mlp.experts.down_proj[3] == raw[f"{prefix}layers.2.mlp.experts.3.down_proj.weight"]).all()


def test_unknown_tiny_model_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path))
    from hybridserve.server.serve import default_model_dir

    with pytest.raises(ConfigError, match="moe-bench"):
        default_model_dir("no-such-preset")
