"""Triton paged attention vs the gather-based PyTorch reference (interpreter, CPU).

Each case is one launch over a mixed batch: a whole-prompt prefill, a decode step, a
chunked-prefill continuation (queries in the middle of the context), a one-token
sequence, a sequence with no queries this step and one whose queries cross several
query blocks, with block ids shuffled over a pool larger than needed (the unused
blocks hold random data, so following the wrong table entry shows).

Split-KV (``num_kv_splits``) is forced in its own test, since off-GPU the automatic
choice is always one split.

Tolerances: float32 ``atol = rtol = 2e-5`` (the kernel uses exp2 with a pre-scaled
log2(e) and an online softmax, the reference exp and a two-pass softmax; both
accumulate in float32, observed error ~1e-6). float16 ``atol = rtol = 2e-3``
(the kernel rounds the probabilities to float16 before the P @ V product, as GPU
kernels do; the reference keeps them float32).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.paged_attention import paged_attention_ref
from hybridserve.kernels.paged_attention_triton import paged_attention_triton

# (seq_len, q_len) per sequence.
MIXED = [(37, 37), (50, 1), (70, 13), (1, 1), (33, 0), (21, 20)]


def _batch(seqs, block_size, hkv, group, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 2
    # Entries past a sequence's blocks are padding of any value (the contract): here ids
    # far out of range, so following one would read outside the cache.
    tables = torch.full((len(seqs), max_blocks), 1 << 24, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    # K and V of one attention layer as the arena holds them: strided views of pages
    # that also hold another layer's block and padding (random data).
    blk = block_size * hkv * d
    page = 4 * blk + 8
    arena = torch.randn(num_blocks * page, generator=gen).to(dtype)
    shape, strides = (num_blocks, block_size, hkv, d), (page, hkv * d, d, 1)
    k_cache, v_cache = arena.as_strided(shape, strides, 2 * blk), arena.as_strided(shape, strides, 3 * blk)
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hkv * group, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, qsl, seq_lens, tables


@pytest.mark.parametrize(
    "block_size,hkv,group,d,dtype",
    [
        (16, 2, 1, 64, torch.float32),
        (32, 2, 4, 32, torch.float32),
        (16, 1, 4, 80, torch.float32),  # head dim not a power of two
        (32, 2, 3, 64, torch.float32),  # group not a power of two: padded rows
        (16, 2, 4, 32, torch.float16),
    ],
)
def test_mixed_batch_matches_reference(block_size, hkv, group, d, dtype):
    q, k_cache, v_cache, qsl, seq_lens, tables = _batch(MIXED, block_size, hkv, group, d, dtype, seed=d + group)
    scale = d**-0.5
    got = paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, scale)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_heavy_batch_uses_wide_query_blocks(group):
    # >= 64 queries per sequence on average selects 64-row programs; the decode and the
    # short chunk share the launch and must still be right.
    seqs = [(130, 130), (70, 66), (9, 1)]
    q, k_cache, v_cache, qsl, seq_lens, tables = _batch(seqs, 16, 2, group, 32, torch.float32, seed=group)
    assert q.shape[0] >= 64 * len(seqs)
    got = paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [2, 8])
def test_split_kv_matches_reference(splits):
    # Splits beyond a short sequence's tiles get no keys (max -inf, sum 0) and must
    # drop out of the merge; long ones span several tiles per split.
    seqs = [(150, 1), (3, 1), (97, 3), (20, 2)]
    q, k_cache, v_cache, qsl, seq_lens, tables = _batch(seqs, 16, 1, 4, 32, torch.float32, seed=splits)
    got = paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2, num_kv_splits=splits)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_strided_views_and_int64_indices():
    # The kernel takes strides: q as a slice of a fused projection, caches as views
    # into a larger [2, ...] K/V buffer, int64 index tensors.
    seqs = [(40, 3), (17, 17)]
    q, k_cache, v_cache, qsl, seq_lens, tables = _batch(seqs, 16, 2, 2, 32, torch.float32, seed=7)
    fused = torch.randn(q.shape[0], q.shape[1], 3 * q.shape[2])
    fused[:, :, 32:64] = q
    q_view = fused[:, :, 32:64]
    kv = torch.stack([k_cache, v_cache])
    got = paged_attention_triton(q_view, kv[0], kv[1], qsl.long(), seq_lens.long(), tables.long(), 0.3)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, tables, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of KV heads"),
        (lambda a: a.update(q=a["q"][..., :16]), "head dim"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "batch sizes disagree"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "int32 or int64"),
        (lambda a: a.update(v_cache=a["v_cache"].half()), "dtype"),
        (lambda a: a.update(num_kv_splits=3), "power of two"),
    ],
)
def test_bad_input_raises_clear_error(change, match):
    q, k_cache, v_cache, qsl, seq_lens, tables = _batch([(5, 2), (9, 1)], 16, 2, 2, 32, torch.float32, seed=1)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables)
    change(args)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(**args, scale=1.0)
