"""The delta-rule references against HF transformers' own torch implementations, and
the CPU path against the token-by-token reference on random mixed batches; state in
scattered pages of a pool (fresh pages NaN-filled), checkpoints inside a run."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from hybridserve.kernels.gated_delta_rule import (
    DeltaRulePlan,
    gated_delta_rule_chunked_ref,
    gated_delta_rule_cpu,
    gated_delta_rule_recurrent_ref,
)


def _inputs(lens, h=3, kd=8, vd=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, kd, generator=gen)
    k = torch.randn(t, h, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return q, k, v, g, beta, qsl


IMPLS = {"recurrent": gated_delta_rule_recurrent_ref,
         "chunked": lambda *a, **kw: gated_delta_rule_chunked_ref(*a, **kw, chunk_size=16),
         "cpu": gated_delta_rule_cpu}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_hf_per_sequence(impl, paged_pool):
    lens = [5, 1, 37, 1, 20, 1]  # decodes and prefills of different lengths interleaved
    h, kd, vd = 3, 8, 6
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd)
    pool = paged_pool(len(lens), h, (kd, vd), torch.Generator().manual_seed(1))
    init = torch.tensor([True, False, True, True, False, False])
    pool.nan_fill([0 + b for b in range(len(lens)) if not init[b]])  # never read
    before = pool.clone()
    o = IMPLS[impl](q, k, v, g, beta, pool.pool, qsl, pool.table, init, kd ** -0.5, item_base=pool.item_base)
    expect = before.clone()
    for b, n in enumerate(lens):
        s, e = int(qsl[b]), int(qsl[b + 1])
        init_state = before.items(b)[None] if init[b] else None
        ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            initial_state=init_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[s:e], ref_o[0], rtol=1e-4, atol=1e-5)
        expect.set_items(b, ref_s[0])
    # Every element of the arena: the runs' items as HF says, nothing else touched
    # (other pages, the column the layer does not read, the padding between pages).
    torch.testing.assert_close(pool.buf, expect.buf, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_chunked_equals_recurrent_and_splitting_is_invisible(paged_pool):
    lens = [70]
    h, kd, vd = 2, 4, 4
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd, seed=3)
    a = paged_pool(1, h, (kd, vd), torch.Generator().manual_seed(0))
    b, c = a.clone(), a.clone()
    o_a = gated_delta_rule_recurrent_ref(q, k, v, g, beta, a.pool, qsl, a.table, [False], 0.5, item_base=2)
    o_b = gated_delta_rule_chunked_ref(q, k, v, g, beta, b.pool, qsl, b.table, [False], 0.5, chunk_size=8,
                                       item_base=2)
    torch.testing.assert_close(o_a, o_b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.buf, b.buf, rtol=1e-4, atol=1e-5)
    # Feeding the same sequence as chunks of 13, 7 and the rest continues the state.
    outs, start = [], 0
    for n in (13, 7, 50):
        sl = slice(start, start + n)
        outs.append(gated_delta_rule_chunked_ref(
            q[sl], k[sl], v[sl], g[sl], beta[sl], c.pool, torch.tensor([0, n]), c.table, [start > 0], 0.5,
            chunk_size=8, item_base=2))
        start += n
    torch.testing.assert_close(torch.cat(outs), o_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c.buf, a.buf, rtol=1e-4, atol=1e-5)


def test_hf_chunked_agrees_with_chunked_ref(paged_pool):
    lens = [100]
    h, kd, vd = 2, 8, 8
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd, seed=5)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    pool = paged_pool(1, h, (kd, vd), torch.Generator().manual_seed(0))
    o = gated_delta_rule_chunked_ref(q, k, v, g, beta, pool.pool, qsl, pool.table, [False], kd ** -0.5,
                                     item_base=2)
    torch.testing.assert_close(o, ref_o[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool.items(0), ref_s[0], rtol=1e-4, atol=1e-5)


def test_non_float32_state_is_refused():
    q, k, v, g, beta, qsl = _inputs([2], 1, 2, 2)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_recurrent_ref(q, k, v, g, beta, torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16),
                                       qsl, [[0]], [False], 1.0, item_base=0)
    with pytest.raises(ValueError, match="num_pages, per_page"):
        gated_delta_rule_recurrent_ref(q, k, v, g, beta, torch.zeros(1, 2, 2), qsl, [[0]], [False], 1.0,
                                       item_base=0)


def _random_batch(gen, seed):
    pick = [1, 1, 1, 2, 3, 8, 15, 16, 17, 40, 63, 64, 65, 130, 0]
    lens = [pick[i] for i in torch.randint(len(pick), (int(torch.randint(3, 12, (1,), generator=gen)),),
                                            generator=gen).tolist()]
    hk, rep = [(1, 1), (2, 2), (3, 1), (2, 3)][seed % 4]
    h, kd, vd = hk * rep, 8, 12
    t = sum(lens)
    q = torch.randn(t, hk, kd, generator=gen)
    k = torch.randn(t, hk, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    init = torch.rand(len(lens), generator=gen) < 0.5
    # A checkpoint in about half the runs with tokens, anywhere in 1..len.
    ck = [int(torch.randint(1, n + 1, (1,), generator=gen)) if n and bool(torch.rand(1, generator=gen) < 0.5)
          else -1 for n in lens]
    return lens, (hk, rep, h, kd, vd), (q, k, v, g, beta, qsl), init, torch.tensor(ck, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(4))
def test_cpu_path_matches_recurrent_reference_on_random_mixed_batches(seed, paged_pool):
    """Whole prompts, chunks continuing from a state and decodes in one call, lengths
    around the chunk sizes (1, 2, 15-17, 63-65, 130...), grouped key heads, fresh pages
    holding NaN, checkpoints at random positions, and two calls sharing one plan (as the
    model's layers do)."""
    gen = torch.Generator().manual_seed(100 + seed)
    lens, (hk, rep, h, kd, vd), (q, k, v, g, beta, qsl), init, ck = _random_batch(gen, seed)
    pool = paged_pool(len(lens), h, (kd, vd), gen)
    pool.nan_fill([b for b in range(len(lens)) if not init[b]], [b for b in range(len(lens)) if ck[b] >= 0])
    want, got = pool, pool.clone()
    kw = dict(item_base=pool.item_base, checkpoint_positions=ck, checkpoint_pages=pool.ck_table)
    plan = DeltaRulePlan(qsl, init, checkpoint_positions=ck)
    for _ in range(2):  # the second call continues from the first one's states
        o_want = gated_delta_rule_recurrent_ref(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g,
                                                beta, want.pool, qsl, want.table, init, kd ** -0.5, **kw)
        o_got = gated_delta_rule_cpu(q, k, v, g, beta, got.pool, qsl, got.table, init, kd ** -0.5, plan=plan, **kw)
        torch.testing.assert_close(o_got, o_want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.buf, want.buf, rtol=1e-4, atol=1e-5, equal_nan=True)
        init = torch.ones_like(init)
        plan = DeltaRulePlan(qsl, init, checkpoint_positions=ck)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_checkpoint_equals_running_the_reference_to_its_position(impl, paged_pool):
    """The state written at checkpoint position k is the state a separate call over the
    run's first k tokens leaves; the run's output and final state are unchanged by it."""
    lens = [40, 1, 17, 9, 33]
    ck = torch.tensor([16, 1, 17, -1, 5], dtype=torch.int32)
    h, kd, vd = 2, 8, 6
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd, seed=7)
    init = torch.tensor([False, True, True, False, True])
    pool = paged_pool(len(lens), h, (kd, vd), torch.Generator().manual_seed(3))
    pool.nan_fill([b for b in range(len(lens)) if not init[b]], [b for b in range(len(lens)) if ck[b] >= 0])
    plain = pool.clone()
    with_ck = pool.clone()
    fn = IMPLS[impl]
    o_plain = fn(q, k, v, g, beta, plain.pool, qsl, plain.table, init, kd ** -0.5, item_base=2)
    o_ck = fn(q, k, v, g, beta, with_ck.pool, qsl, with_ck.table, init, kd ** -0.5, item_base=2,
              checkpoint_positions=ck, checkpoint_pages=with_ck.ck_table)
    torch.testing.assert_close(o_ck, o_plain, rtol=1e-4, atol=1e-5)
    for b, n in enumerate(lens):
        torch.testing.assert_close(with_ck.items(b), plain.items(b), rtol=1e-4, atol=1e-5)
        if ck[b] < 0:  # no checkpoint asked: its checkpoint row's pages untouched
            assert torch.equal(with_ck.items(b, checkpoint=True), pool.items(b, checkpoint=True))
            continue
        # The oracle: the token-by-token reference over the first k tokens only.
        prefix = pool.clone()
        s, kk = int(qsl[b]), int(ck[b])
        sl = slice(s, s + kk)
        gated_delta_rule_recurrent_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], prefix.pool,
                                       torch.tensor([0, kk]), prefix.table[b:b + 1], init[b:b + 1],
                                       kd ** -0.5, item_base=2)
        torch.testing.assert_close(with_ck.items(b, checkpoint=True), prefix.items(b), rtol=1e-4, atol=1e-5)


def test_cpu_path_does_not_pad_runs_to_the_longest():
    """A long prompt next to short ones: each run is cut into its own chunks (only its
    last chunk padded), never to the longest run's length."""
    lens = [1024] + [8] * 31 + [1] * 5
    plan = DeltaRulePlan(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()), [False] * 37)
    (phase,) = plan.phases
    padded = sum(grp["rows"].numel() for grp in phase.groups)
    assert padded <= 1024 + 31 * 16
    assert phase.decode[0].numel() == 5
