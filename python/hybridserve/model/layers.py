"""Layer pieces shared by the dense decoder (:mod:`hybridserve.model.qwen3_5`), the MoE
block (:mod:`hybridserve.model.moe`) and the native decode step
(:mod:`hybridserve.model.native_decode`): the norms, :class:`Projection` (``nn.Linear``
on the native few-row kernels), the :class:`_Fused` mixin of modules whose one fused
``nn.Linear`` holds several HF projections, and the SwiGLU :class:`MLP`.

They live apart from the model so that those modules import them without importing
each other: the package's imports form a DAG (``tests/model/test_import_graph.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import native


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (weight stored centred on 0), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and native.usable(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)
        if x.dim() == 2 and x.is_contiguous() and native.usable_bf16(x, self.weight):
            return native.rms_norm_bf16(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; the native kernel does both in one pass
        and updates ``residual`` in place (the caller owns it)."""
        if (x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
                and native.usable(x, residual, self.weight)):
            return native.rms_norm(x, self.weight, self.eps, residual=residual), residual
        if (x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
                and native.usable_bf16(x, residual, self.weight)):
            return native.rms_norm_bf16(x, self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self(residual), residual


class GatedRMSNorm(nn.Module):
    """DeltaNet's output norm: ``weight * rmsnorm(x) * silu(gate)`` (plain, not 1-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF rounds to the model dtype before the weight and again after the gate.
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class Projection(nn.Linear):
    """``nn.Linear`` that sends decode-sized inputs to the native kernels on the CPU.

    Inputs of at most :attr:`NATIVE_MAX_ROWS` rows (bfloat16:
    :attr:`NATIVE_MAX_ROWS_BF16`) go to a native few-row kernel that reads the weight in
    place; BLAS would repack all of it on every call, which for a few rows costs as much
    as the product (measured 15-45% slower up to 128 rows at the bench model's shapes,
    faster from 256). Which kernel follows the weight's layout (see
    :meth:`hybridserve.model.qwen3_5.Qwen3_5ForServing.store_cpu_layout`): ``[out, in]`` as checkpoints store it
    (every dense projection, float32 or bfloat16): dot products over contiguous weight
    rows (:func:`hybridserve.kernels.native.linear_rows` / ``linear_bf16``); stored
    transposed (float32 MoE blocks, whose fused kernel reads them so):
    :func:`hybridserve.kernels.native.linear_few_rows`. Everything else is ``F.linear``.
    """

    NATIVE_MAX_ROWS = 128
    # bfloat16 weights (kept [out, in] row-major on the CPU): the native kernel up to
    # this many rows (0.96-1.20x oneDNN's time at 1 and 16 rows, the bench's shapes),
    # torch's (oneDNN) bfloat16 GEMM above (0.73-0.80x at 64 rows: it is faster there);
    # benches/bf16_kernels.py, RESULTS.md's issue 22 section.
    NATIVE_MAX_ROWS_BF16 = 16

    # A quantized checkpoint's weight (:class:`hybridserve.quant.QuantizedWeight`), held
    # in place of ``weight`` (then None): see :meth:`quantize_`.
    qweight = None

    def quantize_(self, qweight) -> None:
        """Serve this projection from ``qweight``, a :class:`hybridserve.quant.QuantizedWeight`
        of shape ``[out_features, in_features]``; the float ``weight`` is dropped."""
        if tuple(qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {list(qweight.shape)} for a projection "
                             f"[{self.out_features}, {self.in_features}]")
        self.weight = None
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            y = self.qweight.linear(x)
            return y if self.bias is None else y + self.bias
        w = self.weight
        if w.dtype == torch.bfloat16:
            if (x.dim() == 2 and x.shape[0] <= self.NATIVE_MAX_ROWS_BF16 and self.bias is None
                    and w.is_contiguous() and x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])
                    and native.usable_bf16(x, w)):
                return native.linear_bf16(x, w)
            return F.linear(x, w, self.bias)
        if (x.dim() == 2 and x.shape[0] <= self.NATIVE_MAX_ROWS and x.stride(-1) == 1
                and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) and native.usable(x, w)):
            if w.is_contiguous():
                y = native.linear_rows(x, w)
            elif w.stride(0) == 1:
                y = native.linear_few_rows(x, w)
            else:
                return F.linear(x, w, self.bias)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, w, self.bias)


class _Fused:
    """Mixin of a module with one fused ``nn.Linear`` holding several HF projections as
    consecutive row ranges: ``_parts`` lists ``(hf_name, rows)`` in order."""

    _fused_name: str
    _parts: list[tuple[str, int]]

    def _init_fused(self, fused_name: str, parts: list[tuple[str, int]]) -> None:
        self._fused_name = fused_name
        self._parts = parts
        self._register_load_state_dict_pre_hook(self._fuse_hf_tensors)

    def fused_param_names(self) -> set[str]:
        """This module's parameters that checkpoints provide only through :meth:`hf_views`."""
        return {self._fused_name}

    def hf_views(self) -> dict[str, torch.Tensor]:
        """HF parameter name (relative to this module) -> view of the fused tensor."""
        fused = getattr(self, self._fused_name)
        if getattr(fused, "qweight", None) is not None:
            return {}  # served from a quantized weight: no float tensor to fill
        out, at = {}, 0
        for name, rows in self._parts:
            out[f"{name}.weight"] = fused.weight[at:at + rows]
            if fused.bias is not None:
                out[f"{name}.bias"] = fused.bias[at:at + rows]
            at += rows
        return out

    def _fuse_hf_tensors(self, state_dict, prefix, *args) -> None:
        # Accept HF names in load_state_dict: concatenate them into the fused tensor.
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name, _ in self._parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{self._fused_name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


class MLP(_Fused, nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Projection(hidden, 2 * inter, bias=False)
        self.down_proj = Projection(inter, hidden, bias=False)
        self._init_fused("gate_up_proj", [("gate_proj", inter), ("up_proj", inter)])

    # CPU: long inputs go through in tiles of this many rows, so each tile's [rows,
    # 2 * inter] gate+up output stays in cache for the activation and the down
    # projection instead of a round trip through memory (21 MB per 2,048 rows at the
    # bench shape). Measured 0-25% off the MLP at 2,048 rows, more when memory is busy.
    ROW_TILE = 512

    def forward(self, x):
        t = x.shape[0]
        if t > self.ROW_TILE and x.device.type == "cpu":
            out = torch.empty(t, self.down_proj.out_features, dtype=x.dtype)
            for s in range(0, t, self.ROW_TILE):
                out[s:s + self.ROW_TILE] = self._forward(x[s:s + self.ROW_TILE])
            return out
        return self._forward(x)

    def _forward(self, x):
        gu = self.gate_up_proj(x)
        # silu(gate) * up in place in the gate half: no [T, inter] temporaries (at a
        # 2,048-token chunk each is 10 MB at the bench shape, 140 MB at 27B's), and the
        # down projection reads the strided half directly.
        if gu.dim() == 2 and gu.is_contiguous() and (native.usable(gu) or native.usable_bf16(gu)):
            # One native pass instead of silu_ then mul_ (two over [T, inter]).
            return self.down_proj(native.silu_mul(gu, self.inter))
        act = gu[:, : self.inter]
        F.silu(act, inplace=True).mul_(gu[:, self.inter:])
        return self.down_proj(act)
