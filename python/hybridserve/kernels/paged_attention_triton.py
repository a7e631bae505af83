"""Paged attention over block tables in Triton: mixed prefill + decode in one launch.

Contract (identical to :func:`hybridserve.kernels.paged_attention.paged_attention_ref`):

* ``q``: ``[T, Hq, D]``, the queries of all scheduled sequences concatenated; sequence
  ``b`` owns rows ``query_start_loc[b] : query_start_loc[b + 1]``.
* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, Hkv, D]`` (any strides);
  ``Hq`` is a multiple of ``Hkv`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
* ``seq_lens``: int32 ``[B]``, total tokens of each sequence, all of them already in
  the cache (write the new K/V first). The ``q_len`` queries of sequence ``b`` are its
  LAST ``q_len`` tokens, so query ``i`` sits at position ``seq_lens[b] - q_len + i``
  and attends causally to keys ``0 ..= that position``.
* ``block_tables``: int32 ``[B, max_blocks]``; key ``j`` of sequence ``b`` lives at
  ``(block_tables[b, j // block_size], j % block_size)``.
* Returns ``[T, Hq, D]`` in ``q``'s dtype; scores, softmax and the accumulator are
  float32.

Launch: grid ``(T // BLOCK_Q + B, Hkv)``. The first axis enumerates "query blocks"
of ``BLOCK_Q`` consecutive query tokens that never cross a sequence boundary; since
sequence ``b`` needs at most ``q_len_b // BLOCK_Q + 1`` of them, ``T // BLOCK_Q + B``
is an upper bound computable without reading ``query_start_loc`` on the host (no
device sync). A program finds its sequence by binary search over
``query_start_loc[b] // BLOCK_Q + b`` and exits if it is past the sequence's end.
Each program packs the ``G = Hq // Hkv`` query heads that share one KV head into the
rows of one ``[BLOCK_M = BLOCK_Q * G, D]`` tile, so every K/V tile it gathers is
used by all of them (GQA reads each KV block once per query block, not once per
query head). It then walks the sequence's keys in tiles of ``TILE_N`` tokens,
following the block table per key (``TILE_N`` and ``block_size`` are independent),
stopping at the last key its latest query can see, with an online softmax
(running max and sum, rescaled accumulator) in float32. Both products are ``tl.dot``.
Cost per program: ``O(ctx * BLOCK_M * D)`` FLOPs, ``O(ctx * D)`` bytes of K/V.

Split-KV (long decodes): when the grid above is too small to fill the GPU, a third
grid axis of ``NUM_SPLITS`` programs divides each sequence's visible keys into equal
runs of whole tiles; each writes its unnormalised float32 accumulator, running max
and sum, and a second launch (grid ``(T, Hq)``) merges them by log-sum-exp. The
result equals the single-pass one up to float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention_triton"]


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``b`` with ``query_start_loc[b] // BLOCK_Q + b <= q_block_idx``.

    That expression is the first query block of sequence ``b``; it is
    non-decreasing in ``b``, so a binary search over ``[0, num_seqs)`` finds the owner.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    num_seqs,
    block_size,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt_b,
    stride_bt_j,
    part_acc_ptr,  # NUM_SPLITS > 1 only: float32 [T, Hq, NUM_SPLITS, HEAD_PAD]
    part_ml_ptr,  # NUM_SPLITS > 1 only: float32 [T, Hq, NUM_SPLITS, 2] (max, sum)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: >= BLOCK_Q * GROUP, a power of two
    TILE_N: tl.constexpr,  # keys per inner iteration
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # > 1: this program covers one of NUM_SPLITS key ranges
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if local_q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = local_q_block * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM

    q_rows = (q_start + q_pos).to(tl.int64)
    q_off = q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    # Absolute position of each row's query; the last key any row may see bounds the walk.
    q_abs = context_len + q_pos
    last_q = tl.minimum((local_q_block + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q + 1
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    key_lo = 0
    key_hi = num_keys
    if NUM_SPLITS > 1:
        # Whole tiles per split, so only the last tile of the last split is ragged.
        tiles_per_split = tl.cdiv(tl.cdiv(num_keys, TILE_N), NUM_SPLITS)
        key_lo = split * tiles_per_split * TILE_N
        key_hi = tl.minimum(key_lo + tiles_per_split * TILE_N, num_keys)
    for start_n in range(key_lo, key_hi, TILE_N):
        key_idx = start_n + offs_n
        key_ok = key_idx < key_hi
        phys = tl.load(bt_row + (key_idx // block_size) * stride_bt_j, mask=key_ok, other=0).to(tl.int64)
        slot = key_idx % block_size

        k_off = (
            phys[None, :] * stride_k_b
            + slot[None, :] * stride_k_s
            + kv_head * stride_k_h
            + offs_d[:, None] * stride_k_d
        )
        k = tl.load(k_cache_ptr + k_off, mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        visible = row_ok[:, None] & key_ok[None, :] & (key_idx[None, :] <= q_abs[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; pin it to 0 so that
        # exp2(-inf - m) stays 0 instead of NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        v_off = (
            phys[:, None] * stride_v_b
            + slot[:, None] * stride_v_s
            + kv_head * stride_v_h
            + offs_d[None, :] * stride_v_d
        )
        v = tl.load(v_cache_ptr + v_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_off = q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Unnormalised partials; a split that saw no visible key leaves m = -inf, l = 0.
        hq = tl.num_programs(1) * GROUP
        part = (q_rows * hq + head) * NUM_SPLITS + split  # [BLOCK_M], int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Log-sum-exp merge of the splits of one (token, head): sum_s 2^(m_s - M) acc_s / same for l."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (tok * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + offs_s) * 2)
    l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.math.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    den = tl.where(den > 0.0, den, 1.0)
    out = num / den
    tl.store(
        out_ptr + tok * stride_o_t + head * stride_o_h + offs_d * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    """Shape/dtype/device checks that need no device sync; raise ValueError saying what to fix."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] with equal shapes, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, hq, d = q.shape
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d:
        raise ValueError(f"head dim of q ({d}) differs from the cache's ({dk})")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} unsupported; use float32, float16 or bfloat16")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}")
    if query_start_loc.dim() != 1 or seq_lens.dim() != 1 or block_tables.dim() != 2:
        raise ValueError("query_start_loc must be [B+1], seq_lens [B], block_tables [B, max_blocks]")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1 or block_tables.shape[0] != b:
        raise ValueError(
            f"batch sizes disagree: query_start_loc has {query_start_loc.shape[0]} entries (want B+1), "
            f"seq_lens {b}, block_tables {block_tables.shape[0]} rows"
        )
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    devs = {t.device for t in (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")


_SM_COUNT: dict[int, int] = {}


def _auto_splits(q: torch.Tensor, programs: int, max_keys: int) -> int:
    """Key-range splits that fill the GPU when there are few (query block, KV head) programs.

    ``max_keys`` is the block-table width times the block size: a bound known on the
    host without a device sync. Splitting pays when programs are fewer than SMs and
    contexts can be long; each split keeps at least 256 keys of work.
    """
    if not q.is_cuda:
        return 1
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    sms = _SM_COUNT[idx]
    if programs >= sms or max_keys < 1024:
        return 1
    want = triton.next_power_of_2(triton.cdiv(2 * sms, programs))
    return max(1, min(16, want, triton.next_power_of_2(max_keys // 256 + 1) // 2))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention for a flattened mixed prefill/decode batch; see the module doc.

    ``num_kv_splits`` (a power of two): split each sequence's keys into that many
    ranges processed by separate programs, then merge them by log-sum-exp (a second,
    tiny launch); ``None`` picks it from the SM count (1 off-GPU or when the batch
    already fills the device). Extra memory with splits: ``T * Hq * splits * (D + 2)``
    float32.

    Index values (sequence lengths, block ids) are not validated here: that would cost
    a device sync per layer; the scheduler guarantees them and the reference path
    raises on them in tests.
    """
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
        raise ValueError(f"num_kv_splits must be a power of two >= 1 or None, got {num_kv_splits}")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if t == 0 or num_seqs == 0:
        return out

    group = hq // hkv
    # tl.dot needs every dimension >= 16. Decode-heavy batches: 16 rows keep the waste
    # of 1-token sequences low (a group of >= 16 heads fills them alone). Prefill-heavy
    # batches (>= 64 queries per sequence on average, known from shapes alone): 64 rows
    # per program read each K/V tile for 4x as many queries.
    head_pad = max(16, triton.next_power_of_2(d))
    # Except float32 with 256-dim heads: 64 rows there spill kilobytes (IEEE) or exceed
    # shared memory (3xTF32) on sm_90.
    wide_ok = q.dtype != torch.float32 or head_pad <= 128
    rows = 64 if t >= 64 * num_seqs and wide_ok else 16
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = max(1, block_m // group)
    # Sized with ptxas -v for sm_90 (bf16, unit head-dim stride): 32 keys per tile and
    # 8 warps for 64-row or 256-dim tiles stay under ~190 registers with no spills.
    tile_n = 32
    num_warps = 8 if block_m >= 64 or head_pad >= 256 else 4
    # float32 inputs: keep IEEE products so the kernel matches the float32 reference
    # (tf32 would cost ~1e-3 relative); half types are exact in either mode.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    q_blocks = t // block_q + num_seqs
    splits = num_kv_splits or _auto_splits(q, q_blocks * hkv, block_tables.shape[1] * block_size)
    if splits > 1:
        part_acc = torch.empty(t, hq, splits, head_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # never touched
    _paged_attention_kernel[(q_blocks, hkv, splits)](
        out,
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale) * 1.4426950408889634,
        num_seqs,
        block_size,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        part_acc,
        part_ml,
        HEAD_DIM=d,
        HEAD_PAD=head_pad,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        DOT_PRECISION=precision,
        NUM_SPLITS=splits,
        num_warps=num_warps,
    )
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            out,
            part_acc,
            part_ml,
            hq,
            *out.stride(),
            HEAD_DIM=d,
            HEAD_PAD=head_pad,
            NUM_SPLITS=splits,
            num_warps=4,
        )
    return out
