"""A GGUF checkpoint served from its blocks against HF on the dequantized weights.

Files come from the test-side writer (tests/quant/gguf_files.py: llama.cpp's layout,
names and transforms, written with ``gguf.GGUFWriter``); the oracle is HF's
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on the weights the file holds, read back
with the ``gguf`` package's ``dequantize`` and the converter's transforms undone by the
writer's own code.

Bounds (gguf_helpers' ``LOGIT_BOUND``, stated there with the reasons): each test runs on
the reference products (float activations: 1e-4 of the largest |logit|, float32
summation order; greedy tokens equal outright) and on the native block kernels, which
round activations to 8 bits per block as llama.cpp does; there the oracle applies the
same rounding at the same products (``round_like_kernels``), the bound is 3 % of the
largest |logit|, and greedy tokens are checked step by step on HF's tokens: equal
wherever HF's top-2 margin is wider than the error bound allows.
"""

import random

import pytest
import torch

from gguf_helpers import (KQUANT_DENSE, KQUANT_MOE, LOGIT_BOUND, check_greedy, forced_decode_logits, greedy, hf_greedy,
                      hf_oracle, prompt_logits, round_like_kernels)
from hybridserve.model import load_model
from hybridserve.quant import ConcatWeight


CASES = {
    # name: write_gguf kwargs
    "dense-q8_0": dict(preset="test-a", qtype="q8_0"),             # value heads grouped 2:1 (reordered)
    # Tied head from the embedding's blocks (test-b widened so every input holds 32-blocks).
    "dense-q4_0-tied": dict(preset="test-b", qtype="q4_0", hidden_size=64, intermediate_size=128,
                            linear_value_head_dim=32),
    "dense-q5_0-q5_1": dict(preset="test-a", qtype="q5_0", types={"ffn_down": "q5_1", "attn_v": "q5_1"}),
    "dense-f16": dict(preset="test-a", qtype="f16"),
    "dense-bf16-tied": dict(preset="test-b", qtype="bf16"),
    "dense-q4_k_m": dict(preset="test-a", qtype="q4_k", types={"ffn_down": "q6_k", "attn_v": "q6_k",
                                                                "attn_qkv": "q5_k"}, **KQUANT_DENSE),
    "dense-q5_k-f32-embed": dict(preset="test-a", qtype="q5_k", embed_qtype="f32", **KQUANT_DENSE),
    "dense-q6_k": dict(preset="test-a", qtype="q6_k", **KQUANT_DENSE),
    "moe-q8_0": dict(preset="moe-a", qtype="q8_0"),
    "moe-q4_0-tied": dict(preset="moe-b", qtype="q4_0", hidden_size=64, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, linear_value_head_dim=32),
    # moe-b as it is: most inputs (48, 24 wide) hold no whole block, so the file mixes F32
    # experts with a Q4_0 shared expert, as llama-quantize's fallbacks do.
    "moe-mixed-fallback": dict(preset="moe-b", qtype="q4_0"),
    "moe-q4_k_m": dict(preset="moe-a", qtype="q4_k", types={"ffn_down": "q6_k"}, **KQUANT_MOE),
}


def _prompt(seed, n=24, vocab=259):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_equal_hf_on_dequantized_weights(case, gguf_case, kernel_path):
    path, text, oracle_dir = gguf_case(case, **CASES[case])
    model, config = load_model(path, dtype="float32", progress=False)
    hf = hf_oracle(oracle_dir)
    if kernel_path == "native":
        round_like_kernels(hf, path)
    bound = LOGIT_BOUND[kernel_path]
    prompt = _prompt(1)
    ours = prompt_logits(model, config, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=0, atol=bound * float(ref.abs().max()))
    # 16 greedy tokens: HF's, and our logits on the same tokens step by step.
    want, hf_rows = hf_greedy(hf, prompt, 16)
    ties = check_greedy(forced_decode_logits(model, config, prompt, want), want, hf_rows, bound)
    assert ties <= 2, f"{ties} of 16 steps are ties within the bound: the test says little there"
    if kernel_path == "reference":
        # Float activations: our own free-running greedy equals HF's outright.
        assert greedy(model, config, prompt, 16) == want


@pytest.mark.parametrize("case", ["dense-q4_k_m", "moe-q4_k_m", "dense-q4_0-tied", "moe-q4_0-tied"])
def test_block_tensors_stay_blocks(case, gguf_case):
    """Every block tensor is served from its bytes: no float copy of it exists."""
    path, _, _ = gguf_case(case, **CASES[case])
    model, config = load_model(path, dtype="float32", progress=False)
    layer = model.layers[0]
    mixer = layer.linear_attn
    assert mixer.in_proj.weight is None and isinstance(mixer.in_proj.qweight, ConcatWeight)
    assert mixer.out_proj.weight is None
    assert type(model.embed_tokens).__name__ == "QuantizedEmbedding"
    if config.tie_word_embeddings:
        assert model.lm_head.qweight is model.embed_tokens.qweight
    if config.is_moe:
        assert getattr(layer.mlp.experts, "quantized", False)
        assert not any(p.numel() > config.hidden_size * 8 for p in layer.mlp.parameters())
    # The types the file holds, as stored (Q4_K_M keeps some tensors in Q6_K / Q5_K).
    types = {p.qtype for p in mixer.in_proj.qweight.parts}
    assert types <= {"q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "f32"}
    # The blocks' bytes are what is held: about 4.5-8.5 bits per weight, not 32.
    quantized = [m.qweight for m in model.modules() if getattr(m, "qweight", None) is not None]
    elements = sum(q.shape[0] * q.shape[1] for q in quantized)
    assert 0 < sum(q.nbytes for q in quantized) <= elements * 8.5 / 8


@pytest.mark.parametrize("preset", ["test-a", "moe-a"])
def test_mtp_layer_loads_from_nextn_tensors(preset, gguf_case):
    """The MTP layer (block num_hidden_layers, nextn.* tensors) holds the oracle's weights:
    our safetensors loader (itself tested against HF) on the oracle directory is the
    reference, module by module."""
    path, _, oracle_dir = gguf_case(f"mtp-{preset}", preset=preset, qtype="q8_0", mtp=True)
    ours, config = load_model(path, dtype="float32", progress=False, load_mtp=True)
    ref, _ = load_model(oracle_dir, dtype="float32", progress=False, load_mtp=True)
    ref_params = dict(ref.mtp.named_parameters())
    seen = 0
    for name, m in ours.mtp.named_modules():
        q = getattr(m, "qweight", None)
        if q is not None:
            torch.testing.assert_close(q.dequantize(), ref.mtp.get_submodule(name).weight, rtol=0, atol=0)
            seen += 1
    assert seen >= 4  # fc, qkv, o, the MLP's / shared expert's projections
    for name, p in ours.mtp.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-6, atol=1e-6)
    if config.is_moe:
        ex, rex = ours.mtp.layers[0].mlp.experts, ref.mtp.layers[0].mlp.experts
        for e in range(ex.num):
            torch.testing.assert_close(ex.gate_up[e].dequantize(), rex.gate_up_proj[e], rtol=0, atol=0)
            torch.testing.assert_close(ex.down[e].dequantize(), rex.down_proj[e], rtol=0, atol=0)
    # Without load_mtp the nextn tensors are skipped silently; a file without them is
    # refused for speculative decoding.
    plain, _, _ = gguf_case("dense-q8_0", **CASES["dense-q8_0"])
    from hybridserve.errors import ConfigError
    with pytest.raises(ConfigError, match="MTP"):
        load_model(plain, progress=False, load_mtp=True)
