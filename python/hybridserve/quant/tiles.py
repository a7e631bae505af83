"""The CPU path the safetensors quantized weights (FP8, AWQ) share: a native few-row
kernel on the quantized bytes for decode-sized inputs, dequantized tiles into torch's
GEMM for prefill-sized ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Activation rows up to which a weight's native kernel on its quantized form runs, per
# format (the weight's ``qtype``); past it, dequantized tiles into torch's GEMM win. The
# one place both paths read: the GGML block types (benches/quant_kernels.py --only
# crossover; RESULTS.md "Quantized blocks: the eight-row kernels and per-type crossover")
# and the safetensors formats (benches/quant_safetensors.py; RESULTS.md "FP8 and int4
# safetensors").
NATIVE_MAX_ROWS: dict[str, int] = {
    "q8_0": 64, "q4_0": 128, "q5_0": 128, "q5_1": 128,
    "q4_k": 128, "q5_k": 128, "q6_k": 128,
    "fp8_e4m3_b128": 16, "awq_int4": 16,
}
# A format not listed above.
NATIVE_MAX_ROWS_DEFAULT = 16
# Weight rows per dequantized tile of the long-input path: one tile's float copy at a
# time instead of a whole-weight temporary, each torch GEMM still large.
TILE_ROWS = 512


def native_max_rows(qtype: str) -> int:
    """Rows up to which :func:`cpu_linear` runs ``qtype``'s native kernel."""
    return NATIVE_MAX_ROWS.get(qtype, NATIVE_MAX_ROWS_DEFAULT)


def cpu_linear(w, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in ``x``'s dtype on the CPU, for a quantized weight with ``qtype``,
    ``shape``, ``native(x2)`` (the kernel on the quantized form; None where it cannot
    run) and either ``dequantize_tile(a, b, dtype)`` (rows ``a:b`` as ``dtype``) or
    ``rows(a, b)`` and ``dequantize(dtype)``, and optionally ``prefill(x2)`` (a many-row
    kernel on the quantized form; None where it cannot run). Up to
    :func:`native_max_rows` rows (decode, MoE experts) the native kernel; longer inputs
    (prefill) ``prefill`` where the weight has one that runs here, else tiles of
    :data:`TILE_ROWS` weight rows dequantized into torch's GEMM."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = w.shape[0]
    y = None
    if 0 < x2.shape[0] <= native_max_rows(w.qtype) and x.dtype in (torch.float32, torch.bfloat16):
        y = w.native(x2)
    elif x2.shape[0] and x.dtype in (torch.float32, torch.bfloat16) and hasattr(w, "prefill"):
        y = w.prefill(x2)
    if y is None:
        tile = getattr(w, "dequantize_tile", None)
        if tile is None:
            def tile(a, b, dtype):
                return w.rows(a, b).dequantize(dtype)
        if n <= TILE_ROWS:
            y = F.linear(x2, tile(0, n, x.dtype))
        else:
            y = torch.empty(x2.shape[0], n, dtype=x.dtype)
            for a in range(0, n, TILE_ROWS):
                b = min(a + TILE_ROWS, n)
                y[:, a:b] = F.linear(x2, tile(a, b, x.dtype))
    return y.reshape(*lead, n)


# The float part of a fused projection lives with the contract (one class for the
# safetensors and the GGUF paths); imported here by its old name's users.
from hybridserve.quant.weight import FloatWeight  # noqa: E402,F401
