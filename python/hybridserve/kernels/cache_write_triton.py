"""Write new K/V rows into the paged cache at their slots, in Triton.

Contract (identical to :func:`hybridserve.kernels.cache_write.write_kv_ref`):
``key``/``value`` ``[T, Hkv, D]``; ``k_cache``/``v_cache``
``[num_blocks, block_size, Hkv, D]`` (any strides); ``slot_mapping`` int ``[T]``
with ``slot = block * block_size + offset``; a negative slot (padding) is skipped.
Both caches are written in place, casting to the cache dtype.

Launch: grid ``(T, Hkv)``; each program copies one token's K and V row of one head
(``D`` elements each, padded to a power of two with a mask). Key and value share the
launch (one kernel instead of two copies). ``O(T * Hkv * D)`` bytes moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    block_size,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_val_t,
    stride_val_h,
    stride_val_d,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_vc_d,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    tok64 = tok.to(tl.int64)

    k = tl.load(key_ptr + tok64 * stride_key_t + head * stride_key_h + offs_d * stride_key_d, mask=d_ok)
    v = tl.load(value_ptr + tok64 * stride_val_t + head * stride_val_h + offs_d * stride_val_d, mask=d_ok)
    kc = k_cache_ptr + blk * stride_kc_b + off * stride_kc_s + head * stride_kc_h + offs_d * stride_kc_d
    vc = v_cache_ptr + blk * stride_vc_b + off * stride_vc_s + head * stride_vc_h + offs_d * stride_vc_d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the caches at ``slot_mapping``; see the module doc.

    Slot values are not range-checked (that would need a device sync every layer);
    the scheduler produces them, and the reference path raises on bad ones in tests.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [T, Hkv, D] with equal shapes, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] with equal shapes, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    t, hkv, d = key.shape
    if tuple(k_cache.shape[2:]) != (hkv, d):
        raise ValueError(f"key rows are [Hkv={hkv}, D={d}] but cache rows are {list(k_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping must be [T={t}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    devs = {x.device for x in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    if t == 0:
        return
    _write_kv_kernel[(t, hkv)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=d,
        HEAD_PAD=triton.next_power_of_2(d),
        num_warps=1 if d <= 128 else 2,
    )
