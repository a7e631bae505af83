"""The planner on the mixture-of-experts models (issue 18): exact weight counts with all
experts resident, the shipped presets' published shapes, and the tensor-parallel rule
(sharded vs replicated) that decides how many devices a model needs.

Oracles: HF transformers' ``Qwen3_5MoeForCausalLM`` built on the meta device (no
memory; its parameters are the count), hand arithmetic from the published shapes, and
the shapes as the sources name them (THUDM/slime's model scripts, HF's config class).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve import planner as pl
from hybridserve.config import ModelConfig

PRESETS = Path(pl.__file__).parent.parent / "presets"

# The published text configs (huggingface.co/Qwen/<model>/blob/main/config.json), as
# THUDM/slime's scripts/models/qwen3.5-35B-A3B.sh and qwen3.5-397B-A17B.sh and HF's
# Qwen3_5MoeTextConfig defaults (the 35B-A3B shape) state them; 122B-A10B as a public
# NPU inference config for that checkpoint states it.
PUBLISHED = {
    "qwen3.5-35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "qwen3.5-122b-a10b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                              linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    "qwen3.5-397b-a17b": dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                              linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
}
COMMON = dict(vocab_size=248_320, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, max_position_embeddings=262_144, tie_word_embeddings=False)

# A tiny MoE: 6 experts (not a power of two), top-2, GQA 3, a shared expert.
TINY_MOE = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 500, "hidden_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
    "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
    "shared_expert_intermediate_size": 56, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def _preset(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text())


def _hf_moe(d: dict):
    import torch
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    keep = {k: v for k, v in d.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    with torch.device("meta"):  # shapes only: 397B parameters cost no memory
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**keep))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_shapes_and_name_their_source(name):
    d = _preset(name)
    for key, value in {**PUBLISHED[name], **COMMON}.items():
        assert d[key] == value, key
    assert d["model_type"] == "qwen3_5_moe_text"
    assert "huggingface.co/Qwen/" in d["_source"]
    c = ModelConfig.from_dict(d)
    assert (c.num_full_attention_layers, c.num_linear_attention_layers) == (
        d["num_hidden_layers"] // 4, 3 * d["num_hidden_layers"] // 4)


@pytest.mark.parametrize("name", sorted(PUBLISHED) + ["tiny"])
def test_moe_param_count_matches_hf(name):
    d = TINY_MOE if name == "tiny" else _preset(name)
    model = _hf_moe(d)
    assert pl.param_count(ModelConfig.from_dict(d)) == sum(p.numel() for p in model.parameters())


def test_35b_a3b_by_hand():
    # Per MoE layer: router 256 x 2,048 = 524,288; 256 experts x 3 x 2,048 x 512 =
    # 805,306,368; shared expert 3 x 2,048 x 512 = 3,145,728; its gate 2,048.
    moe_layer = 524_288 + 805_306_368 + 3_145_728 + 2_048
    # Attention layer: q (with gate) 2,048 x 2 x 4,096 = 16,777,216; k, v 2 x 2,048 x 512
    # = 2,097,152; o 4,096 x 2,048 = 8,388,608; q/k norm 2 x 256.
    attn = 16_777_216 + 2_097_152 + 8_388_608 + 512
    # DeltaNet layer: conv channels 2 x 16 x 128 + 32 x 128 = 8,192; in_proj_qkv 2,048 x
    # 8,192 = 16,777,216; z 2,048 x 4,096 = 8,388,608; b, a 2 x 2,048 x 32 = 131,072;
    # conv1d 8,192 x 4 = 32,768; dt_bias, A_log 64; norm 128; out 4,096 x 2,048 = 8,388,608.
    delta = 16_777_216 + 8_388_608 + 131_072 + 32_768 + 64 + 128 + 8_388_608
    embed = 248_320 * 2_048
    norms = 40 * 2 * 2_048 + 2_048
    total = 40 * moe_layer + 10 * attn + 30 * delta + 2 * embed + norms
    c = ModelConfig.from_dict(_preset("qwen3.5-35b-a3b"))
    assert pl.param_count(c) == total == 34_660_610_688
    # 8 of 256 experts run per token: 248 x 3 x 2,048 x 512 x 40 idle.
    assert pl.active_param_count(c) == total - 248 * 3 * 2_048 * 512 * 40
    assert round(pl.active_param_count(c) / 1e9) == 3  # the "A3B"
    # All experts resident, bf16.
    assert pl.weight_bytes(c) == 2 * total


def test_parameters_match_the_names():
    # The names are rounded and count the whole checkpoint (with the vision tower and the
    # MTP head, which a text engine does not load): the language model is within 1.1 %.
    for name, active in (("qwen3.5-35b-a3b", 3), ("qwen3.5-122b-a10b", 10), ("qwen3.5-397b-a17b", 17)):
        c = ModelConfig.from_dict(_preset(name))
        assert round(pl.active_param_count(c) / 1e9) == active
        total = int(name.split("-")[1].removesuffix("b")) * 1e9
        assert abs(pl.param_count(c) - total) < 0.011 * total


def test_vl_wrapper_counts_the_language_model():
    # model_type qwen3_5_moe nests the text config (the published checkpoints' form).
    d = _preset("qwen3.5-35b-a3b")
    text = {k: v for k, v in d.items() if not k.startswith("_")}
    vl = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 27}}
    c = ModelConfig.from_dict(vl)
    assert c.model_type == "qwen3_5_moe" and c.num_experts == 256
    assert pl.param_count(c) == pl.param_count(ModelConfig.from_dict(d))


def test_moe_config_needs_its_expert_fields():
    from hybridserve.errors import ConfigError

    d = dict(TINY_MOE)
    del d["num_experts"]
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_dict(d)
    dense = ModelConfig.from_dict(_preset("qwen3.5-27b"))
    assert (dense.num_experts, dense.shared_expert_intermediate_size) == (0, 0)


# The tensor-parallel rule, by parameter name: replicated = every RMSNorm weight (names
# ending in "norm.weight" / "layernorm.weight"), the router "mlp.gate.weight" and
# "mlp.shared_expert_gate.weight"; everything else sharded.
def _is_replicated(name: str) -> bool:
    return (name.endswith("norm.weight") or name.endswith("mlp.gate.weight")
            or name.endswith("shared_expert_gate.weight"))


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-397b-a17b", "qwen3.5-27b"])
def test_sharded_and_replicated_follow_the_rule_by_parameter_name(name):
    d = TINY_MOE if name == "tiny" else _preset(name)
    if name == "qwen3.5-27b":
        import torch
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        keep = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
        with torch.device("meta"):
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**keep))
    else:
        model = _hf_moe(d)
    replicated = sum(p.numel() for n, p in model.named_parameters() if _is_replicated(n))
    sharded = sum(p.numel() for n, p in model.named_parameters() if not _is_replicated(n))
    split = pl.param_split(ModelConfig.from_dict(d)).values()
    assert sum(s.replicated for s in split) == replicated
    assert sum(s.sharded for s in split) == sharded


def test_weights_per_device():
    # TINY_MOE in bf16 on 2 devices: each holds half the sharded parameters and all the
    # replicated ones (the rule above, counted from HF's parameters by name).
    model = _hf_moe(TINY_MOE)
    rep = sum(p.numel() for n, p in model.named_parameters() if _is_replicated(n))
    shd = sum(p.numel() for n, p in model.named_parameters() if not _is_replicated(n))
    c = ModelConfig.from_dict(TINY_MOE)
    assert pl.weight_bytes_per_device(c, 1) == 2 * (rep + shd)
    assert pl.weight_bytes_per_device(c, 2) == 2 * (-(-shd // 2) + rep)
    # Valid degrees divide 6 attention / 2-4 DeltaNet heads and divide or are a
    # multiple of the 2 KV heads: 1 and 2 (3 does not divide 2 DeltaNet key heads, 4
    # not 6 attention heads).
    assert pl.valid_degrees(c) == [1, 2]
    assert [n for n in range(1, 65) if pl.shard_config(c, n) is not None] == [1, 2]
    s2 = pl.shard_config(c, 2)
    assert (s2.num_attention_heads, s2.num_key_value_heads, s2.linear_num_key_heads,
            s2.linear_num_value_heads) == (3, 1, 1, 2)
