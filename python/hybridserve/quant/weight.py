"""The contract every quantized weight keeps, and the row-stacked weight of a fused projection."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class QuantizedWeight(Protocol):
    """A 2-D weight ``[out_features, in_features]`` in a quantized form.

    ``linear(x)`` is ``x @ W.T`` for ``x [..., in_features]`` (float32 or bfloat16), in
    ``x``'s dtype; ``dequantize(dtype)`` is ``W`` itself, the oracle every kernel of the
    format is tested against. ``nbytes`` counts the stored bytes (what the planner
    budgets), ``rows(a, b)`` is rows ``a:b`` as the same kind of weight, without copying
    where the format allows (fused projections split, tensor parallelism slices).
    """

    qtype: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int: ...

    def linear(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def rows(self, start: int, stop: int) -> "QuantizedWeight": ...


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

    def __repr__(self) -> str:
        return f"ConcatWeight({self.qtype}, {list(self.shape)}, {len(self.parts)} parts)"
