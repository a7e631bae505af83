"""The native decode step on a quantized model: every GEMM entry of a GGUF model's
projections (fused parts of mixed types, permuted columns, float parts, the tied head
and embedding in blocks) gives the module path's logits, step after step.

``_core.kernels.quant_matmul`` (the block GEMM) comes from the qkern branch; where the
extension lacks it, the step is checked with a stand-in of the same contract (``x @
dequantize(w).T`` into ``out``) so the plumbing is tested either way, and without any
kernel the native step declines quantized models."""

import numpy as np
import pytest
import torch

from gguf_helpers import KQUANT_DENSE, KQUANT_MOE, greedy
from hybridserve.model import load_model
from hybridserve.model import native_decode as nd
from hybridserve.model import quant_gemm


def _stand_in(x, w, type_id, out):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    assert x.dtype == np.float32 and out.dtype == np.float32 and w.dtype == np.uint8
    wf = dequantize(w, GGMLQuantizationType(type_id)).astype(np.float32)
    out[...] = x @ wf.T


@pytest.fixture(params=["native" if quant_gemm.quant_matmul_kernel() is not None else "stand-in"])
def kernel(request, monkeypatch):
    if request.param == "stand-in":
        monkeypatch.setattr(quant_gemm, "quant_matmul_kernel", lambda: _stand_in)
        monkeypatch.setattr(nd, "quant_matmul_kernel", lambda: _stand_in)
    return request.param


CASES = {
    "dense-q8_0": dict(preset="test-a", qtype="q8_0"),
    "dense-q4_0-tied": dict(preset="test-b", qtype="q4_0", hidden_size=64, intermediate_size=128,
                            linear_value_head_dim=32),
    # llama-quantize's fallbacks on rows not a multiple of 256 (the default model's
    # Q4_K_M / Q5_K_M files).
    "dense-q5_0-q5_1": dict(preset="test-a", qtype="q5_0", types={"ffn_down": "q5_1", "attn_v": "q5_1"}),
    "dense-q4_k_m": dict(preset="test-a", qtype="q4_k", types={"ffn_down": "q6_k", "attn_v": "q6_k",
                                                                "attn_qkv": "q5_k"}, **KQUANT_DENSE),
    # MoE: the sparse blocks run as their module inside the native step (the routed
    # experts' native call on the file's 3-D blocks, the router and shared expert as
    # Projections), the rest of each layer natively.
    "moe-q8_0": dict(preset="moe-a", qtype="q8_0"),
    "moe-q4_k_m": dict(preset="moe-a", qtype="q4_k", types={"ffn_down": "q6_k"}, **KQUANT_MOE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_step_equals_module_path(case, kernel, gguf_case, monkeypatch):
    path, _, _ = gguf_case(case, **CASES[case])
    model, config = load_model(path, dtype="float32", progress=False)
    assert nd.NativeDecodeStep.applies_to(model)
    step = model._usable_native_step()
    assert step is not None and step.ok and step.quantized
    from hybridserve.quant.gguf.weights import QuantizedExperts

    from hybridserve.quant.ggml import GGMLWeight

    fused = 0
    for m in model.modules():
        if isinstance(m, QuantizedExperts) and all(isinstance(p, GGMLWeight) for w in m.gate_up + m.down
                                                   for p in getattr(w, "parts", [w])):
            # Every kind in blocks (not a float fallback): the loader's per-expert views
            # are recognised as the file's 3-D tensors, and the experts take the one call.
            assert m.blocks is not None
            fused += 1
    if case == "moe-q4_k_m":
        assert fused == config.num_hidden_layers
    calls = []
    real_run = nd.NativeDecodeStep.run
    monkeypatch.setattr(nd.NativeDecodeStep, "run", lambda self, *a: calls.append(1) or real_run(self, *a))
    prompt = [5, 77, 200, 3, 9, 250, 17, 1, 64, 100]
    fast_rows, slow_rows = [], []
    fast = greedy(model, config, prompt, 12, logits=fast_rows)
    assert len(calls) >= 11  # every decode step ran natively
    model.native_decode = False
    try:
        slow = greedy(model, config, prompt, 12, logits=slow_rows)
    finally:
        model.native_decode = True
    assert fast == slow
    # Same products in another order of summation (the kernels' vs the reference's).
    for a, b in zip(fast_rows, slow_rows):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_without_a_block_kernel_quantized_models_take_the_module_path(gguf_case, monkeypatch):
    monkeypatch.setattr(nd, "quant_matmul_kernel", lambda: None)
    path, _, _ = gguf_case("dense-q8_0", **CASES["dense-q8_0"])
    model, _ = load_model(path, dtype="float32", progress=False)
    assert not nd.NativeDecodeStep.applies_to(model)
    assert model._usable_native_step() is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_rows_are_the_modules(dtype, gguf_case):
    """The step looks a quantized embedding's rows up itself (the blocks' rows, one
    dequantize call into its buffer): the module's values bit for bit; ids out of range
    still get the module's IndexError."""
    path, _, _ = gguf_case("dense-q4_0-tied", **CASES["dense-q4_0-tied"])
    model, config = load_model(path, dtype=dtype, progress=False)
    step = model._usable_native_step()
    assert step is not None and step._embed_blocks is not None
    ids = torch.tensor([0, 5, config.vocab_size - 1, 5], dtype=torch.int64)
    out = torch.full((4, config.hidden_size), float("nan"), dtype=model.dtype)
    step._embed(ids, out)
    assert torch.equal(out, model.embed_tokens(ids))
    for bad in (-1, config.vocab_size):
        with pytest.raises(IndexError):
            step._embed(torch.tensor([1, bad]), out[:2])
