"""Weight-only quantized GEMMs in Triton: FP8 block-scaled (W8A16) and int4 (W4A16).

Contracts (the plain-PyTorch references are the weights' own ``dequantize``: ``x @
W.T`` with ``W = weight.dequantize()``, :mod:`hybridserve.quant.fp8` and
:mod:`hybridserve.quant.awq`):

- :func:`fp8_linear`: ``x [..., K]`` (float32 / bfloat16 / float16) times an
  :class:`~hybridserve.quant.fp8.FP8BlockWeight` (e4m3 bytes ``[N, K]``, float32 scale
  per 128 x 128 block, ``row_offset``), in ``x``'s dtype.
- :func:`int4_linear`: the same for an :class:`~hybridserve.quant.awq.AWQWeight`
  (nibbles ``[N, K / 2]`` in runs of 64 inputs: byte ``i`` of a run holds input ``i``
  low and ``32 + i`` high; float32 scale and zero point per group).

Launch: grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; each program accumulates one
``[BLOCK_M, BLOCK_N]`` output tile in float32 over K. FP8: K steps of 128 (one scale
column per step): the e4m3 bytes are widened exactly (bit placement, times ``2^120``;
e4m3 values are exact in bfloat16 / float16), ``tl.dot`` of ``x`` with the raw values,
then the step's partial sum times each output row's block scale (the scale applied in
float32, after the dot). int4: K steps of 64 (one run, inside one group): the two
nibble halves minus the zero point (exact small integers) in two ``tl.dot`` calls,
times the group's scale. ``x`` in float32 uses IEEE float32 dots (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_linear", "int4_linear", "fp8_matmul_triton", "int4_matmul_triton"]


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, row_offset, stride_xm, stride_om, scale_cols,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    srow = (row_offset + rn) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k = kt * BLOCK_K + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        w = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        part = _dot(x, tl.trans(w.to(x.dtype)), IEEE)
        s = tl.load(s_ptr + srow * scale_cols + kt, mask=n_ok, other=0.0)
        acc += part * s[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, GROUP, stride_xm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    HALF: tl.constexpr = 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, HALF)
    m_ok = rm < M
    n_ok = rn < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, K // 64):
        k0 = kt * 64
        xm = rm[:, None].to(tl.int64) * stride_xm
        x_lo = tl.load(x_ptr + xm + (k0 + rh)[None, :], mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptr + xm + (k0 + HALF + rh)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + (kt * HALF + rh)[None, :],
                    mask=n_ok[:, None], other=0).to(tl.int32)
        g = k0 // GROUP
        z = tl.load(z_ptr + rn * groups + g, mask=n_ok, other=0.0)
        s = tl.load(s_ptr + rn * groups + g, mask=n_ok, other=0.0)
        lo = ((b & 0xF).to(tl.float32) - z[:, None]).to(x_lo.dtype)
        hi = ((b >> 4).to(tl.float32) - z[:, None]).to(x_lo.dtype)
        part = _dot(x_lo, tl.trans(lo), IEEE) + _dot(x_hi, tl.trans(hi), IEEE)
        acc += part * s[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _blocks(m: int) -> tuple[int, int]:
    return (16 if m <= 16 else 64), 64


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """``x [M, K] @ W.T`` for the FP8 block-scaled ``W`` (``weight`` uint8 ``[N, K]``)."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bm, bn = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_kernel[grid](x, weight.contiguous(), scale.contiguous(), out, m, n, k, int(row_offset), x.stride(0),
                      out.stride(0), scale.shape[1], BLOCK_M=bm, BLOCK_N=bn, IEEE=x.dtype == torch.float32)
    return out


def int4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` for the int4 ``W`` (``packed`` uint8 ``[N, K / 2]`` in runs)."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    if group_size % 64 or k % group_size:
        raise ValueError(f"int4 group size must be a multiple of 64 dividing K={k}, got {group_size}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bm, bn = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_kernel[grid](x, packed.contiguous(), scales.contiguous(), zeros.contiguous(), out, m, n, k,
                       int(group_size), x.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                       IEEE=x.dtype == torch.float32)
    return out


def fp8_linear(x: torch.Tensor, w) -> torch.Tensor:
    """:meth:`FP8BlockWeight.linear` on CUDA: ``x [..., K]``, any leading shape."""
    y = fp8_matmul_triton(x.reshape(-1, x.shape[-1]), w.weight, w.scale, w.row_offset)
    return y.reshape(*x.shape[:-1], w.shape[0])


def int4_linear(x: torch.Tensor, w) -> torch.Tensor:
    """:meth:`AWQWeight.linear` on CUDA: ``x [..., K]``, any leading shape."""
    y = int4_matmul_triton(x.reshape(-1, x.shape[-1]), w.packed, w.scales, w.zeros, w.group_size)
    return y.reshape(*x.shape[:-1], w.shape[0])
