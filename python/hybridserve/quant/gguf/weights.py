"""The pieces a GGUF model is served from besides :class:`~hybridserve.quant.ggml.GGMLWeight`:

- :class:`PlainWeight` (:class:`~hybridserve.quant.weight.FloatWeight`): a float part of a
  fused projection whose other parts are blocks (llama-quantize leaves some small
  tensors in F32/F16);
- :class:`ColumnPermutedWeight`: a block weight whose input features the converter
  permuted (``ssm_out`` under the value-head reorder): the activation is permuted
  instead, the blocks stay as stored;
- :class:`QuantizedEmbedding`: the token embedding kept as blocks, dequantizing the
  looked-up rows only;
- :class:`QuantizedExperts`: an MoE layer's routed experts, per expert weights in blocks
  (views of the file's ``[E, out, row_bytes]`` tensors), run by one native call on those
  tensors (``hybridserve.kernels.quant.experts``) or, as the reference, a loop over experts.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.quant.ggml import GGMLWeight
from hybridserve.quant.tiles import native_max_rows
from hybridserve.quant.weight import ConcatWeight, FloatWeight, QuantizedWeight, SliceError, check_cols


# The float weight is the safetensors path's too (one class, in quant/weight.py).
PlainWeight = FloatWeight


class ColumnPermutedWeight:
    """``W = inner`` with its columns put back: ``inner[:, j] = W[:, perm[j]]``, so
    ``x @ W.T = x[..., perm] @ inner.T``."""

    def __init__(self, inner: QuantizedWeight, perm: torch.Tensor):
        if perm.numel() != inner.shape[1]:
            raise ValueError(f"column permutation of {perm.numel()} for {inner.shape[1]} columns")
        self.inner = inner
        self.perm = perm.to(torch.long)
        self.inv = torch.argsort(self.perm)
        self.shape = inner.shape
        self.qtype = inner.qtype

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.linear(x.index_select(-1, self.perm))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.dequantize(dtype).index_select(1, self.inv)

    def rows(self, start: int, stop: int) -> "ColumnPermutedWeight":
        return ColumnPermutedWeight(self.inner.rows(start, stop), self.perm)

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        """Columns ``start:stop`` of ``W`` (HF's input order). They are stored in runs
        of consecutive inner columns (under the value-head reorder: one run per value
        head of a key head's group, ``key heads per rank x head dim`` wide); each run is
        cut from the inner weight (whole blocks: SliceError otherwise), the runs set side
        by side, and the shard keeps the permutation that remains among them."""
        check_cols(self, start, stop)
        stored = torch.sort(self.inv[start:stop]).values
        breaks = (torch.nonzero(stored[1:] - stored[:-1] != 1).flatten() + 1).tolist()
        bounds = [0, *breaks, len(stored)]
        runs = [self.inner.cols(int(stored[a]), int(stored[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]
        inner = runs[0] if len(runs) == 1 else _cat_cols(runs)
        perm = self.perm.index_select(0, stored) - start
        if torch.equal(perm, torch.arange(len(perm))):
            return inner
        return ColumnPermutedWeight(inner, perm)

    def __repr__(self) -> str:
        return f"ColumnPermutedWeight({self.inner!r})"


def _cat_cols(parts: list) -> QuantizedWeight:
    """Column slices of one weight side by side (block or float)."""
    if all(isinstance(p, GGMLWeight) for p in parts):
        return GGMLWeight.cat_cols(parts)
    if all(isinstance(p, FloatWeight) for p in parts):
        return FloatWeight(torch.cat([p.weight for p in parts], dim=1), parts[0].qtype)
    raise SliceError(f"columns of {type(parts[0]).__name__} cannot be set side by side")


def _dequantize_rows(w: GGMLWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``w`` as float32 ``[len(ids), in]`` (gguf's reference dequantize)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    picked = w.data.index_select(0, ids.reshape(-1).to(torch.long))
    out = dequantize(picked.numpy(), GGMLQuantizationType(w.type.ggml_id))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, w.shape[1])


class QuantizedEmbedding(nn.Module):
    """The token embedding in blocks (``weight``: the table as a
    :class:`~hybridserve.quant.ggml.GGMLWeight` ``[vocab, hidden]``); a lookup dequantizes
    the rows it reads, in ``dtype`` (the model's)."""

    def __init__(self, qweight: GGMLWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = qweight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        native = getattr(self.qweight, "embedding", None)
        if native is not None:
            return native(ids, self.dtype)
        return _dequantize_rows(self.qweight, ids).reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qweight.qtype}"


def _stacked(ws: list[QuantizedWeight]) -> tuple[torch.Tensor, int] | None:
    """Per-expert weights that are consecutive row blocks of one tensor (the file's
    ``[E, rows, row_bytes]``, as the loader views it) as that tensor, with their GGML
    type id; None where they are not (float parts, slices, mixed types)."""
    if not ws or not all(isinstance(w, GGMLWeight) for w in ws):
        return None
    d0 = ws[0].data
    if d0.device.type != "cpu" or not d0.is_contiguous() or d0.numel() == 0:
        return None
    step, base = d0.numel(), d0.untyped_storage().data_ptr()
    for e, w in enumerate(ws):
        d = w.data
        if (w.qtype != ws[0].qtype or tuple(d.shape) != tuple(d0.shape) or not d.is_contiguous()
                or d.untyped_storage().data_ptr() != base or d.data_ptr() != d0.data_ptr() + e * step):
            return None
    return d0.as_strided((len(ws), *d0.shape), (step, d0.shape[1], 1)), ws[0].type.ggml_id


class QuantizedExperts(nn.Module):
    """``num`` routed SwiGLU experts whose weights stay in blocks: expert ``e`` computes
    ``down[e](silu(x @ gate[e].T) * (x @ up[e].T))``; ``gate_up[e]`` is its gate and up
    weights stacked by rows (one product).

    Where every kind is one block tensor (the loader's views of the file's 3-D tensors)
    and the native kernels are there, :meth:`forward` is one call on those tensors
    (``hybridserve.kernels.quant.experts``) up to its types' few-row limit an expert;
    past that (prefill), or without them, :meth:`forward_loop`, the per-expert loop (the
    reference the kernel is tested against: on the CPU each product is the same native
    few-row GEMM, so both agree but for the last bit of ``silu``)."""

    quantized = True

    def __init__(self, gate: list[QuantizedWeight], up: list[QuantizedWeight], down: list[QuantizedWeight]):
        super().__init__()
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ValueError("QuantizedExperts needs as many gate, up and down weights, at least one")
        self.num = len(gate)
        self.inter, self.hidden = gate[0].shape
        self.gate_up = [ConcatWeight([g, u]) for g, u in zip(gate, up)]
        self.down = list(down)
        kinds = (_stacked(gate), _stacked(up), _stacked(down))
        # (gate, up, down) as (blocks [E, rows, row_bytes], GGML id), or None.
        self.blocks = kinds if all(k is not None for k in kinds) else None

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.gate_up) + sum(w.nbytes for w in self.down)

    def native_ok(self, x: torch.Tensor) -> bool:
        """True where :meth:`forward` can take the native call for ``x`` (before the
        per-expert row bound)."""
        from hybridserve.kernels import quant as qk

        return (self.blocks is not None and qk.experts_available() and x.device.type == "cpu"
                and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16))

    def _native_rows(self) -> int:
        """Rows an expert up to which the native kernel runs: the smallest of its block
        types' few-row limits (:func:`~hybridserve.quant.tiles.native_max_rows`)."""
        types = {w.qtype for w in self.down}
        for w in self.gate_up:
            types |= {p.qtype for p in getattr(w, "parts", [w])}
        return min(native_max_rows(t) for t in types)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``weights`` / ``ids`` ``[T, k]`` -> ``[T, H]`` (x's dtype):
        each chosen expert's output times its weight, summed over the k in float32."""
        if self.native_ok(x):
            from hybridserve.kernels import quant as qk
            from hybridserve.kernels.moe import expert_counts

            limit = self._native_rows()
            if ids.numel() <= limit or int(expert_counts(ids, self.num).max()) <= limit:
                gate, up, down = self.blocks
                return qk.experts(x, weights, ids, gate, up, down)[0]
        return self.forward_loop(x, weights, ids)

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` as a loop over the experts that received rows, each one's
        products through its weights' ``linear``."""
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num).tolist()
        k = ids.shape[1]
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = order[at:at + n]
            at += n
            tok = sel // k
            xe = x.index_select(0, tok)
            gu = self.gate_up[e].linear(xe)
            act = F.silu(gu[:, :self.inter]) * gu[:, self.inter:]
            y = self.down[e].linear(act)
            out.index_add_(0, tok, y.float() * weights.reshape(-1)[sel, None].float())
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        types = sorted({w.qtype for w in self.gate_up} | {w.qtype for w in self.down})
        return f"num={self.num}, hidden={self.hidden}, inter={self.inter}, types={types}"
