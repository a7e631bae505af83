"""FP8 block-scaled weights: Qwen's (and DeepSeek's) official FP8 checkpoints.

A weight ``[out, in]`` is stored as float8 e4m3 (``torch.float8_e4m3fn``) with one
float32 scale per 128 x 128 block, ``weight_scale_inv [ceil(out/128), ceil(in/128)]``.
Despite its name the scale multiplies: ``W[i, j] = fp8[i, j] * scale[i // 128, j // 128]``
(transformers' ``finegrained_fp8`` and DeepSeek-V3's ``weight_dequant``); that product
is :meth:`FP8BlockWeight.dequantize`, the oracle every kernel here is tested against.

Served weight-only (W8A16): activations stay float32 / bfloat16; decode reads one byte
per weight instead of bfloat16's two. On the CPU a few rows go to the native kernel
(``hybridserve._core.fp8_matmul``: e4m3 widened in registers, float32 FMAs), longer
inputs through dequantized tiles into torch's GEMM; on CUDA tensors to the Triton
kernel (:mod:`hybridserve.kernels.quant_matmul_triton`).
"""

from __future__ import annotations

import torch

from hybridserve.kernels import quant_native
from hybridserve.quant.tiles import cpu_linear

BLOCK = 128
FP8 = torch.float8_e4m3fn


def block_scales_expanded(scale: torch.Tensor, rows: int, cols: int, row_offset: int = 0) -> torch.Tensor:
    """``scale`` per 128 x 128 block -> one per element ``[rows, cols]`` (rows start
    ``row_offset`` into the first block row)."""
    s = scale.repeat_interleave(BLOCK, 0)[row_offset:row_offset + rows]
    return s.repeat_interleave(BLOCK, 1)[:, :cols]


class FP8BlockWeight:
    """``[out, in]`` e4m3 weight (``weight`` uint8 bits or float8_e4m3fn) with its
    128 x 128 block scales (``scale`` float32 ``[ceil((row_offset + out)/128), ceil(in/128)]``).

    ``row_offset`` (0..127): where row 0 sits in its scale block, so that any row range
    (:meth:`rows`: a fused projection's part, a tensor-parallel shard) is a view."""

    qtype = "fp8_e4m3_b128"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, row_offset: int = 0):
        if weight.dtype == FP8:
            weight = weight.view(torch.uint8)
        if weight.dtype != torch.uint8 or weight.dim() != 2:
            raise ValueError(f"FP8 weight must be 2-D float8_e4m3fn (or its uint8 bits), got {weight.dtype} "
                             f"{list(weight.shape)}")
        out, inp = weight.shape
        if not 0 <= row_offset < BLOCK:
            raise ValueError(f"row_offset must be in 0..{BLOCK - 1}, got {row_offset}")
        want = (-(-(row_offset + out) // BLOCK), -(-inp // BLOCK))
        if scale.dim() != 2 or tuple(scale.shape) != want:
            raise ValueError(f"weight_scale_inv of an FP8 weight {[out, inp]} with 128x128 blocks must be "
                             f"{list(want)}, got {list(scale.shape)}")
        self.weight = weight.contiguous()
        self.scale = scale.to(torch.float32).contiguous()
        self.row_offset = int(row_offset)
        self.shape = (int(out), int(inp))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight.view(FP8).to(torch.float32)
        return (w * block_scales_expanded(self.scale, *self.shape, self.row_offset)).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            from hybridserve.kernels.quant_matmul_triton import fp8_linear
            return fp8_linear(x, self)
        return cpu_linear(self, x)

    def native(self, x2: torch.Tensor) -> torch.Tensor | None:
        """``x2 [M, in] @ W.T`` on the native kernel, or None where it cannot run."""
        return quant_native.fp8_matmul(x2, self.weight, self.scale, self.row_offset)

    def rows(self, start: int, stop: int) -> "FP8BlockWeight":
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} out of range for {self.shape[0]} rows")
        a = self.row_offset + start
        b = self.row_offset + stop
        first, last = a // BLOCK, max(-(-b // BLOCK), a // BLOCK + 1)
        return FP8BlockWeight(self.weight[start:stop], self.scale[first:last], a - first * BLOCK)

    def cols(self, start: int, stop: int):
        """Columns ``start:stop``. The scale multiplies each element, so any split is exact:
        on a 128-column boundary the shard is an FP8BlockWeight of its own (its scale
        columns a view); inside a scale block it is widened to that block's first column,
        the extra leading columns' bits zeroed, and served as a
        :class:`~hybridserve.quant.weight.ColumnWindowWeight` (the activation padded with
        zeros): no re-quantization, at most 127 extra columns held."""
        from hybridserve.quant.weight import ColumnWindowWeight, check_cols

        check_cols(self, start, stop)
        first = start // BLOCK * BLOCK
        w = self.weight[:, first:stop].clone()
        scale = self.scale[:, first // BLOCK:-(-stop // BLOCK)]
        if first == start:
            return FP8BlockWeight(w, scale, self.row_offset)
        w[:, :start - first] = 0  # e4m3 +0: the padded activation's zeros times zero
        return ColumnWindowWeight(FP8BlockWeight(w, scale, self.row_offset), start - first, stop - first)

    def to(self, device) -> "FP8BlockWeight":
        return FP8BlockWeight(self.weight.to(device), self.scale.to(device), self.row_offset)

    def __repr__(self) -> str:
        return f"FP8BlockWeight({list(self.shape)}, row_offset={self.row_offset})"
