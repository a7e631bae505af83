"""The delta-rule references against HF transformers' own torch implementations."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from hybridserve.kernels.gated_delta_rule import (
    gated_delta_rule_chunked_ref,
    gated_delta_rule_recurrent_ref,
    gated_delta_rule_ref,
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


@pytest.mark.parametrize("impl", ["recurrent", "chunked", "dispatch"])
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
          "dispatch": gated_delta_rule_ref}[impl]
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
