"""Quantize float32 weights into llama.cpp's block formats (GGML types).

For tests and for making quantized checkpoints without llama.cpp: ``quantize(w, qtype)``
returns the ``uint8 [rows, row_bytes]`` blocks that a GGUF file stores for ``w``.
Q8_0, Q4_0, Q5_0 and Q5_1 are the ``gguf`` package's own quantizers (bit-exact with ggml). The
package has none for the k-quants, so Q4_K, Q5_K and Q6_K are written here after the
block layouts of llama.cpp's ``ggml-quants.c`` (``block_q4_K`` etc.); the scale search
is a plain min/max one rather than ggml's iterative ``make_qkx2_quants``, so the bytes
are valid blocks of the format (the ``gguf`` reader's ``dequantize`` decodes them to
within one quantization step of ``w``), not necessarily the bytes llama-quantize writes.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
_BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}


def row_bytes(cols: int, qtype: str) -> int:
    bs, bb = _BLOCK[qtype]
    return cols // bs * bb


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` (float32 ``[rows, cols]``) as ``uint8 [rows, row_bytes]`` blocks of ``qtype``."""
    if qtype not in _BLOCK:
        raise ValueError(f"unknown GGML block type {qtype!r}; known: {sorted(_BLOCK)}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize takes a 2-D weight [rows, cols], got shape {list(w.shape)}")
    rows, cols = w.shape
    bs, bb = _BLOCK[qtype]
    if cols % bs:
        raise ValueError(f"{qtype} rows hold whole blocks of {bs}; {cols} columns is not a multiple")
    if not np.isfinite(w).all():
        raise ValueError("quantize takes finite weights (found NaN or inf)")
    if qtype in ("q8_0", "q4_0", "q5_0", "q5_1"):
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gq

        out = gq(w, GGMLQuantizationType[qtype.upper()])
        return np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, cols // bs * bb)
    blocks = w.reshape(-1, QK_K)
    q = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}[qtype](blocks)
    assert q.shape == (blocks.shape[0], bb)
    return q.reshape(rows, cols // bs * bb)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_k(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into the 12 bytes of ``block_q4_K.scales``
    (``get_scale_min_k4``'s inverse): sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7
    split into a low nibble (bytes 8-11) and 2 high bits (top of bytes 0-7)."""
    n = sc.shape[0]
    s = np.zeros((n, 12), dtype=np.uint8)
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return s


def _affine_k(blocks: np.ndarray, qmax: int):
    """Scales/mins for ``x ~ d*sc*q - dmin*m`` over 8 sub-blocks of 32, ``q`` in ``0..qmax``;
    returns (d, dmin as float16, sc, m as ints 0..63, q as ints)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)          # the format's min is subtracted: keep it <= 0
    hi = sub.max(axis=-1)
    scale = (hi - lo) / qmax                          # per sub-block step
    minv = -lo                                        # >= 0
    # Super-block scales: sub-block scales/mins as 6-bit multiples of d / dmin.
    d = _f16(scale.max(axis=-1) / 63).astype(np.float32)
    dmin = _f16(minv.max(axis=-1) / 63).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Rounded up, so the sub-block's step covers its range (no clipping at qmax).
        sc = np.where(d[:, None] > 0, np.ceil(scale / d[:, None]), 0).clip(0, 63)
        m = np.where(dmin[:, None] > 0, np.round(minv / dmin[:, None]), 0).clip(0, 63)
        eff_d = d[:, None] * sc
        eff_m = dmin[:, None] * m
        q = np.where(eff_d[..., None] > 0, np.round((sub + eff_m[..., None]) / eff_d[..., None]), 0)
    q = q.clip(0, qmax).astype(np.uint8)
    return d.astype(np.float16), dmin.astype(np.float16), sc, m, q


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_k(blocks, 15)
    # qs: 4 chunks of 32 bytes; chunk j holds sub-block 2j in low nibbles, 2j+1 in high.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                           _pack_scales_k(sc, m), qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_k(blocks, 31)
    low = q & 0x0F
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(n, 128)
    # qh: byte l's bit j is the fifth bit of sub-block j's element l.
    hb = (q >> 4) & 1                                  # [n, 8, 32]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= hb[:, j, :] << j
    return np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                           _pack_scales_k(sc, m), qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax_i = np.abs(sub).argmax(axis=-1)
    amax = np.take_along_axis(sub, amax_i[..., None], axis=-1)[..., 0]   # signed max-magnitude
    scale = amax / -32                                                    # q in -32..31 like ggml
    big = np.abs(scale).max(axis=-1)                                     # [n]
    d = _f16(big / 127).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Magnitude rounded up, so -32 steps still reach the sub-block's largest value.
        sc = np.where(d[:, None] > 0, np.sign(scale) * np.ceil(np.abs(scale) / d[:, None]), 0).clip(-127, 127)
        eff = d[:, None] * sc
        q = np.where(eff[..., None] != 0, np.round(sub / eff[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)        # 8 groups of 32
    # Group g = h*4 + k (h: half of the block, k: 0..3): low nibble in ql byte
    # h*64 + (k%2)*32 + l (low nibble for k<2, high for k>=2), top 2 bits in qh byte h*32+l at 2k.
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for h in range(2):
        for k in range(4):
            g = q[:, h * 4 + k, :]
            nib = g & 0x0F
            half = slice((k % 2) * 32, (k % 2) * 32 + 32)
            ql[:, h, half] |= nib if k < 2 else (nib << 4)
            qh[:, h, :] |= (g >> 4) << (2 * k)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).reshape(n, 1).view(np.uint8)], axis=1)
