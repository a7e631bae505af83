"""The contract every quantized weight keeps, the row-stacked weight of a fused
projection, the float weight that keeps the same contract, and the column window a
format whose blocks a column split cuts through is served from."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


class SliceError(ValueError):
    """A row or column range a quantized format cannot cut out (it falls inside a block
    of its scales or packing): the loader turns it into a ConfigError naming the tensor
    and the tensor-parallel sizes that work."""


@runtime_checkable
class QuantizedWeight(Protocol):
    """A 2-D weight ``[out_features, in_features]`` in a quantized form.

    ``linear(x)`` is ``x @ W.T`` for ``x [..., in_features]`` (float32 or bfloat16), in
    ``x``'s dtype; ``dequantize(dtype)`` is ``W`` itself, the oracle every kernel of the
    format is tested against. ``nbytes`` counts the stored bytes (what the planner
    budgets), ``rows(a, b)`` is rows ``a:b`` as the same kind of weight, without copying
    where the format allows (fused projections split, tensor parallelism slices);
    ``cols(a, b)`` is columns ``a:b`` (input features: a row-parallel shard), a copy of
    just those columns' bytes, or :class:`SliceError` where ``a`` or ``b`` falls inside a
    block the format cannot split.
    """

    qtype: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int: ...

    def linear(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def rows(self, start: int, stop: int) -> "QuantizedWeight": ...

    def cols(self, start: int, stop: int) -> "QuantizedWeight": ...


def check_cols(w, start: int, stop: int) -> None:
    if not 0 <= start < stop <= w.shape[1]:
        raise ValueError(f"columns {start}:{stop} out of range for {w.shape[1]} columns")


class FloatWeight:
    """A float ``[out, in]`` weight with the :class:`QuantizedWeight` contract: a float
    part of a fused projection whose other parts are quantized (a module a quantized
    checkpoint leaves unconverted, e.g. the DeltaNet's small ``in_proj_a/b``; a small
    tensor llama-quantize leaves in F32/F16), or a GGUF's float expert."""

    def __init__(self, weight: torch.Tensor, qtype: str | None = None):
        if weight.dim() != 2:
            raise ValueError(f"FloatWeight takes a 2-D weight, got {list(weight.shape)}")
        self.weight = weight.contiguous()
        self.shape = (int(weight.shape[0]), int(weight.shape[1]))
        self.qtype = qtype or {torch.bfloat16: "bf16", torch.float16: "f16"}.get(weight.dtype, "f32")

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def rows(self, start: int, stop: int) -> "FloatWeight":
        return FloatWeight(self.weight[start:stop], self.qtype)

    def cols(self, start: int, stop: int) -> "FloatWeight":
        check_cols(self, start, stop)
        return FloatWeight(self.weight[:, start:stop].contiguous(), self.qtype)

    def to(self, device) -> "FloatWeight":
        return FloatWeight(self.weight.to(device), self.qtype)

    def __repr__(self) -> str:
        return f"FloatWeight({self.qtype}, {list(self.shape)})"


class ColumnWindowWeight:
    """Columns ``lo:hi`` of ``inner`` (``[out, K]``), served without re-quantizing:
    ``inner`` is the shard widened to whole blocks of its format (the columns outside
    the window zeroed where the format can), and the activation is padded with zeros to
    ``K`` columns before the product, so the columns outside contribute exact zeros. A
    format whose scales apply per element (FP8's 128 x 128 blocks) takes any column
    split this way, at the cost of at most one block of extra columns per side."""

    def __init__(self, inner: QuantizedWeight, lo: int, hi: int):
        if not 0 <= lo < hi <= inner.shape[1]:
            raise ValueError(f"column window {lo}:{hi} out of range for {inner.shape[1]} columns")
        self.inner, self.lo, self.hi = inner, int(lo), int(hi)
        self.shape = (inner.shape[0], self.hi - self.lo)
        self.qtype = inner.qtype

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.linear(F.pad(x, (self.lo, self.inner.shape[1] - self.hi)))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.dequantize(dtype)[:, self.lo:self.hi]

    def rows(self, start: int, stop: int) -> "ColumnWindowWeight":
        return ColumnWindowWeight(self.inner.rows(start, stop), self.lo, self.hi)

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        check_cols(self, start, stop)
        return self.inner.cols(self.lo + start, self.lo + stop)

    def to(self, device) -> "ColumnWindowWeight":
        return ColumnWindowWeight(self.inner.to(device), self.lo, self.hi)

    def __repr__(self) -> str:
        return f"ColumnWindowWeight({self.inner!r}, {self.lo}:{self.hi})"


class ConcatWeight:
    """Several quantized weights stacked by rows: one fused projection (``q|k|v``,
    ``gate|up``) whose parts a file stores as separate tensors, possibly of different
    types (Q4_K_M keeps some in Q6_K). ``linear`` runs each part and writes its columns
    of one output."""

    def __init__(self, parts: list[QuantizedWeight]):
        if not parts:
            raise ValueError("ConcatWeight needs at least one part")
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts of one fused weight must share in_features, got {sorted(cols)}")
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        types = sorted({p.qtype for p in parts})
        self.qtype = types[0] if len(types) == 1 else "+".join(types)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].linear(x)
        out = torch.empty(*x.shape[:-1], self.shape[0], dtype=x.dtype, device=x.device)
        at = 0
        for p in self.parts:
            out[..., at:at + p.shape[0]] = p.linear(x)
            at += p.shape[0]
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} out of range for {self.shape[0]} rows")
        picked, at = [], 0
        for p in self.parts:
            lo, hi = max(start, at), min(stop, at + p.shape[0])
            if lo < hi:
                picked.append(p.rows(lo - at, hi - at))
            at += p.shape[0]
        return picked[0] if len(picked) == 1 else ConcatWeight(picked)

    def cols(self, start: int, stop: int) -> "ConcatWeight":
        check_cols(self, start, stop)
        return ConcatWeight([p.cols(start, stop) for p in self.parts])

    def __repr__(self) -> str:
        return f"ConcatWeight({self.qtype}, {list(self.shape)}, {len(self.parts)} parts)"
