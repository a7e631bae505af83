"""``cols(a, b)`` of every quantized weight (a row-parallel shard's input columns)
against the format's own dequantization sliced: ``dequantize()[:, a:b]`` (for GGML
blocks the ``gguf`` package's reference), and its product against ``F.linear`` on that
slice; splits a format cannot make are refused with SliceError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gguf_files import _quantize
from hybridserve.quant.awq import AWQWeight
from hybridserve.quant.fp8 import FP8BlockWeight
from hybridserve.quant.ggml import GGML_TYPES, GGMLWeight
from hybridserve.quant.gguf.weights import ColumnPermutedWeight
from hybridserve.quant.tiny import awq_quantize, fp8_quantize
from hybridserve.quant.weight import ColumnWindowWeight, ConcatWeight, FloatWeight, SliceError


def _ggml(qtype: str, out: int, inp: int, seed: int = 0) -> GGMLWeight:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inp)).astype(np.float32)
    stored, _ = _quantize(w, qtype, rng)
    return GGMLWeight(qtype, torch.from_numpy(np.ascontiguousarray(stored)).view(torch.uint8).reshape(out, -1),
                      (out, inp))


def _has_blocks(w) -> bool:
    """Whether a GGML block part is in ``w`` (its kernel rounds activations to 8 bits)."""
    if w is None or isinstance(w, GGMLWeight):
        return w is not None
    return any(_has_blocks(p) for p in getattr(w, "parts", [])) or _has_blocks(getattr(w, "inner", None))


def _check(w, a: int, b: int, x_rows: int = 3) -> None:
    full = w.dequantize(torch.float32)
    s = w.cols(a, b)
    assert tuple(s.shape) == (w.shape[0], b - a)
    assert torch.equal(s.dequantize(torch.float32), full[:, a:b])
    # The product on the slice: the format's kernels (native where they run) against
    # F.linear on the dequantized slice; float32 sums of the same products, and the
    # block kernels' 8-bit activation rounding bounded like the fidelity tests'.
    x = torch.randn(x_rows, b - a)
    ref = F.linear(x, full[:, a:b])
    tol = 3e-2 if _has_blocks(w) else 1e-5
    assert (s.linear(x) - ref).abs().max() <= tol * max(1.0, ref.abs().max())


@pytest.mark.parametrize("qtype", sorted(GGML_TYPES))
def test_ggml_cols_whole_blocks(qtype):
    size = GGML_TYPES[qtype].block_size
    w = _ggml(qtype, 6, 4 * size)
    for a, b in [(0, size), (size, 3 * size), (2 * size, 4 * size), (0, 4 * size)]:
        _check(w, a, b)
    with pytest.raises(SliceError, match=f"multiple of {size}"):
        w.cols(size // 2, 2 * size)
    with pytest.raises(SliceError):
        w.cols(0, size + 8)


def test_float_cols_any_split():
    w = FloatWeight(torch.randn(5, 40))
    _check(w, 3, 17)
    assert w.cols(3, 17).qtype == "f32"


@pytest.mark.parametrize("a,b", [(0, 128), (128, 300), (64, 200), (5, 7), (130, 300), (0, 300)])
def test_fp8_cols_on_and_inside_scale_blocks(a, b):
    torch.manual_seed(0)
    q, s, _ = fp8_quantize(torch.randn(150, 300))
    w = FP8BlockWeight(q, s)
    _check(w, a, b)
    shard = w.cols(a, b)
    # On a 128 boundary: a plain FP8 weight; inside a block: a window over whole blocks.
    assert isinstance(shard, FP8BlockWeight if a % 128 == 0 else ColumnWindowWeight)
    # Rows of a row-offset view, then columns (a tensor-parallel shard of a fused part).
    part = w.rows(40, 150)
    _check(part, a, b)
    _check(shard.rows(3, 100) if hasattr(shard, "rows") else shard, 0, b - a)


def test_awq_cols_whole_groups():
    torch.manual_seed(1)
    qw, qz, sc, _ = awq_quantize(torch.randn(24, 256), group_size=64)
    w = AWQWeight.from_awq(qw, qz, sc, 64)
    for a, b in [(0, 64), (64, 192), (128, 256)]:
        _check(w, a, b)
    _check(w.rows(5, 19), 64, 128)
    with pytest.raises(SliceError, match="multiple of 64"):
        w.cols(32, 128)


def test_concat_cols_slices_every_part():
    torch.manual_seed(2)
    q, s, _ = fp8_quantize(torch.randn(40, 256))
    w = ConcatWeight([_ggml("q8_0", 7, 256), FloatWeight(torch.randn(3, 256)), FP8BlockWeight(q, s)])
    _check(w, 64, 192)


def test_column_permuted_cols_per_value_head():
    # ssm_out under the value-head reorder: 2 key heads, 4 value heads of 32 (grouped in
    # HF's order, tiled in the file's); a rank's columns are its key head's value heads.
    from hybridserve.quant.gguf.names import v_head_perm
    from types import SimpleNamespace

    perm = v_head_perm(SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4), 32)
    w = ColumnPermutedWeight(_ggml("q8_0", 5, 128), perm)
    for a, b in [(0, 64), (64, 128)]:
        _check(w, a, b)
        shard = w.cols(a, b)
        # Two runs of one head each (32 columns): set side by side, no permutation left.
        assert isinstance(shard, GGMLWeight)
    # 4 key heads, 8 value heads of 32, two ranks: two runs of 64 per rank, whose order
    # within the shard is still tiled (a permutation remains).
    perm = v_head_perm(SimpleNamespace(linear_num_key_heads=4, linear_num_value_heads=8), 32)
    w = ColumnPermutedWeight(_ggml("q8_0", 5, 256), perm)
    for a, b in [(0, 128), (128, 256)]:
        _check(w, a, b)
        assert isinstance(w.cols(a, b), ColumnPermutedWeight)
    # Runs narrower than a block (value heads of 16 against Q8_0's 32): refused.
    perm = v_head_perm(SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4), 16)
    w = ColumnPermutedWeight(_ggml("q8_0", 5, 64), perm)
    with pytest.raises(SliceError):
        w.cols(0, 32)
