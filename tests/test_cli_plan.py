"""``hybridserve plan``: the seed's numbers through the command line, and clear refusals.

Expected values are the seed's table (DESIGN.md) and hand arithmetic, not the
planner's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hybridserve
from hybridserve.cli import SUBCOMMANDS, main

MiB, GiB = 1024**2, 1024**3
FIXTURE = Path("/work/shared/fixtures/qwen3_5_27b_shape.config.json")

TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 48,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def seed_config(tmp_path_factory) -> str:
    if FIXTURE.exists():
        return str(FIXTURE)
    d = {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


def _json(capsys, argv) -> dict:
    rc = main(argv + ["--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_json_reproduces_the_seed(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--context", "32768"])
    assert d["kv_bytes_per_token"] == 65_536
    assert d["block_bytes"] == 1 * MiB
    assert d["state_bytes_per_sequence"] == 144 * MiB
    assert d["conv_state_bytes_per_sequence"] == 2_949_120  # 2.8125 MiB
    assert d["kv_bytes_at_native_max"] == 16 * GiB
    assert d["pool_bytes"] == 23_859 * MiB
    assert d["session_bytes_paged_without_conv"] == 2_192 * MiB
    assert d["sessions_paged"] == 10
    assert d["sessions_reserved_max"] == 1
    assert d["conv_state_counted"] is True


def test_omit_conv_state_is_the_seeds_count(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--omit-conv-state"])
    assert d["conv_state_counted"] is False
    assert d["session_bytes_paged"] == 2_192 * MiB  # 2 GiB KV + 144 MiB
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)


def test_table_shows_the_seeds_rows(capsys, seed_config):
    assert main(["plan", seed_config, "--pool-mib", "23859"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  " in line}
    assert "65,536 B (64 KiB)" in out
    assert "16 GiB" in rows["KV per sequence at the native 262,144 tokens"]
    assert rows["one 16-token block (all attention layers)"].endswith("1 MiB")
    assert rows["DeltaNet matrix state per sequence (float32)"].endswith("144 MiB")
    assert "2.8125 MiB" in out and "2,192 MiB" in out and "23,859 MiB" in out
    assert rows["sessions that fit at 32,768 tokens, paged"].split()[-1] == "10"
    assert rows["sessions that fit, reserving the native maximum"].split()[-1] == "1"


def test_other_context_block_size_and_dtype(capsys, seed_config):
    # 8,192 tokens in 32-token fp8 blocks: 32 KiB per token, 1 MiB blocks, 256 blocks =
    # 256 MiB + 146.8125 MiB state per session; 23,859 / 402.8125 = 59.2 -> 59.
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--context", "8192",
                       "--block-size", "32", "--kv-dtype", "float8_e4m3fn"])
    assert (d["kv_bytes_per_token"], d["block_bytes"]) == (32_768, MiB)
    assert d["sessions_paged"] == 59
    # Reserving 262,144 x 32 KiB = 8 GiB + 146.8125 MiB: 23,859 / 8,338.8125 -> 2.
    assert d["sessions_reserved_max"] == 2


def test_scenarios_in_json(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--shared-prefix", "1000",
                       "--sessions", "4", "--n", "4"])
    # 62 shared blocks + 4 x 1,986 own (see test_planner's hand arithmetic).
    sp = d["shared_prefix"]
    assert (sp["shared_blocks"], sp["total_blocks"], sp["max_count"]) == (62, 8_006, 11)
    ps = d["parallel_sampling"]
    assert (ps["blocks_per_request"], ps["requests_that_fit"], ps["sequences_that_fit"]) == (
        2_051, 9, 36
    )


def test_pool_from_device_memory(capsys, tmp_path):
    # Tiny model, float32 weights: HF's parameter count x 4 B. The pool is
    # 1 GiB x 0.5 - weights - 100 MiB reserve.
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3_5ForCausalLM(hf_cfg).parameters())
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "torch_dtype": "float32"}))
    d = _json(capsys, ["plan", str(cfg), "--device-memory", "1GiB",
                       "--gpu-memory-utilization", "0.5", "--reserve", "100MiB",
                       "--context", "1000"])
    assert d["weight_bytes"] == params * 4
    assert d["pool_bytes"] == GiB // 2 - params * 4 - 100 * MiB


def test_checkpoint_directory_counts_safetensors(capsys, tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file({"model.embed_tokens.weight": np.zeros((1000, 256), dtype=np.float16)},
              str(tmp_path / "model.safetensors"))
    d = _json(capsys, ["plan", str(tmp_path), "--device-memory", "1GB", "--reserve", "1MiB",
                       "--context", "1000"])
    assert d["weight_bytes"] == 1000 * 256 * 2
    assert d["pool_bytes"] == 900_000_000 - 512_000 - MiB


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--device-memory", "80G"], "80GiB"),
        (["--device-memory", "lots"], "80GiB"),
        (["--reserve", "2"], "23859MiB"),
        (["--pool-mib", "-5"], "positive"),
        (["--pool-mib", "1.5GiB"], "whole number"),
        (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
        (["--kv-dtype", "int3"], "bfloat16"),
        (["--context", "300000"], "native maximum"),
        (["--shared-prefix", "100"], "--sessions"),
        (["--prompt-len", "100"], "--n"),
        (["--device-memory", "40GB"], "no memory left"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, seed_config, argv, hint):
    assert main(["plan", seed_config] + argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and hint in err


def test_missing_config_exits_2(capsys, tmp_path):
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_no_subcommand_exits_2(capsys):
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_subcommand_registry():
    assert "plan" in SUBCOMMANDS
    assert callable(SUBCOMMANDS["plan"].run) and callable(SUBCOMMANDS["plan"].add_arguments)


def test_python_dash_m(seed_config):
    env = dict(os.environ, PYTHONPATH=str(Path(hybridserve.__file__).parent.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "plan", seed_config, "--pool-mib", "23859",
         "--json"],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)
    bad = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "plan", seed_config, "--device-memory", "80"],
        env=env, capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "80GB" in bad.stderr


def test_shipped_preset_is_the_27b_shape_and_plans_the_seed(capsys, seed_config):
    """``plan qwen3.5-27b`` needs no file outside the package and gives the seed's table."""
    from hybridserve.presets import preset_names, preset_path

    assert "qwen3.5-27b" in preset_names()
    shipped = json.loads(Path(preset_path("qwen3.5-27b")).read_text())
    expect = json.loads(Path(seed_config).read_text())
    for key, value in expect.items():
        assert shipped[key] == value, key
    d = _json(capsys, ["plan", "qwen3.5-27b", "--pool-mib", "23859"])
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)
    assert main(["plan", "qwen9-1t"]) == 2
    assert "qwen3.5-27b" in capsys.readouterr().err
