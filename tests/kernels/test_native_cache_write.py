"""The native K/V cache write against the plain-PyTorch reference
(``write_kv_ref``), on arena-like paged views (blocks a page apart, padding between),
``v`` a strided column range as the model passes it, padding slots skipped."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import native, ops
from hybridserve.kernels.cache_write import write_kv_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="built without hybridserve._core.kernels")


def paged_caches(blocks, bs, hkv, d, dtype, page_pad=13):
    """K and V views ``[blocks, bs, hkv, d]`` over one flat buffer, each block a page of
    ``2 * bs * hkv * d + page_pad`` elements (K then V), like the arena's."""
    item = bs * hkv * d
    page = 2 * item + page_pad
    flat = torch.full((blocks * page,), -7.0, dtype=dtype)
    k = flat.as_strided((blocks, bs, hkv, d), (page, hkv * d, d, 1), 0)
    v = flat.as_strided((blocks, bs, hkv, d), (page, hkv * d, d, 1), item)
    return flat, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_kv_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(3)
    blocks, bs, hkv, d, t = 6, 4, 2, 8, 9
    qkv = torch.randn(t, 3 * hkv * d + 5, generator=g).to(dtype)
    key = torch.randn(t, hkv, d, generator=g).to(dtype)
    value = qkv[:, 5 + hkv * d:5 + 2 * hkv * d].view(t, hkv, d)  # strided rows
    slots = torch.tensor([3, -1, 17, 0, 22, 9, -1, 23, 12])
    flat_want, k_want, v_want = paged_caches(blocks, bs, hkv, d, dtype)
    flat_got, k_got, v_got = paged_caches(blocks, bs, hkv, d, dtype)
    write_kv_ref(key, value, k_want, v_want, slots)
    native.write_kv(key, value, k_got, v_got, slots)
    assert torch.equal(flat_got, flat_want)  # padding between pages untouched too


def test_ops_write_kv_takes_the_native_path(monkeypatch):
    _, k, v = paged_caches(2, 2, 1, 4, torch.float32)
    calls = []
    real = native.write_kv
    monkeypatch.setattr(native, "write_kv", lambda *a: calls.append(1) or real(*a))
    ops.write_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), k, v, torch.tensor([3]))
    assert calls and torch.equal(k[1, 1], torch.ones(1, 4))


def test_native_write_kv_bad_input_is_a_clear_error_and_writes_nothing():
    flat, k, v = paged_caches(2, 2, 1, 4, torch.float32)
    before = flat.clone()
    with pytest.raises(ValueError, match="past the cache"):
        native.write_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), k, v, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="one row per slot"):
        native.write_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), k, v, torch.tensor([0]))
    assert torch.equal(flat, before)
