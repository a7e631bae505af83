"""Native kernels on llama.cpp's quantized blocks, over torch tensors.

Thin wrappers of ``hybridserve._core.kernels.quant_*`` (``rust/kernels/src/quant``):
``matmul`` is ``x @ W.T`` with ``W`` kept in its GGML blocks (``uint8 [N, row_bytes]``)
and ``x`` quantized per row the way llama.cpp's ``vec_dot`` takes it (Q8_0 blocks of 32
against Q8_0 / Q4_0 weights, Q8_K blocks of 256 against the k-quants), so results track
llama.cpp's; ``dequantize`` is rows of ``W`` as float32 / bfloat16 (exactly the ``gguf``
reader's values, bfloat16 rounded once). :func:`q8_act_ref` is the plain-PyTorch
reference of the activation quantization the tests use.

``HYBRIDSERVE_QUANT_ISA`` (``avx512_vnni``, ``avx2``, ``scalar``) forces an instruction
set process-wide (tests, benches); the default is the best this CPU has.
"""

from __future__ import annotations

import os

import torch

from hybridserve.kernels import native

_k = native._k if native.available() and hasattr(native._k, "quant_matmul") else None
_ISA = os.environ.get("HYBRIDSERVE_QUANT_ISA") or None


def available() -> bool:
    """True when the extension has the quantized kernels (and native kernels are on)."""
    return _k is not None


def isa() -> str:
    """``"avx512_vnni"``, ``"avx2"``, ``"scalar"``, or ``"none"`` without the extension."""
    return (_ISA or _k.quant_isa()) if _k is not None else "none"


def _np_x(x: torch.Tensor):
    if x.dtype == torch.bfloat16:
        return x.view(torch.uint16).numpy()
    return x.numpy()


def matmul(x: torch.Tensor, data: torch.Tensor, ggml_id: int, out_dtype: torch.dtype | None = None,
           isa: str | None = None) -> torch.Tensor:
    """``x @ W.T``: ``x`` ``[T, K]`` float32 or bfloat16 (rows contiguous), ``data`` the
    blocks ``uint8 [N, row_bytes]`` (C-contiguous), returned ``[T, N]`` in ``out_dtype``
    (``x``'s dtype by default)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantized matmul takes float32 or bfloat16 activations, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    x = x.detach()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], data.shape[0], dtype=out_dtype)
    o = out.view(torch.uint16).numpy() if out_dtype == torch.bfloat16 else out.numpy()
    _k.quant_matmul(_np_x(x), data.numpy(), int(ggml_id), o, isa or _ISA)
    return out


def matmul_prefill(x: torch.Tensor, data: torch.Tensor, ggml_id: int, out_dtype: torch.dtype | None = None,
                   isa: str | None = None) -> torch.Tensor:
    """:func:`matmul` for many rows (prefill): the same arguments and the same results
    (llama.cpp's activation rounding; equal to the scalar kernel bit for bit), each
    weight tile unpacked once to bytes and run against every row (AVX-512 VNNI; the
    few-row kernel on other CPUs)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantized matmul takes float32 or bfloat16 activations, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    x = x.detach()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], data.shape[0], dtype=out_dtype)
    o = out.view(torch.uint16).numpy() if out_dtype == torch.bfloat16 else out.numpy()
    _k.quant_matmul_prefill(_np_x(x), data.numpy(), int(ggml_id), o, isa or _ISA)
    return out


def dequantize(data: torch.Tensor, ggml_id: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of blocks ``uint8 [R, row_bytes]`` as ``[R, k]`` float32 or bfloat16."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantized rows dequantize to float32 or bfloat16, got {dtype}")
    out = torch.empty(data.shape[0], k, dtype=dtype)
    o = out.view(torch.uint16).numpy() if dtype == torch.bfloat16 else out.numpy()
    _k.quant_dequantize(data.numpy(), int(ggml_id), o)
    return out


def q8_act_ref(x: torch.Tensor, k_quant: bool) -> torch.Tensor:
    """``x`` (float32 ``[T, K]``) quantized and dequantized the way llama.cpp quantizes
    activations for ``vec_dot``, in plain PyTorch: Q8_0 (``k_quant=False``: blocks of
    32, ``d = amax / 127`` rounded to float16, ``q = round(x / d)`` half away from zero)
    or Q8_K (blocks of 256, the value of largest magnitude ``max`` maps to -127:
    ``q = min(127, rint(-127 / max * x))``, ``d = 1 / (-127 / max)``, float32)."""
    x = x.float()
    t, k = x.shape
    if not k_quant:
        b = x.reshape(t, k // 32, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        v = b * inv
        q = torch.sign(v) * torch.floor(v.abs() + 0.5)          # C's roundf
        return (q * d.to(torch.float16).float()).reshape(t, k)
    b = x.reshape(t, k // 256, 256)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = torch.gather(b, -1, idx)
    # A true division (torch's ``scalar / tensor`` is ``reciprocal * scalar``, which
    # rounds differently from C's ``-127.f / max``).
    iscale = torch.where(mx == 0, torch.zeros_like(mx), torch.full_like(mx, -127.0) / mx)
    q = torch.round(iscale * b).clamp(max=127)                  # rint: half to even
    d = torch.where(mx == 0, torch.zeros_like(mx), 1 / iscale)
    return (q * d).reshape(t, k)


def experts_available() -> bool:
    """True when the extension has the fused experts kernel (:func:`experts`) and the
    quantized kernels are on (:func:`available`)."""
    return available() and hasattr(_k, "quant_experts")


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int] | None,
            down: tuple[torch.Tensor, int], isa: str | None = None) -> tuple[torch.Tensor, int]:
    """An MoE layer's routed experts on GGML blocks in one native call: ``x`` ``[T, H]``
    float32 or bfloat16, routing ``weights`` / ``ids`` ``[T, k]``; ``gate`` / ``up`` /
    ``down`` each (blocks ``uint8 [E, rows, row_bytes]`` C-contiguous, GGML type id):
    gate and up ``[E, I, .]`` (``up`` None: ``gate`` holds both, ``[E, 2I, .]``), down
    ``[E, H, .]``. Returns (``[T, H]`` in ``x``'s dtype: each chosen expert's output
    times its weight, summed in float32 in expert order; the most pairs any expert
    received). Each token's activation is quantized once (llama.cpp's Q8_0 / Q8_K), as
    :func:`matmul` does per product; a token's result does not depend on the others."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the quantized experts take float32 or bfloat16 activations, got {x.dtype}")
    x = x.detach()
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = ids.detach().to(torch.int64).contiguous()
    weights = weights.detach().to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
    o = out.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else out.numpy()
    load = _k.quant_experts(_np_x(x), ids.numpy(), weights.numpy(), gate[0].numpy(), int(gate[1]),
                            None if up is None else up[0].numpy(), None if up is None else int(up[1]),
                            down[0].numpy(), int(down[1]), o, isa or _ISA)
    return out, load
