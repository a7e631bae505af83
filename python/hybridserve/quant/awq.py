"""AWQ int4 weights (``quant_method: awq``, ``version: gemm``, zero point on).

The checkpoint stores a linear's weight ``W [out, in]`` transposed and packed, per
AutoAWQ's GEMM layout:

- ``qweight`` int32 ``[in, out / 8]``: eight 4-bit values per int32; nibble ``i`` (bits
  ``4i..4i+3``) holds output column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6,
  1, 3, 5, 7]`` (AutoAWQ's ``gemm`` packing, vLLM's ``awq_triton`` unpacking);
- ``qzeros`` int32 ``[in / g, out / 8]``: the zero points, packed the same way;
- ``scales`` float16 ``[in / g, out]``.

``W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (:func:`awq_dequantize`), the
oracle every kernel is tested against.

At load the weight is repacked once into the layout both kernels read (same bytes per
weight, 0.5): :class:`AWQWeight` holds ``packed`` uint8 ``[out, in / 2]`` row-major
(an output's weights contiguous, as the float kernels read them); within each run of 64
inputs, byte ``i`` holds input ``i`` in its low nibble and input ``32 + i`` in its high
one, so one 32-byte load unpacks into two runs of 32 consecutive inputs with a mask and
a shift. ``scales`` and ``zeros`` become float32 ``[out, in / g]``.
"""

from __future__ import annotations

import torch

from hybridserve.kernels import quant_native
from hybridserve.quant.tiles import cpu_linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Nibble index of column 8c + j: the inverse permutation of AWQ_ORDER.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# Inputs per packed run (32 bytes): the kernels' unit.
RUN = 64


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C / 8]`` in AWQ's nibble order -> int32 values 0..15 ``[R, C]``."""
    shifts = torch.tensor([4 * i for i in AWQ_REVERSE_ORDER], dtype=torch.int32, device=packed.device)
    v = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return v.reshape(packed.shape[0], -1)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The format's definition: ``W [out, in]`` from AWQ's GEMM tensors."""
    q = awq_unpack(qweight).float()                                  # [in, out]
    z = awq_unpack(qzeros).float().repeat_interleave(group_size, 0)  # [in, out]
    s = scales.float().repeat_interleave(group_size, 0)
    return ((q - z) * s).t().contiguous().to(dtype)


def _pack_runs(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 ``[out, in]`` -> the kernels' uint8 ``[out, in / 2]``."""
    out, inp = q.shape
    r = q.to(torch.uint8).reshape(out, inp // RUN, 2, RUN // 2)
    return (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(out, inp // 2).contiguous()


def _unpack_runs(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    r = packed.reshape(out, half // (RUN // 2), 1, RUN // 2)
    return torch.cat([r & 0xF, r >> 4], dim=2).reshape(out, half * 2)


class AWQWeight:
    """``[out, in]`` int4 weight, group size ``group_size`` along ``in``, zero points;
    in the kernels' layout (see the module's doc). Build from a checkpoint with
    :meth:`from_awq`."""

    qtype = "awq_int4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
        out = packed.shape[0]
        inp = packed.shape[1] * 2
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"packed int4 weight must be uint8 [out, in / 2], got {packed.dtype} {list(packed.shape)}")
        if group_size % RUN or inp % group_size:
            raise ValueError(f"int4 group size must be a multiple of {RUN} dividing in_features {inp}; got {group_size}")
        want = (out, inp // group_size)
        if tuple(scales.shape) != want or tuple(zeros.shape) != want:
            raise ValueError(f"scales and zeros of an int4 weight {[out, inp]} (group {group_size}) must be {list(want)}, "
                             f"got {list(scales.shape)} and {list(zeros.shape)}")
        self.packed = packed.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self.zeros = zeros.to(torch.float32).contiguous()
        self.group_size = int(group_size)
        self.shape = (int(out), int(inp))

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 name: str = "weight") -> "AWQWeight":
        """From the checkpoint's GEMM-layout tensors; ValueError naming ``name`` when
        their shapes do not fit together."""
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
            raise ValueError(f"{name}: AWQ qweight and qzeros must be 2-D int32, got {qweight.dtype} "
                             f"{list(qweight.shape)} and {qzeros.dtype} {list(qzeros.shape)}")
        inp, out = qweight.shape[0], qweight.shape[1] * 8
        if inp % group_size:
            raise ValueError(f"{name}: in_features {inp} is not a multiple of group_size {group_size}")
        groups = inp // group_size
        if tuple(qzeros.shape) != (groups, out // 8) or tuple(scales.shape) != (groups, out):
            raise ValueError(f"{name}: AWQ tensors do not fit together: qweight {list(qweight.shape)} means "
                             f"[in={inp}, out={out}], so qzeros must be [{groups}, {out // 8}] and scales "
                             f"[{groups}, {out}] (group_size {group_size}); got {list(qzeros.shape)} and "
                             f"{list(scales.shape)}")
        q = awq_unpack(qweight).t()
        z = awq_unpack(qzeros).t()
        return cls(_pack_runs(q), scales.t(), z, group_size)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 4 * (self.scales.numel() + self.zeros.numel())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = _unpack_runs(self.packed).float()
        g = self.group_size
        z = self.zeros.repeat_interleave(g, 1)
        s = self.scales.repeat_interleave(g, 1)
        return ((q - z) * s).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            from hybridserve.kernels.quant_matmul_triton import int4_linear
            return int4_linear(x, self)
        return cpu_linear(self, x)

    def native(self, x2: torch.Tensor) -> torch.Tensor | None:
        """``x2 [M, in] @ W.T`` on the native kernel, or None where it cannot run."""
        return quant_native.awq_matmul(x2, self.packed, self.scales, self.zeros, self.group_size)

    def rows(self, start: int, stop: int) -> "AWQWeight":
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} out of range for {self.shape[0]} rows")
        return AWQWeight(self.packed[start:stop], self.scales[start:stop], self.zeros[start:stop], self.group_size)

    def cols(self, start: int, stop: int) -> "AWQWeight":
        """Columns ``start:stop``, whole groups only (each group has its own scale and zero
        point per output: a split inside one would need a re-quantization); SliceError
        otherwise. Rows split anywhere (the repacked layout is row-major; the
        checkpoint's packing of 8 output columns per int32 is undone at load)."""
        from hybridserve.quant.weight import SliceError, check_cols

        check_cols(self, start, stop)
        g = self.group_size
        if start % g or stop % g:
            raise SliceError(f"AWQ int4 holds groups of {g} input columns; columns {start}:{stop} cut through "
                             f"one (a split must fall on a multiple of {g})")
        return AWQWeight(self.packed[:, start // 2:stop // 2], self.scales[:, start // g:stop // g],
                         self.zeros[:, start // g:stop // g], g)

    def to(self, device) -> "AWQWeight":
        return AWQWeight(self.packed.to(device), self.scales.to(device), self.zeros.to(device), self.group_size)

    def __repr__(self) -> str:
        return f"AWQWeight({list(self.shape)}, group_size={self.group_size})"
