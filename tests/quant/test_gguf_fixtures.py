"""The GGUF fixtures (``tests/fixtures/gguf``) are what llama.cpp wrote for the tiny
checkpoints the project's generator makes: read with the ``gguf`` package (llama.cpp's
own reader), each file's names, shapes, types, metadata and dequantized values are
checked against the generator's weights put through the converter's documented
transforms (``tests/fixtures/gguf/hf_to_gguf.py``) and llama-quantize's recipe.

This documents the fixture set the GGUF loader is tested on (issue 35); the loader's own
test is ``test_gguf_vs_llamacpp_files.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # a dependency of the project: present wherever it is installed
from gguf.quants import dequantize  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
_spec = importlib.util.spec_from_file_location("hf_to_gguf", FIXTURES / "hf_to_gguf.py")
H2G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H2G)

# The types hybridserve serves (issue 35): what llama-quantize writes for these file types.
SERVED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"}
# Relative RMS error of a dequantized weight against the float32 original, per type:
# about half a quantization step over sqrt(3) for Gaussian weights, with margin.
REL_RMS_BOUND = {"F32": 1e-6, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06,
                 "Q4_K": 0.12, "Q4_0": 0.15}


def _files():
    out = []
    for model, spec in H2G.manifest()["models"].items():
        for fname, info in spec.get("files", {}).items():
            out.append(pytest.param(model, spec, fname, info, id=fname))
    return out


FILES = _files()


def test_the_fixture_set_is_complete():
    """Every model has its files; the dense model every type the loader must serve."""
    m = H2G.manifest()["models"]
    dense = {f[len("qwen35-dense-"):-len(".gguf")] for f in m["qwen35-dense"]["files"]}
    assert dense == {"F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"}
    assert "qwen35-moe-Q4_K_M.gguf" in m["qwen35-moe"]["files"]
    on_disk = {p.name for p in FIXTURES.glob("*.gguf")}
    assert on_disk == {f for spec in m.values() for f in spec["files"]}
    assert sum((FIXTURES / f).stat().st_size for f in on_disk) < 12 * 2**20


def _reader(fname: str):
    return gguf.GGUFReader(str(FIXTURES / fname), "r")


def _field(r, key):
    f = r.fields[key]
    return f.contents()


@pytest.mark.parametrize("model,spec,fname,info", FILES)
def test_file_is_the_one_recorded(model, spec, fname, info):
    data = (FIXTURES / fname).read_bytes()
    assert hashlib.sha256(data).hexdigest() == info["sha256"]
    assert len(data) == info["bytes"]
    types = {t.name: t.tensor_type.name for t in _reader(fname).tensors}
    assert types == info["tensor_types"]
    assert set(types.values()) <= SERVED  # no Q5_0 / Q5_1 fallbacks: every k-quant row is whole blocks


@pytest.mark.parametrize("model,spec,fname,info", FILES)
def test_names_shapes_and_values_are_the_generators_weights(model, spec, fname, info):
    """Each tensor dequantizes (gguf.quants.dequantize) to the generator's weight after the
    converter's transforms, within its type's rounding."""
    expected = H2G.to_gguf(H2G.hf_state(spec), H2G.model_config(spec))
    r = _reader(fname)
    assert {t.name for t in r.tensors} == set(expected)
    for t in r.tensors:
        got = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        want = expected[t.name]
        if t.name.endswith("ffn_gate_inp_shexp.weight"):
            # llama-quantize writes this [H, 1] tensor back with ggml's dimension count, 1.
            want = want.reshape(got.shape)
        assert tuple(got.shape) == tuple(want.shape), t.name
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= REL_RMS_BOUND[t.tensor_type.name], (t.name, t.tensor_type.name, rel)


def _more_bits(i: int, n: int) -> bool:
    # llama-quantize's use_more_bits (src/llama-quant.cpp): first and last eighth, every third between.
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@pytest.mark.parametrize("model,spec,fname,info", FILES)
def test_types_follow_llama_quantizes_recipe(model, spec, fname, info):
    config = H2G.model_config(spec)
    ftype = fname[len(model) + 1:-len(".gguf")]
    base = {"F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K",
            "Q6_K": "Q6_K"}[ftype]
    n = config.num_hidden_layers
    for t in _reader(fname).tensors:
        name, got = t.name, t.tensor_type.name
        kept_f32 = (len([s for s in t.shape if s > 1]) < 2 or "norm" in name or "ssm_conv1d" in name
                    or name.endswith(("ffn_gate_inp.weight", "ssm_a", "ssm_dt.bias")))
        if kept_f32:
            want = "F32"
        elif base in ("F16", "BF16"):
            want = base
        elif name == "output.weight" or (name == "token_embd.weight" and config.tie_word_embeddings):
            want = "Q8_0" if base == "Q8_0" else "Q6_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and (name.endswith(("attn_v.weight", "attn_qkv.weight"))
                                                 or ".ffn_down" in name):
            want = "Q6_K" if _more_bits(int(name.split(".")[1]), n) else base
        else:
            want = base
        assert got == want, (name, got, want)


@pytest.mark.parametrize("model,spec,fname,info", FILES)
def test_metadata_describes_the_generators_model(model, spec, fname, info):
    c = H2G.model_config(spec)
    r = _reader(fname)
    arch = _field(r, "general.architecture")
    assert arch == ("qwen35moe" if c.is_moe else "qwen35")
    k = lambda s: _field(r, f"{arch}.{s}")  # noqa: E731
    assert k("block_count") == c.num_hidden_layers
    assert k("embedding_length") == c.hidden_size
    assert k("attention.head_count") == c.num_attention_heads
    assert k("attention.head_count_kv") == c.num_key_value_heads
    assert k("attention.key_length") == c.head_dim
    assert k("rope.dimension_count") == c.rotary_dim
    assert k("rope.freq_base") == pytest.approx(c.rope_theta)
    assert k("attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps)
    assert k("ssm.conv_kernel") == c.linear_conv_kernel_dim
    assert k("ssm.state_size") == c.linear_key_head_dim
    assert k("ssm.group_count") == c.linear_num_key_heads
    assert k("ssm.time_step_rank") == c.linear_num_value_heads
    assert k("ssm.inner_size") == c.linear_value_dim
    assert list(k("attention.recurrent_layers")) == [t == "linear_attention" for t in c.layer_types]
    if c.is_moe:
        assert k("expert_count") == c.num_experts
        assert k("expert_used_count") == c.num_experts_per_tok
        assert k("expert_feed_forward_length") == c.moe_intermediate_size
        assert k("expert_shared_feed_forward_length") == c.shared_expert_intermediate_size
    else:
        assert k("feed_forward_length") == c.intermediate_size
    # The tokenizer: the default model's BPE cut to the fixture's vocabulary, Qwen3.5's split.
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == c.vocab_size
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "qwen35"
    assert tokens[_field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[_field(r, "tokenizer.ggml.padding_token_id")] == "<|endoftext|>"
    assert len(_field(r, "tokenizer.ggml.merges")) == c.vocab_size - 256 - 9  # 9 added tokens
    assert "<|im_start|>" in _field(r, "tokenizer.chat_template")
