"""The native kernels on GGML blocks (``hybridserve.kernels.quant``, ``GGMLWeight``)
against plain-PyTorch references built on the ``gguf`` package's reader:

* the native GEMM equals ``gguf``-dequantized ``W`` times the activation quantized and
  dequantized by :func:`q8_act_ref` (llama.cpp's Q8_0 / Q8_K, in torch) within float
  summation rounding (``RTOL`` of the sum of absolute products);
* and the unquantized product ``x @ W.T`` within the activation quantization's bound:
  ``|sum_i W_i (xq_i - x_i)| <= sum_i |W_i| step_i / 2`` (``step`` the block's scale;
  Q8_0's scale is rounded to float16, which adds ``127 |d - f16(d)| <= d / 16``);
* on every instruction set this CPU runs (``isa=`` forces one).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import quant as qk
from hybridserve.quant.ggml import GGML_TYPES, PREFILL_INT8_ISAS, GGMLWeight
from hybridserve.quant.tiles import native_max_rows
from hybridserve.quant.ggml_quantize import quantize

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not qk.available(), reason="extension built without the quantized kernels")

TYPES = list(GGML_TYPES)
ISAS = ["scalar", "avx2", "avx512_vnni"]
_ORDER = {"scalar": 0, "avx2": 1, "avx512_vnni": 2, "none": -1}
# Float32 rounding of the kernels' few float steps (per block or super-block), relative
# to the sum of the products' magnitudes.
RTOL = 1e-5


def _weight(qtype, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] += 0.1                                  # rows with a large mean (the k-quants' min)
    return GGMLWeight(qtype, torch.from_numpy(quantize(w.numpy(), qtype)), (n, k))


def _x(t, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, 5] *= 8                                 # an outlier per row, as activations have
    return x.to(dtype)


def _check_vs_reference(y, x, wref, k_quant, out_bf16=False):
    xq = qk.q8_act_ref(x.float(), k_quant).double()
    p = xq[:, None, :] * wref.double()[None]     # [T, N, K] products
    ref, mag = p.sum(-1), p.abs().sum(-1)
    tol = RTOL * mag + 1e-6
    if out_bf16:
        tol = tol + ref.abs() * 2.0 ** -8        # one bfloat16 rounding of the output
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, excess {(err - tol).max():.3g}"
    return ref


def _act_bound(x, wref, k_quant):
    """``sum_i |W_i| |xq_i - x_i|``'s upper bound from the blocks' scales."""
    x = x.float()
    t, k = x.shape
    bs = 256 if k_quant else 32
    amax = x.reshape(t, k // bs, bs).abs().amax(-1, keepdim=True)
    step = amax / 127 * (0.5 if k_quant else 0.5 + 1 / 16)
    half = step.expand(t, k // bs, bs).reshape(t, k)
    return half.double() @ wref.abs().double().T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_native_gemm_matches_references(qtype, isa):
    if _ORDER[isa] > _ORDER[qk.isa()]:
        pytest.skip(f"this CPU cannot run {isa}")
    k_quant = qtype.endswith("_k")
    k = 512
    w = _weight(qtype, 67, k, seed=1)
    wref = w.dequantize()
    for t in range(1, 18):
        x = _x(t, k, seed=t)
        y = qk.matmul(x, w.data, w.type.ggml_id, isa=isa)
        assert y.shape == (t, 67) and y.dtype == torch.float32
        _check_vs_reference(y, x, wref, k_quant)
        exact = (x.double() @ wref.double().T)
        assert ((y.double() - exact).abs() <= _act_bound(x, wref, k_quant) * 1.001 + 1e-5).all()
        # bfloat16 activations, bfloat16 out (the bfloat16 model's decode path).
        xb = x.to(torch.bfloat16)
        yb = qk.matmul(xb, w.data, w.type.ggml_id, isa=isa)
        assert yb.dtype == torch.bfloat16
        _check_vs_reference(yb.float(), xb, wref, k_quant, out_bf16=True)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_dispatch_decode_and_prefill(qtype, dtype):
    k_quant = qtype.endswith("_k")
    w = _weight(qtype, 300, 768, seed=2)
    wref = w.dequantize()
    # Decode-sized (native GEMM, 3-D input) ...
    x = _x(6, 768, seed=3, dtype=dtype).reshape(2, 3, 768)
    y = w.linear(x)
    assert y.shape == (2, 3, 300) and y.dtype == dtype
    _check_vs_reference(y.reshape(6, 300).float(), x.reshape(6, 768), wref, k_quant,
                        out_bf16=dtype == torch.bfloat16)
    # ... and prefill-sized: on a VNNI CPU the many-row int8 GEMM, which is the few-row
    # kernel's rounding and its scalar path's results exactly; elsewhere dequantized
    # tiles and torch's GEMM on unquantized x, which is F.linear on the reference weight
    # (rounded to x's dtype) up to GEMM rounding.
    t = native_max_rows(qtype) + 9
    x = _x(t, 768, seed=4, dtype=dtype)
    y = w.linear(x)
    if qk.isa() in PREFILL_INT8_ISAS:
        assert y.dtype == dtype and torch.equal(y, qk.matmul(x, w.data, w.type.ggml_id, isa="scalar"))
        _check_vs_reference(y.float(), x, wref, k_quant, out_bf16=dtype == torch.bfloat16)
        return
    ref = F.linear(x.double(), wref.to(dtype).double())
    mag = x.double().abs() @ wref.to(dtype).double().abs().T
    tol = mag * (RTOL if dtype == torch.float32 else 2.0 ** -7)
    assert y.dtype == dtype and ((y.double() - ref).abs() <= tol + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_prefill_gemm_equals_the_few_row_kernel(qtype, isa):
    """The many-row GEMM (``matmul_prefill``) row by row: on VNNI (the tiled int8
    kernel) bit for bit the few-row kernels, scalar and SIMD, for every type (one float
    order on every path); on the other instruction sets it is the few-row kernel itself. And within
    float rounding of the torch reference of llama.cpp's activation rounding times
    ``gguf``'s dequantize."""
    if _ORDER[isa] > _ORDER[qk.isa()]:
        pytest.skip(f"this CPU cannot run {isa}")
    k_quant = qtype.endswith("_k")
    k = 512
    w = _weight(qtype, 83, k, seed=5)           # 83: several 16-row tiles, a short last one
    wref = w.dequantize()
    for t in (1, 5, 33, 70):
        for dtype in (torch.float32, torch.bfloat16):
            x = _x(t, k, seed=10 + t, dtype=dtype)
            y = qk.matmul_prefill(x, w.data, w.type.ggml_id, isa=isa)
            assert y.shape == (t, 83) and y.dtype == dtype
            few = qk.matmul(x, w.data, w.type.ggml_id, isa=isa)
            assert torch.equal(y, qk.matmul(x, w.data, w.type.ggml_id, isa="scalar")), (t, dtype)
            assert torch.equal(y, few), (t, dtype)
            _check_vs_reference(y.float(), x, wref, k_quant, out_bf16=dtype == torch.bfloat16)
    # Strided rows are taken as the few-row kernel takes them.
    x = _x(40, 2 * k, seed=3)[:, :k]
    assert torch.equal(qk.matmul_prefill(x, w.data, w.type.ggml_id, isa=isa),
                       qk.matmul_prefill(x.contiguous(), w.data, w.type.ggml_id, isa=isa))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_and_embedding_are_the_reference_rows(qtype):
    w = _weight(qtype, 50, 512, seed=5)
    wref = w.dequantize()
    torch.testing.assert_close(qk.dequantize(w.data, w.type.ggml_id, 512), wref, rtol=0, atol=0)
    torch.testing.assert_close(qk.dequantize(w.data, w.type.ggml_id, 512, torch.bfloat16),
                               wref.to(torch.bfloat16), rtol=0, atol=0)
    ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
    e = w.embedding(ids)
    assert e.shape == (2, 3, 512)
    torch.testing.assert_close(e, wref[ids], rtol=0, atol=0)
    torch.testing.assert_close(w.embedding(ids, torch.bfloat16), wref[ids].to(torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(IndexError, match="ids must lie"):
        w.embedding(torch.tensor([50]))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_view_is_one_expert(qtype):
    # MoE experts stacked [E * N, K]: rows(a, b) is one expert's weight, a view.
    w = _weight(qtype, 4 * 40, 256, seed=6)
    x = _x(3, 256, seed=7)
    full = w.linear(x)
    for e in range(4):
        part = w.rows(40 * e, 40 * (e + 1))
        assert part.data.data_ptr() == w.data[40 * e].data_ptr()
        torch.testing.assert_close(part.linear(x), full[:, 40 * e:40 * (e + 1)], rtol=0, atol=0)


def test_fallback_without_the_extension(monkeypatch):
    w = _weight("q4_k", 20, 256, seed=8)
    x = _x(2, 256, seed=9)
    monkeypatch.setattr(qk, "_k", None)
    torch.testing.assert_close(w.linear(x), F.linear(x, w.dequantize()), rtol=0, atol=0)
    torch.testing.assert_close(w.embedding(torch.tensor([3])), w.dequantize()[[3]], rtol=0, atol=0)


def test_bad_calls_are_refused():
    w = _weight("q8_0", 4, 64, seed=10)
    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="no native kernel"):
        qk.matmul(x, w.data, 3)
    with pytest.raises(ValueError, match="isa must be"):
        qk.matmul(x, w.data, 8, isa="sse2")
    with pytest.raises(ValueError, match="w must be"):
        qk.matmul(torch.zeros(1, 96), w.data, 8)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        qk.matmul(x.double(), w.data, 8)
