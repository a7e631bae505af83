"""Writing new K/V rows into the paged cache: the plain-PyTorch reference.

Cache layout (one tensor per full-attention layer, K and V separately):
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous. Token ``t`` of a
step goes to flat slot ``slot_mapping[t] = block * block_size + offset``; a negative
slot marks a padding token that is not written (CUDA-graph padding, for example).
"""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches in place. O(T * Hkv * D).

    ``slot_mapping`` is an integer tensor ``[T]``; rows whose slot is negative are
    skipped. Values are cast to the cache dtype. Duplicate non-negative slots are a
    caller bug (the winner is unspecified).
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [T, Hkv, D]")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but there are {key.shape[0]} tokens"
        )
    bs = k_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    # (block, offset) indexing writes in place into the caches, which may be the
    # arena's views (blocks a page apart, so no flat [slots, Hkv, D] view exists).
    blk, off = slots // bs, slots % bs
    k_cache[blk, off] = key.to(k_cache.dtype)
    v_cache[blk, off] = value.to(v_cache.dtype)
