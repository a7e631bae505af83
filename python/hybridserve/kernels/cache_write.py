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
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    # A view over the contiguous cache, so indexing by flat slot writes in place.
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
