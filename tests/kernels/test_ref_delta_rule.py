"""The delta-rule references against HF transformers' own torch implementations, and
the CPU path against the token-by-token reference on random mixed batches."""

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


@pytest.mark.parametrize("impl", ["recurrent", "chunked", "cpu"])
def test_matches_hf_per_sequence(impl):
    lens = [5, 1, 37, 1, 20, 1]  # decodes and prefills of different lengths interleaved
    h, kd, vd = 3, 8, 6
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(9, h, kd, vd, generator=gen)
    slots = torch.tensor([4, 0, 2, 7, 5, 8])
    init = torch.tensor([True, False, True, True, False, False])
    pool[[0, 5, 8]] = float("nan")  # slots starting fresh may hold anything: never read
    pool_before = pool.clone()
    fn = {"recurrent": gated_delta_rule_recurrent_ref,
          "chunked": lambda *a, **kw: gated_delta_rule_chunked_ref(*a, **kw, chunk_size=16),
          "cpu": gated_delta_rule_cpu}[impl]
    o = fn(q, k, v, g, beta, pool, qsl, slots, init, kd ** -0.5)
    for b, n in enumerate(lens):
        s, e = int(qsl[b]), int(qsl[b + 1])
        init_state = pool_before[slots[b]][None] if init[b] else None
        ref_o, ref_s = hf.torch_recurrent_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            initial_state=init_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[s:e], ref_o[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slots[b]], ref_s[0], rtol=1e-4, atol=1e-5)
    # Slots nobody used stay untouched.
    for untouched in (1, 3, 6):
        assert torch.equal(pool[untouched], pool_before[untouched])


def test_chunked_equals_recurrent_and_splitting_is_invisible():
    lens = [70]
    h, kd, vd = 2, 4, 4
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd, seed=3)
    pool_a = torch.zeros(1, h, kd, vd)
    o_a = gated_delta_rule_recurrent_ref(q, k, v, g, beta, pool_a, qsl, [0], [False], 0.5)
    pool_b = torch.zeros(1, h, kd, vd)
    o_b = gated_delta_rule_chunked_ref(q, k, v, g, beta, pool_b, qsl, [0], [False], 0.5, chunk_size=8)
    torch.testing.assert_close(o_a, o_b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool_a, pool_b, rtol=1e-4, atol=1e-5)
    # Feeding the same sequence as chunks of 13, 7 and the rest continues the state.
    pool_c = torch.zeros(1, h, kd, vd)
    outs, start = [], 0
    for n in (13, 7, 50):
        sl = slice(start, start + n)
        outs.append(gated_delta_rule_chunked_ref(
            q[sl], k[sl], v[sl], g[sl], beta[sl], pool_c, torch.tensor([0, n]), [0], [start > 0], 0.5,
            chunk_size=8))
        start += n
    torch.testing.assert_close(torch.cat(outs), o_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool_c, pool_a, rtol=1e-4, atol=1e-5)


def test_hf_chunked_agrees_with_chunked_ref():
    lens = [100]
    h, kd, vd = 2, 8, 8
    q, k, v, g, beta, qsl = _inputs(lens, h, kd, vd, seed=5)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    pool = torch.zeros(1, h, kd, vd)
    o = gated_delta_rule_chunked_ref(q, k, v, g, beta, pool, qsl, [0], [False], kd ** -0.5)
    torch.testing.assert_close(o, ref_o[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], ref_s[0], rtol=1e-4, atol=1e-5)


def test_non_float32_state_is_refused():
    q, k, v, g, beta, qsl = _inputs([2], 1, 2, 2)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_recurrent_ref(q, k, v, g, beta, torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16),
                                       qsl, [0], [False], 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_cpu_path_matches_recurrent_reference_on_random_mixed_batches(seed):
    """Whole prompts, chunks continuing from a state and decodes in one call, lengths
    around the chunk sizes (1, 2, 15-17, 63-65, 130...), grouped key heads, fresh slots
    holding NaN, and two calls sharing one plan (as the model's layers do)."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = [1, 1, 1, 2, 3, 8, 15, 16, 17, 40, 63, 64, 65, 130, 0]
    lens = [pick[i] for i in torch.randint(len(pick), (int(torch.randint(3, 12, (1,), generator=gen)),),
                                            generator=gen).tolist()]
    hk, rep = [(1, 1), (2, 2), (3, 1), (2, 3)][seed]
    h, kd, vd = hk * rep, 8, 12
    t = sum(lens)
    q = torch.randn(t, hk, kd, generator=gen)
    k = torch.randn(t, hk, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    n_slots = len(lens) + 3
    slots = torch.randperm(n_slots, generator=gen)[: len(lens)]
    init = torch.rand(len(lens), generator=gen) < 0.5
    pool = torch.randn(n_slots, h, kd, vd, generator=gen)
    pool[slots[~init]] = float("nan")
    want_pool, got_pool = pool.clone(), pool.clone()
    plan = DeltaRulePlan(qsl, slots, init)
    for _ in range(2):  # the second call continues from the first one's states
        want = gated_delta_rule_recurrent_ref(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g,
                                              beta, want_pool, qsl, slots, init, kd ** -0.5)
        got = gated_delta_rule_cpu(q, k, v, g, beta, got_pool, qsl, slots, init, kd ** -0.5, plan=plan)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-5, equal_nan=True)
        init = torch.ones_like(init)
        plan = DeltaRulePlan(qsl, slots, init)


def test_cpu_path_does_not_pad_runs_to_the_longest():
    """A long prompt next to short ones: each run is cut into its own chunks (only its
    last chunk padded), never to the longest run's length."""
    lens = [1024] + [8] * 31 + [1] * 5
    plan = DeltaRulePlan(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()), list(range(37)),
                         [False] * 37)
    padded = sum(grp["rows"].numel() for grp in plan.groups)
    assert padded <= 1024 + 31 * 16
    assert plan.decode[0].numel() == 5
