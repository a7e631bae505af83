"""Triton recurrent gated delta rule vs the token-by-token PyTorch reference.

Runs under the interpreter on the CPU. Each case is one launch over a mixed batch:
multi-token prefill chunks and single decode tokens, sequences that start from zeros
and ones that continue from their slot's state, slots in shuffled order in a pool with
extra slots (which must stay untouched), and a sequence with no tokens this step
(its slot must stay untouched even though it claims no initial state).

The chunked kernel (prefill) is held to the same token-by-token oracle.

Tolerances: float32 ``atol = rtol = 1e-5`` on the output and the state (same
operation order per column as the reference; differences are only in reduction
order, observed ~1e-7). float16 inputs: ``atol = rtol = 2e-3`` on the float16 output
(one rounding), ``1e-5`` on the float32 state (the inputs are upcast exactly).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.gated_delta_rule import gated_delta_rule_recurrent_ref
from hybridserve.kernels.gated_delta_rule_triton import (
    gated_delta_rule_chunked_triton,
    gated_delta_rule_recurrent_triton,
    gated_delta_rule_triton,
)

Q_LENS = [9, 1, 0, 4, 1]
# For the chunked kernel: several chunks, a ragged last chunk, a chunk-sized run, a decode.
CHUNKED_Q_LENS = [40, 1, 0, 16, 3]
INIT = [False, True, False, True, False]
SLOTS = [5, 0, 3, 6, 2]


def _case(h, hk, kd, vd, dtype, seed, q_lens=Q_LENS):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, hk, kd, generator=gen).to(dtype)
    k = torch.randn(t, hk, kd, generator=gen).to(dtype)
    v = torch.randn(t, h, vd, generator=gen).to(dtype)
    # HF: g = -exp(A_log) * softplus(.) <= 0, beta = sigmoid(.) in (0, 1).
    g = (-torch.rand(t, h, generator=gen) * 2.0).to(dtype)
    beta = torch.rand(t, h, generator=gen).to(dtype)
    n = len(q_lens)
    state = torch.randn(max(8, n + 3), h, kd, vd, generator=gen)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    if n == len(SLOTS):
        slots, init = torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(INIT)
    else:  # other batch sizes: scattered distinct slots, alternating fresh/continued
        slots, init = torch.randperm(state.shape[0], generator=gen)[:n], torch.arange(n) % 2 == 1
    return q, k, v, g, beta, state, qsl, slots, init


def _expand(x, h):
    return x.repeat_interleave(h // x.shape[1], dim=1)


@pytest.mark.parametrize(
    "h,hk,kd,vd,dtype,l2",
    [
        (2, 2, 32, 32, torch.float32, True),
        (3, 3, 64, 48, torch.float32, True),  # V not a power of two
        (4, 2, 32, 64, torch.float32, True),  # grouped q/k heads read without expansion
        (2, 2, 32, 32, torch.float32, False),
        (2, 2, 32, 32, torch.float16, True),
    ],
)
def test_matches_reference(h, hk, kd, vd, dtype, l2):
    q, k, v, g, beta, state, qsl, slots, init = _case(h, hk, kd, vd, dtype, seed=kd + vd + h)
    scale = kd**-0.5
    state_want = state.clone()
    want = gated_delta_rule_recurrent_ref(
        _expand(q, h), _expand(k, h), v, g, beta, state_want, qsl, slots, init, scale, use_qk_l2norm=l2
    )
    got = gated_delta_rule_recurrent_triton(q, k, v, g, beta, state, qsl, slots, init, scale, use_qk_l2norm=l2)
    assert got.dtype == v.dtype and got.shape == v.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # The whole pool: written slots match, the others (1, 4, 7 and the empty sequence's 3) are untouched.
    torch.testing.assert_close(state, state_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "h,hk,kd,vd,dtype,l2,chunk",
    [
        (2, 2, 32, 32, torch.float32, True, 16),
        (4, 2, 8, 12, torch.float32, True, 32),  # K, V below 16: padded for tl.dot; grouped heads
        (2, 2, 16, 16, torch.float32, False, 16),
        (2, 2, 16, 16, torch.float16, True, 16),
    ],
)
def test_chunked_matches_reference(h, hk, kd, vd, dtype, l2, chunk):
    # The oracle is the token-by-token reference: the chunked kernel must agree with the
    # recurrence itself, not just with another chunked formulation.
    q, k, v, g, beta, state, qsl, slots, init = _case(h, hk, kd, vd, dtype, seed=kd + chunk, q_lens=CHUNKED_Q_LENS)
    scale = kd**-0.5
    state_want = state.clone()
    want = gated_delta_rule_recurrent_ref(
        _expand(q, h), _expand(k, h), v, g, beta, state_want, qsl, slots, init, scale, use_qk_l2norm=l2
    )
    got = gated_delta_rule_chunked_triton(
        q, k, v, g, beta, state, qsl, slots, init, scale, use_qk_l2norm=l2, chunk_size=chunk
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(state, state_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens", [Q_LENS, CHUNKED_Q_LENS, [20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
def test_per_sequence_choice_matches_reference(q_lens):
    # Q_LENS: T < 16, one recurrent launch. CHUNKED_Q_LENS: 40 and 16 tokens go to the
    # chunked kernel, 1 and 3 to the recurrent one, in the same call. The last: T <= B,
    # one recurrent launch even for the 20-token sequence.
    q, k, v, g, beta, state, qsl, slots, init = _case(2, 2, 16, 16, torch.float32, seed=9, q_lens=q_lens)

    state_want = state.clone()
    want = gated_delta_rule_recurrent_ref(q, k, v, g, beta, state_want, qsl, slots, init, 0.25)
    got = gated_delta_rule_triton(q, k, v, g, beta, state, qsl, slots, init, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_want, atol=1e-5, rtol=1e-5)


def test_strided_views_of_a_fused_projection():
    # As in the model: q, k, v are column slices of one [T, 2*Hk*K + H*V] projection,
    # and g / beta non-contiguous views.
    h, kd, vd = 2, 32, 16
    q, k, v, g, beta, state, qsl, slots, init = _case(h, h, kd, vd, torch.float32, seed=5)
    t = q.shape[0]
    fused = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qv, kv, vv = torch.split(fused, [h * kd, h * kd, h * vd], dim=1)
    gb = torch.stack([g, beta], dim=2)
    state_want = state.clone()
    want = gated_delta_rule_recurrent_ref(q, k, v, g, beta, state_want, qsl, slots, init, 0.2)
    got = gated_delta_rule_recurrent_triton(
        qv.reshape(t, h, kd), kv.reshape(t, h, kd), vv.reshape(t, h, vd), gb[..., 0], gb[..., 1],
        state, qsl.long(), slots.long(), init, 0.2,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_want, atol=1e-5, rtol=1e-5)


def test_decode_after_prefill_continues_from_the_slot():
    # Two launches (a prefill chunk, then one decode token) equal one reference pass.
    h, kd, vd = 2, 32, 32
    gen = torch.Generator().manual_seed(11)
    t = 6
    q, k = torch.randn(t, h, kd, generator=gen), torch.randn(t, h, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g, beta = -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    slots = torch.tensor([1], dtype=torch.int32)
    state_want = torch.zeros(2, h, kd, vd)
    want = gated_delta_rule_recurrent_ref(
        q, k, v, g, beta, state_want, torch.tensor([0, t]), slots, torch.tensor([False]), kd**-0.5
    )
    state = torch.full((2, h, kd, vd), float("nan"))  # garbage: the first call must not read it
    o1 = gated_delta_rule_recurrent_triton(
        q[:5], k[:5], v[:5], g[:5], beta[:5], state, torch.tensor([0, 5]), slots, torch.tensor([False]), kd**-0.5
    )
    o2 = gated_delta_rule_recurrent_triton(
        q[5:], k[5:], v[5:], g[5:], beta[5:], state, torch.tensor([0, 1]), slots, torch.tensor([True]), kd**-0.5
    )
    torch.testing.assert_close(torch.cat([o1, o2]), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], state_want[1], atol=1e-5, rtol=1e-5)


def test_bad_input_raises_clear_error():
    q, k, v, g, beta, state, qsl, slots, init = _case(4, 2, 32, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="must be float32"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, state.half(), qsl, slots, init, 1.0)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        gated_delta_rule_recurrent_triton(q[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1), v, g, beta,
                                          state, qsl, slots, init, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, state, qsl[:-1], slots, init, 1.0)
    with pytest.raises(ValueError, match=r"g must be"):
        gated_delta_rule_recurrent_triton(q, k, v, g[:, :1], beta, state, qsl, slots, init, 1.0)
