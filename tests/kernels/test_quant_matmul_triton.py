"""Triton FP8 block-scaled and int4 GEMMs vs the plain-PyTorch reference (``x @ W.T``
with the weight's ``dequantize``, the formats' definitions), under the interpreter.

Shapes that are not multiples of the tiles (masked rows, columns and, for FP8, a last
partial K block), an FP8 weight that starts inside a scale block (``rows``), int4 group
sizes 64 and 128, float32 and float16 activations (the interpreter has no bfloat16
arithmetic)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridserve.kernels.quant_matmul_triton import fp8_matmul_triton, int4_matmul_triton  # noqa: E402
from hybridserve.quant.awq import AWQWeight  # noqa: E402
from hybridserve.quant.fp8 import FP8BlockWeight  # noqa: E402
from hybridserve.quant.tiny import awq_quantize, fp8_quantize  # noqa: E402


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    err = float((got.float() - want).abs().max() / want.abs().max().clamp(min=1.0))
    assert err <= tol, err


@pytest.mark.parametrize("m,n,k,start", [(1, 70, 128, 0), (5, 130, 200, 0), (17, 64, 256, 37), (3, 200, 384, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_matches_the_reference(m, n, k, start, dtype):
    g = torch.Generator().manual_seed(m + n)
    q, s, _ = fp8_quantize(torch.randn(start + n, k, generator=g))
    w = FP8BlockWeight(q, s).rows(start, start + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    want = x.float() @ w.dequantize().T
    got = fp8_matmul_triton(x, w.weight, w.scale, w.row_offset)
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, want, dtype)


@pytest.mark.parametrize("m,n,k,group", [(1, 40, 128, 128), (6, 72, 256, 128), (19, 24, 192, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_matches_the_reference(m, n, k, group, dtype):
    g = torch.Generator().manual_seed(m * n)
    qw, qz, sc, _ = awq_quantize(torch.randn(n, k, generator=g), group)
    w = AWQWeight.from_awq(qw, qz, sc, group)
    x = torch.randn(m, k, generator=g).to(dtype)
    want = x.float() @ w.dequantize().T
    got = int4_matmul_triton(x, w.packed, w.scales, w.zeros, group)
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, want, dtype)


def test_int4_refuses_a_group_that_is_not_whole_runs():
    with pytest.raises(ValueError, match="multiple of 64"):
        int4_matmul_triton(torch.zeros(1, 96), torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1),
                           torch.zeros(8, 1), 96)
