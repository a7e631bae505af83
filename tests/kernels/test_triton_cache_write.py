"""Triton KV cache write vs the PyTorch reference (interpreter, CPU).

A copy is exact, so caches are compared with ``torch.equal`` (no tolerance): both
paths cast with round-to-nearest when the cache dtype differs from the input's.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.cache_write_triton import write_kv_triton


def _case(block_size, hkv, d, in_dtype, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    t = 21
    # Distinct slots scattered over shuffled blocks, with padding tokens (-1) mixed in.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(torch.int32)
    slots[[0, 5, 6, 20]] = -1
    key = torch.randn(t, hkv, d, generator=gen).to(in_dtype)
    value = torch.randn(t, hkv, d, generator=gen).to(in_dtype)
    k_cache, v_cache = _arena_views(num_blocks, block_size, hkv, d, cache_dtype, gen)
    return key, value, k_cache, v_cache, slots


def _arena_views(num_blocks, block_size, hkv, d, dtype, gen):
    """K and V of one attention layer as the arena holds them: strided views of pages
    that also hold another layer's block and padding (random data)."""
    blk = block_size * hkv * d
    page = 4 * blk + 8
    arena = torch.randn(num_blocks * page, generator=gen).to(dtype)
    shape, strides = (num_blocks, block_size, hkv, d), (page, hkv * d, d, 1)
    return arena.as_strided(shape, strides, 2 * blk), arena.as_strided(shape, strides, 3 * blk)


@pytest.mark.parametrize(
    "block_size,hkv,d,in_dtype,cache_dtype",
    [
        (16, 2, 64, torch.float32, torch.float32),
        (32, 4, 32, torch.float32, torch.float32),
        (16, 1, 80, torch.float32, torch.float16),  # non-power-of-two head dim, cast on write
        (32, 2, 32, torch.float16, torch.float16),
    ],
)
def test_matches_reference_and_skips_padding(block_size, hkv, d, in_dtype, cache_dtype):
    key, value, k_cache, v_cache, slots = _case(block_size, hkv, d, in_dtype, cache_dtype, seed=d)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_want, v_want, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want)
    assert torch.equal(v_cache, v_want)


def test_strided_inputs_int64_slots():
    # key/value as slices of a fused [T, 2, Hkv, D] projection; caches as views of one buffer.
    key, value, k_cache, v_cache, slots = _case(16, 2, 32, torch.float32, torch.float32, seed=3)
    fused = torch.stack([key, value], dim=1)
    kv = torch.stack([k_cache, v_cache])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_want, v_want, slots)
    write_kv_triton(fused[:, 0], fused[:, 1], kv[0], kv[1], slots.long())
    assert torch.equal(kv[0], k_want)
    assert torch.equal(kv[1], v_want)


def test_bad_input_raises_clear_error():
    key, value, k_cache, v_cache, slots = _case(16, 2, 32, torch.float32, torch.float32, seed=4)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv_triton(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="cache rows"):
        write_kv_triton(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="int32 or int64"):
        write_kv_triton(key, value, k_cache, v_cache, slots.float())
