"""write_kv_ref + paged_attention_ref against dense causal attention (HF eager math)."""

import pytest
import torch

from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.paged_attention import paged_attention_ref


def _dense_causal(q, k, v, scale):
    """q [L, Hq, D] are the last queries of k/v [N, Hkv, D]; plain masked softmax."""
    lq, hq, _ = q.shape
    n, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(n - lq, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("block_size,hq,hkv", [(4, 4, 2), (16, 6, 1), (8, 3, 3)])
def test_paged_matches_dense(block_size, hq, hkv):
    gen = torch.Generator().manual_seed(block_size)
    d = 8
    seq_lens = [9, 1, 23, 16]
    q_lens = [9, 1, 4, 1]  # a full prefill, a 1-token prompt, a chunk continuing, a decode
    num_blocks = 40
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros(num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    # Padding past each sequence's blocks is garbage on purpose: it must never be read.
    tables = torch.full((len(seq_lens), max_blocks), 10_000, dtype=torch.int32)
    full_k, full_v = [], []
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        kk = torch.randn(n, hkv, d, generator=gen)
        vv = torch.randn(n, hkv, d, generator=gen)
        slots = torch.tensor([int(tables[b, i // block_size]) * block_size + i % block_size for i in range(n)])
        # A padding row (slot -1) in the same call must be ignored.
        write_kv_ref(torch.cat([kk, torch.full((1, hkv, d), 99.0)]),
                     torch.cat([vv, torch.full((1, hkv, d), 99.0)]),
                     k_cache, v_cache, torch.cat([slots, torch.tensor([-1])]))
        full_k.append(kk)
        full_v.append(vv)
    assert not (k_cache == 99.0).any()
    qs = [torch.randn(ql, hq, d, generator=gen) for ql in q_lens]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = paged_attention_ref(torch.cat(qs), k_cache, v_cache, qsl,
                              torch.tensor(seq_lens, dtype=torch.int32), tables, d ** -0.5)
    for b in range(len(seq_lens)):
        ref = _dense_causal(qs[b], full_k[b], full_v[b], d ** -0.5)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_output_dtype_follows_q():
    k_cache = torch.randn(2, 4, 1, 4, dtype=torch.bfloat16)
    q = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    out = paged_attention_ref(q, k_cache, k_cache.clone(), torch.tensor([0, 3]), torch.tensor([5]),
                              torch.tensor([[1, 0]]), 0.5)
    assert out.dtype == torch.bfloat16
    ref = _dense_causal(q.float(), k_cache[[1, 0]].reshape(-1, 1, 4)[:5].float(),
                        k_cache[[1, 0]].reshape(-1, 1, 4)[:5].float(), 0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(4))
def test_cpu_path_matches_reference_on_random_mixed_batches(seed):
    """Decodes at contexts from 1 to 300, prefill chunks continuing a context, whole
    prompts (several of one length: the causal-only group), a sequence with no queries,
    GQA groups 1-4, garbage past every block table: the CPU path equals the reference."""
    from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu

    gen = torch.Generator().manual_seed(seed)
    block_size, d = [4, 16, 8, 16][seed], 8
    hkv, group = [(1, 4), (2, 2), (3, 1), (2, 3)][seed]
    hq = hkv * group
    shapes = [(1, 1), (1, 5), (1, 300), (1, 37), (1, 40), (12, 12), (12, 12), (12, 12), (7, 7),
              (20, 90), (3, 45), (0, 9), (33, 33), (1, 38), (2, 2)]
    chosen = [shapes[i] for i in torch.randperm(len(shapes), generator=gen)[:10].tolist()]
    q_lens, seq_lens = [q for q, _ in chosen], [n for _, n in chosen]
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + 1
    k_cache = torch.randn(total, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(total, block_size, hkv, d, generator=gen)
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.full((len(chosen), max(nblocks) + 2), 10_000, dtype=torch.int32)
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, lens, tables, 0.3)
    plan = AttentionPlan(qsl, lens, tables, block_size)
    got = paged_attention_cpu(q, k_cache, v_cache, qsl, lens, tables, 0.3, plan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_never_lets_stale_slots_reach_the_output(dtype):
    """Every cache slot that is not one of a sequence's own tokens holds NaN (what a page
    last used for DeltaNet state can hold when read as bfloat16), in groups whose members
    differ in length: the CPU path reads those slots for the shorter members but must give
    them no part of the output, as the reference (which never reads them) does."""
    from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu

    gen = torch.Generator().manual_seed(7)
    block_size, hkv, group, d = 8, 2, 2, 8
    q_lens, seq_lens = [12, 11, 10, 1, 1, 1], [12, 11, 10, 40, 37, 33]
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + 2
    k_cache = torch.full((total, block_size, hkv, d), float("nan"))
    v_cache = torch.full((total, block_size, hkv, d), float("nan"))
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    for b, (nb, n) in enumerate(zip(nblocks, seq_lens)):
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        for pos in range(n):
            blk, slot = int(tables[b, pos // block_size]), pos % block_size
            k_cache[blk, slot] = torch.randn(hkv, d, generator=gen)
            v_cache[blk, slot] = torch.randn(hkv, d, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, lens, tables, 0.3)
    plan = AttentionPlan(qsl, lens, tables, block_size)
    assert any(g["pad"] is not None for g in plan.groups)  # members of unequal length share a group
    got = paged_attention_cpu(q, k_cache, v_cache, qsl, lens, tables, 0.3, plan)
    assert torch.isfinite(want.float()).all() and torch.isfinite(got.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_cpu_path_groups_decodes_by_context_not_to_the_longest():
    """63 decodes at 256 and one at 8192: the short ones never read 8192 keys."""
    from hybridserve.kernels.paged_attention import AttentionPlan

    lens = [256] * 63 + [8192]
    tables = torch.zeros(64, 512, dtype=torch.int32)
    plan = AttentionPlan(list(range(65)), lens, tables, 16)
    keys_read = sum(g["n"] * g["len"] for g in plan.groups)
    assert keys_read == sum(lens)


def test_cpu_path_bad_input_raises():
    from hybridserve.kernels.paged_attention import paged_attention_cpu

    k_cache = torch.zeros(2, 4, 1, 4)
    with pytest.raises(ValueError, match="queries but only"):
        paged_attention_cpu(torch.zeros(3, 1, 4), k_cache, k_cache, torch.tensor([0, 3]), torch.tensor([2]),
                            torch.tensor([[0]]), 1.0)
    with pytest.raises(ValueError, match="block table has only 1"):
        paged_attention_cpu(torch.zeros(1, 1, 4), k_cache, k_cache, torch.tensor([0, 1]), torch.tensor([5]),
                            torch.tensor([[0]]), 1.0)
