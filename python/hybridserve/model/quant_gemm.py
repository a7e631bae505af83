"""The native decode step's GEMM entries for a quantized checkpoint's projections.

:class:`~hybridserve.model.native_decode.NativeDecodeStep` calls ``gemm(x, w, out)`` on
numpy views; for a projection served from a quantized weight
(:attr:`Projection.qweight <hybridserve.model.layers.Projection.qweight>`), ``w`` is a
:class:`QuantGemm` instead: the same product as the module path's ``qweight.linear``,
part by part, on the native kernels -- ``_core.kernels.quant_matmul`` for GGML blocks,
the float few-row GEMM for a float part, the activation's columns permuted first where
the weight's input features were stored permuted.

The weight classes are recognised by their attributes (``parts``: stacked rows;
``inner`` + ``perm``: permuted columns; ``type.ggml_id`` + ``data``: GGML blocks; ``weight``
a float tensor: a float part -- FP8's ``weight`` is uint8 bits, so it is not one), so this module imports nothing from :mod:`hybridserve.quant`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from hybridserve.kernels import native

_BF16 = torch.bfloat16


def quant_matmul_kernel():
    """``_core.kernels.quant_matmul(x, w_u8, ggml_type_id, out)`` (with the instruction
    set ``HYBRIDSERVE_QUANT_ISA`` forces, as the module path's
    :func:`hybridserve.kernels.quant.matmul` runs it), or None where the extension was
    built without it (then quantized models take the module path)."""
    try:
        from hybridserve.kernels import quant as qk
    except ImportError:  # a tree without the quantized kernels' wrappers
        return getattr(native._k, "quant_matmul", None) if native.available() else None
    if not qk.available():
        return None
    kernel, isa = qk._k.quant_matmul, qk._ISA
    return kernel if isa is None else functools.partial(kernel, isa=isa)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.view(torch.uint16).numpy() if t.dtype == _BF16 else t.numpy()


def _float_part(w) -> torch.Tensor | None:
    """The float tensor of a float part (``FloatWeight.weight``), else None."""
    t = getattr(w, "weight", None)
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 else None


class QuantGemm:
    """``out[:] = x @ W.T`` for one quantized weight ``W`` (``x``, ``out`` numpy views in
    the model's dtype: float32, or bfloat16 as uint16 bits)."""

    def __init__(self, qweight, dtype: torch.dtype, float_gemm, quant_matmul):
        self.shape = tuple(qweight.shape)
        self.qweight = qweight
        self.float_gemm, self.quant_matmul = float_gemm, quant_matmul
        self.dtype = dtype
        self.np_dtype = np.uint16 if dtype == _BF16 else np.float32
        # (row start, row stop, column permutation or None, kind, payload) per leaf.
        self.leaves: list[tuple] = []
        self._flatten(qweight, 0, None)
        self.single = len(self.leaves) == 1
        # One leaf of blocks without a permutation (most projections of a GGUF file):
        # its kernel's arguments, for the shortest call.
        start, stop, perm, kind, payload = self.leaves[0]
        self._plain = payload if self.single and perm is None and kind == "blocks" else None

    @staticmethod
    def supports(qweight, dtype: torch.dtype) -> bool:
        """Whether every leaf of ``qweight`` is one this class runs natively."""
        parts = getattr(qweight, "parts", None)
        if parts is not None:
            return all(QuantGemm.supports(p, dtype) for p in parts)
        if hasattr(qweight, "inner") and hasattr(qweight, "perm"):
            return QuantGemm.supports(qweight.inner, dtype)
        if hasattr(qweight, "type") and hasattr(qweight, "data"):
            return qweight.data.dtype == torch.uint8 and qweight.data.is_contiguous()
        return _float_part(qweight) is not None

    def _flatten(self, w, at: int, perm) -> None:
        parts = getattr(w, "parts", None)
        if parts is not None:
            for p in parts:
                self._flatten(p, at, perm)
                at += p.shape[0]
            return
        if hasattr(w, "inner") and hasattr(w, "perm"):
            if perm is not None:
                raise ValueError("nested column permutations")
            self._flatten(w.inner, at, w.perm.numpy())
            return
        rows = w.shape[0]
        if hasattr(w, "type") and hasattr(w, "data"):
            self.leaves.append((at, at + rows, perm, "blocks", (w.data.numpy(), int(w.type.ggml_id))))
        else:
            self.leaves.append((at, at + rows, perm, "float", _np(_float_part(w).to(self.dtype).contiguous())))

    def rows(self, stop: int) -> "QuantGemm":
        """The first ``stop`` rows (a reduced draft vocabulary of the LM head)."""
        return QuantGemm(self.qweight.rows(0, stop), self.dtype, self.float_gemm, self.quant_matmul)

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        plain = self._plain
        if plain is not None:
            self.quant_matmul(x, plain[0], plain[1], out)
            return
        if self.single:
            start, stop, perm, kind, payload = self.leaves[0]
            xi = x if perm is None else np.take(x, perm, axis=1)
            if kind == "blocks":
                self.quant_matmul(xi, payload[0], payload[1], out)
            else:
                self.float_gemm(xi, payload, out)
            return
        # One row: each leaf's column range of ``out`` is contiguous, so the kernel
        # writes it in place; several rows: a leaf's own buffer, then copied in.
        direct = x.shape[0] == 1
        for start, stop, perm, kind, payload in self.leaves:
            xi = x if perm is None else np.take(x, perm, axis=1)
            dst = out[:, start:stop] if direct else np.empty((x.shape[0], stop - start), dtype=self.np_dtype)
            if kind == "blocks":
                self.quant_matmul(xi, payload[0], payload[1], dst)
            else:
                self.float_gemm(xi, payload, dst)
            if not direct:
                out[:, start:stop] = dst
