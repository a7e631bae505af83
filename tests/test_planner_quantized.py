"""The planner's bytes for quantized forms (issue 35): GGUF Q4_K_M (and the other
llama-quantize file types) and Qwen's FP8 checkpoints.

Oracles:
* a brute-force count over the model's own tensor list (``checkpoint_shapes()`` of the
  serving model on the meta device: HF names, experts one by one), each tensor's type
  decided here from its role, as ``src/llama-quant.cpp`` / the FP8 format state it;
* the GGUF fixtures llama.cpp itself wrote (``tests/fixtures/gguf``): the planner's
  per-tensor types and byte counts must be the file's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.planner import weights as W
from hybridserve.planner.rank import rank_weight_bytes
from hybridserve.planner.report import capacity_report
from hybridserve.presets import preset_path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"

# ggml block formats as ggml-common.h defines them: weights per block, bytes per block.
BLOCK = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 2 + 32), "Q4_0": (32, 2 + 16),
         "Q4_K": (256, 2 + 2 + 12 + 128), "Q5_K": (256, 2 + 2 + 12 + 32 + 128), "Q6_K": (256, 128 + 64 + 16 + 2)}


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_json(preset_path(name))


def _hf_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    # Presets name causal-LM configs; the serving model builds on meta without weights.
    return Qwen3_5ForServing(config, device="meta").checkpoint_shapes()


def _more_bits(n_layers: int) -> set[int]:
    lo, hi = n_layers // 8, 7 * n_layers // 8
    return {i for i in range(n_layers) if i < lo or i >= hi or (i - lo) % 3 == 2}


def _q4_k_m_type(name: str, shape: tuple[int, ...], config: ModelConfig) -> str:
    """The type of one HF tensor in a llama-quantize Q4_K_M file (rows are whole 256-blocks
    for these shapes, so no fallback)."""
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1 or leaf in ("A_log", "dt_bias") or "norm" in name or "conv1d" in name:
        return "F32"
    if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
        return "F32"  # router and shared-expert gate: float32 from the converter, never quantized
    if name == "lm_head.weight" or (name == "embed_tokens.weight" and config.tie_word_embeddings):
        return "Q6_K"
    layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
    v_like = name.endswith(("self_attn.v_proj.weight", "linear_attn.in_proj_qkv.weight"))
    if (v_like or name.endswith("down_proj.weight")) and layer in _more_bits(config.num_hidden_layers):
        return "Q6_K"
    return "Q4_K"


def _bytes(shape: tuple[int, ...], qtype: str) -> int:
    block, nbytes = BLOCK[qtype]
    assert shape[-1] % block == 0, (shape, qtype)
    return math.prod(shape) // block * nbytes


@pytest.mark.parametrize("preset", ["qwen3.5-27b-q4_k_m", "qwen3.5-35b-a3b-q4_k_m"])
def test_q4_k_m_preset_bytes_equal_a_brute_force_count(preset):
    config = _config(preset)
    expected = sum(_bytes(shape, _q4_k_m_type(name, shape, config)) for name, shape in _hf_tensors(config).items())
    assert W.quantized_weight_bytes(config) == expected
    assert W.weight_bytes(config) == expected
    # Between 4.5 and 5 bits a weight: Q4_K (4.5) with the Q6_K (6.56) layers mixed in.
    assert 4.5 < 8 * expected / W.param_count(config) < 5.0


@pytest.mark.parametrize("preset", ["qwen3.5-27b-fp8", "qwen3.5-35b-a3b-fp8"])
def test_fp8_preset_bytes_equal_a_brute_force_count(preset):
    config = _config(preset)
    quant = config.raw["quantization_config"]
    keep = quant["modules_to_not_convert"]
    b0, b1 = quant["weight_block_size"]
    expected = 0
    for name, shape in _hf_tensors(config).items():
        module = name.rsplit(".", 1)[0]
        linear = len(shape) == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
        kept = any(module == k or module.endswith("." + k) for k in keep)
        if linear and not kept:
            expected += math.prod(shape) + math.ceil(shape[0] / b0) * math.ceil(shape[1] / b1) * 2
        else:
            expected += math.prod(shape) * 2
    assert W.quantized_weight_bytes(config) == expected
    bits = 8 * expected / W.param_count(config)
    assert 8.0 < bits < 9.0  # mostly one byte a weight; the bf16 embedding and head add the rest


def test_quantized_presets_shrink_the_bf16_weights_and_report_their_form():
    for base in ("qwen3.5-27b", "qwen3.5-35b-a3b"):
        bf16 = W.weight_bytes(_config(base))
        assert W.param_count(_config(base + "-q4_k_m")) == W.param_count(_config(base))
        assert W.weight_bytes(_config(base + "-q4_k_m")) < W.weight_bytes(_config(base + "-fp8")) < bf16
        rep = capacity_report(_config(base + "-q4_k_m"), context_len=4096, device_memory=80 * 10**9)
        assert rep.weight_bytes == W.weight_bytes(_config(base + "-q4_k_m"))
        assert "Q4_K_M" in rep.weight_source


def test_tensor_parallel_ranks_hold_the_quantized_share():
    config = _config("qwen3.5-27b-q4_k_m")
    total = W.weight_bytes(config)
    assert rank_weight_bytes(config, 1) == total
    per_rank = rank_weight_bytes(config, 2)
    assert total / 2 <= per_rank < total / 2 * 1.01  # the replicated norms are tiny


def test_unknown_quant_method_and_file_type_are_refused():
    config = _config("qwen3.5-27b")
    awq = dataclasses.replace(config, raw={**config.raw, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="quant_method is 'awq'"):
        W.weight_bytes(awq)
    q3 = dataclasses.replace(config, raw={**config.raw, "quantization_config": {"quant_method": "gguf",
                                                                                  "file_type": "Q3_K_M"}})
    with pytest.raises(ConfigError, match="Q3_K_M"):
        W.weight_bytes(q3)


def test_dot_boundary_matching_keeps_the_router_not_gate_proj():
    assert W._module_matches("model.layers.0.mlp.gate", ["mlp.gate"])
    assert not W._module_matches("model.layers.0.mlp.gate_proj", ["mlp.gate"])
    assert W._module_matches("lm_head", ["lm_head"])


def _fixture_files():
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    for model, spec in manifest["models"].items():
        for fname in spec.get("files", {}):
            yield pytest.param(model, spec, fname, id=fname)


@pytest.mark.parametrize("model,spec,fname", list(_fixture_files()))
def test_gguf_plan_is_what_llama_quantize_wrote(model, spec, fname):
    """The planner's types and bytes for the fixture's shape equal the file's, tensor by tensor."""
    import gguf

    from hybridserve.model.tiny import text_config

    cfg = text_config(spec["preset"], **spec["overrides"])
    config = ModelConfig.from_dict(cfg)
    file_type = fname[len(model) + 1:-len(".gguf")]
    plan = {t.name: t for t in W.gguf_tensor_plan(config, file_type)}
    reader = gguf.GGUFReader(str(FIXTURES / fname), "r")
    got = {t.name: (t.tensor_type.name, int(t.n_bytes), tuple(int(s) for s in t.shape)) for t in reader.tensors}
    assert set(got) == set(plan)
    for name, (qtype, nbytes, shape) in got.items():
        assert (plan[name].dtype, plan[name].nbytes, plan[name].shape) == (qtype, nbytes, shape), name
