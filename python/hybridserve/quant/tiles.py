"""The CPU path the safetensors quantized weights (FP8, AWQ) share: a native few-row
kernel on the quantized bytes for decode-sized inputs, dequantized tiles into torch's
GEMM for prefill-sized ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to which the native kernel runs; past it dequantized tiles and torch's GEMM
# (benches/quant_safetensors.py; RESULTS.md, "FP8 and int4 safetensors").
NATIVE_MAX_ROWS = 16
# Weight rows per dequantized tile of the long-input path: one tile's float copy at a
# time instead of a whole-weight temporary.
TILE_ROWS = 512


def cpu_linear(w, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a weight with ``native(x2)`` (None where the kernel cannot run),
    ``rows(a, b)`` and ``dequantize(dtype)``; in ``x``'s dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = None
    if 0 < x2.shape[0] <= NATIVE_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
        y = w.native(x2)
    if y is None:
        n = w.shape[0]
        if n <= TILE_ROWS:
            y = F.linear(x2, w.dequantize(x.dtype))
        else:
            y = torch.empty(x2.shape[0], n, dtype=x.dtype)
            for a in range(0, n, TILE_ROWS):
                b = min(a + TILE_ROWS, n)
                y[:, a:b] = F.linear(x2, w.rows(a, b).dequantize(x.dtype))
    return y.reshape(*lead, w.shape[0])


# The float part of a fused projection lives with the contract (one class for the
# safetensors and the GGUF paths); imported here by its old name's users.
from hybridserve.quant.weight import FloatWeight  # noqa: E402,F401
