"""The native CPU kernels of the safetensors quantized weights (``hybridserve._core``:
``fp8_matmul``, ``awq_matmul``), on torch tensors; each returns None where it cannot
run (no extension, native kernels disabled, a non-contiguous input), and the caller
falls back to the dequantized path."""

from __future__ import annotations

import torch

from hybridserve.kernels import native

_BF16 = torch.bfloat16


def _ready(x2: torch.Tensor, name: str):
    k = native._k
    if k is None or native._DISABLED or not hasattr(k, name):
        return None
    if x2.device.type != "cpu" or x2.dtype not in (torch.float32, _BF16) or x2.dim() != 2:
        return None
    if x2.shape[0] > 1 and not x2.is_contiguous():
        return None
    return k


def _bits(t: torch.Tensor):
    return (t.view(torch.uint16) if t.dtype == _BF16 else t).numpy()


def fp8_matmul(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_offset: int):
    """``x2 [M, K] @ W.T`` for an FP8 block-scaled ``W`` (``weight`` uint8 ``[N, K]``,
    ``scale`` float32 per 128 x 128 block), in ``x2``'s dtype; None where it cannot run."""
    k = _ready(x2, "fp8_matmul")
    if k is None:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype)
    k.fp8_matmul(_bits(x2), weight.numpy(), scale.numpy(), int(row_offset), _bits(out))
    return out


def awq_matmul(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int):
    """``x2 [M, K] @ W.T`` for an int4 ``W`` in the kernel's row layout (see
    :class:`hybridserve.quant.awq.AWQWeight`), in ``x2``'s dtype; None where it cannot run."""
    k = _ready(x2, "awq_matmul")
    if k is None:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], packed.shape[0], dtype=x2.dtype)
    k.awq_matmul(_bits(x2), packed.numpy(), scales.numpy(), zeros.numpy(), int(group_size), _bits(out))
    return out
