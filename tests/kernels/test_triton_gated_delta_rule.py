"""Triton gated delta rule (recurrent and chunked kernels) vs the token-by-token PyTorch
reference.

Runs under the interpreter on the CPU. Each case is one launch over a mixed batch:
multi-token prefill chunks and single decode tokens, sequences that start from zeros
(their pages NaN-filled: never read) and ones that continue from their state, the
state in scattered pages of a paged pool with padding between pages and a layer whose
items straddle pages (everything else must stay untouched), a sequence with no tokens
this step (its state must stay untouched even though it claims no initial state), and
checkpoints at positions inside runs (against the reference run to that position).

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
# Checkpoints: mid-run, at a decode, at a chunk boundary, at the last token.
CKPT = {tuple(Q_LENS): [5, 1, -1, 4, -1], tuple(CHUNKED_Q_LENS): [21, -1, -1, 16, 1]}


def _case(paged_pool, h, hk, kd, vd, dtype, seed, q_lens=Q_LENS, ckpt=False):
    gen = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, hk, kd, generator=gen).to(dtype)
    k = torch.randn(t, hk, kd, generator=gen).to(dtype)
    v = torch.randn(t, h, vd, generator=gen).to(dtype)
    # HF: g = -exp(A_log) * softplus(.) <= 0, beta = sigmoid(.) in (0, 1).
    g = (-torch.rand(t, h, generator=gen) * 2.0).to(dtype)
    beta = torch.rand(t, h, generator=gen).to(dtype)
    n = len(q_lens)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    init = torch.tensor(INIT) if n == len(INIT) else torch.arange(n) % 2 == 1
    ck = None
    if ckpt:
        ck = torch.tensor(CKPT[tuple(q_lens)], dtype=torch.int32)
    pool = paged_pool(n, h, (kd, vd), gen)
    pool.nan_fill([b for b in range(n) if not init[b] and q_lens[b]],
                  [] if ck is None else [b for b in range(n) if ck[b] >= 0])
    return q, k, v, g, beta, pool, qsl, init, ck


def _expand(x, h):
    return x.repeat_interleave(h // x.shape[1], dim=1)


def _kw(pool, ck):
    if ck is None:
        return dict(item_base=pool.item_base)
    return dict(item_base=pool.item_base, checkpoint_positions=ck, checkpoint_pages=pool.ck_table)


@pytest.mark.parametrize(
    "h,hk,kd,vd,dtype,l2,ckpt",
    [
        (2, 2, 32, 32, torch.float32, True, False),
        (3, 3, 64, 48, torch.float32, True, True),  # V not a power of two
        (4, 2, 32, 64, torch.float32, True, True),  # grouped q/k heads read without expansion
        (2, 2, 32, 32, torch.float32, False, False),
        (2, 2, 32, 32, torch.float16, True, True),
    ],
)
def test_matches_reference(paged_pool, h, hk, kd, vd, dtype, l2, ckpt):
    q, k, v, g, beta, pool, qsl, init, ck = _case(paged_pool, h, hk, kd, vd, dtype, seed=kd + vd + h, ckpt=ckpt)
    scale = kd**-0.5
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(
        _expand(q, h), _expand(k, h), v, g, beta, want_pool.pool, qsl, want_pool.table, init, scale,
        use_qk_l2norm=l2, **_kw(want_pool, ck))
    got = gated_delta_rule_recurrent_triton(q, k, v, g, beta, pool.pool, qsl, pool.table, init, scale,
                                            use_qk_l2norm=l2, **_kw(pool, ck))
    assert got.dtype == v.dtype and got.shape == v.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # The whole arena: written items (and checkpoints) match, everything else untouched.
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    "h,hk,kd,vd,dtype,l2,chunk,ckpt",
    [
        (2, 2, 32, 32, torch.float32, True, 16, True),
        (4, 2, 8, 12, torch.float32, True, 32, True),  # K, V below 16: padded for tl.dot; grouped heads
        (2, 2, 16, 16, torch.float32, False, 16, False),
        (2, 2, 16, 16, torch.float16, True, 16, True),
    ],
)
def test_chunked_matches_reference(paged_pool, h, hk, kd, vd, dtype, l2, chunk, ckpt):
    # The oracle is the token-by-token reference: the chunked kernel must agree with the
    # recurrence itself, not just with another chunked formulation.
    q, k, v, g, beta, pool, qsl, init, ck = _case(paged_pool, h, hk, kd, vd, dtype, seed=kd + chunk,
                                                  q_lens=CHUNKED_Q_LENS, ckpt=ckpt)
    scale = kd**-0.5
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(
        _expand(q, h), _expand(k, h), v, g, beta, want_pool.pool, qsl, want_pool.table, init, scale,
        use_qk_l2norm=l2, **_kw(want_pool, ck))
    got = gated_delta_rule_chunked_triton(
        q, k, v, g, beta, pool.pool, qsl, pool.table, init, scale, use_qk_l2norm=l2, chunk_size=chunk,
        **_kw(pool, ck))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("q_lens", [Q_LENS, CHUNKED_Q_LENS, [20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
def test_per_sequence_choice_matches_reference(paged_pool, q_lens):
    # Q_LENS: T < 16, one recurrent launch. CHUNKED_Q_LENS: 40 and 16 tokens go to the
    # chunked kernel, 1 and 3 to the recurrent one, in the same call. The last: T <= B,
    # one recurrent launch even for the 20-token sequence.
    ckpt = tuple(q_lens) in CKPT
    q, k, v, g, beta, pool, qsl, init, ck = _case(paged_pool, 2, 2, 16, 16, torch.float32, seed=9, q_lens=q_lens,
                                                  ckpt=ckpt)
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(q, k, v, g, beta, want_pool.pool, qsl, want_pool.table, init, 0.25,
                                          **_kw(want_pool, ck))
    got = gated_delta_rule_triton(q, k, v, g, beta, pool.pool, qsl, pool.table, init, 0.25, **_kw(pool, ck))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_checkpoint_equals_the_reference_run_to_its_position(paged_pool, kernel):
    """The checkpoint the kernel writes at k is the state the reference leaves after the
    run's first k tokens alone (a separate call), for k inside a chunk, at a chunk
    boundary and at the first token."""
    q, k, v, g, beta, pool, qsl, init, ck = _case(paged_pool, 2, 2, 16, 16, torch.float32, seed=4,
                                                  q_lens=CHUNKED_Q_LENS, ckpt=True)
    fn = gated_delta_rule_recurrent_triton if kernel == "recurrent" else gated_delta_rule_chunked_triton
    got = pool.clone()
    fn(q, k, v, g, beta, got.pool, qsl, got.table, init, 0.25, **_kw(got, ck))
    for b, n in enumerate(CHUNKED_Q_LENS):
        if ck[b] < 0:
            continue
        s, kk = int(qsl[b]), int(ck[b])
        prefix = pool.clone()
        gated_delta_rule_recurrent_ref(q[s:s + kk], k[s:s + kk], v[s:s + kk], g[s:s + kk], beta[s:s + kk],
                                       prefix.pool, torch.tensor([0, kk]), prefix.table[b:b + 1], init[b:b + 1],
                                       0.25, item_base=pool.item_base)
        torch.testing.assert_close(got.items(b, checkpoint=True), prefix.items(b), atol=1e-5, rtol=1e-5)


def test_strided_views_of_a_fused_projection(paged_pool):
    # As in the model: q, k, v are column slices of one [T, 2*Hk*K + H*V] projection,
    # and g / beta non-contiguous views.
    h, kd, vd = 2, 32, 16
    q, k, v, g, beta, pool, qsl, init, _ = _case(paged_pool, h, h, kd, vd, torch.float32, seed=5)
    t = q.shape[0]
    fused = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qv, kv, vv = torch.split(fused, [h * kd, h * kd, h * vd], dim=1)
    gb = torch.stack([g, beta], dim=2)
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(q, k, v, g, beta, want_pool.pool, qsl, want_pool.table, init, 0.2,
                                          item_base=pool.item_base)
    got = gated_delta_rule_recurrent_triton(
        qv.reshape(t, h, kd), kv.reshape(t, h, kd), vv.reshape(t, h, vd), gb[..., 0], gb[..., 1],
        pool.pool, qsl.long(), pool.table.long(), init, 0.2, item_base=pool.item_base,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_decode_after_prefill_continues_from_the_state_pages(paged_pool):
    # Two launches (a prefill chunk, then one decode token) equal one reference pass.
    h, kd, vd = 2, 32, 32
    gen = torch.Generator().manual_seed(11)
    t = 6
    q, k = torch.randn(t, h, kd, generator=gen), torch.randn(t, h, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g, beta = -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    pool = paged_pool(1, h, (kd, vd), gen)
    pool.nan_fill([0])  # garbage: the first call must not read it
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(
        q, k, v, g, beta, want_pool.pool, torch.tensor([0, t]), want_pool.table, torch.tensor([False]), kd**-0.5,
        item_base=2)
    o1 = gated_delta_rule_recurrent_triton(
        q[:5], k[:5], v[:5], g[:5], beta[:5], pool.pool, torch.tensor([0, 5]), pool.table, torch.tensor([False]),
        kd**-0.5, item_base=2)
    o2 = gated_delta_rule_recurrent_triton(
        q[5:], k[5:], v[5:], g[5:], beta[5:], pool.pool, torch.tensor([0, 1]), pool.table, torch.tensor([True]),
        kd**-0.5, item_base=2)
    torch.testing.assert_close(torch.cat([o1, o2]), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.items(0), want_pool.items(0), atol=1e-5, rtol=1e-5)


def test_bad_input_raises_clear_error(paged_pool):
    q, k, v, g, beta, pool, qsl, init, _ = _case(paged_pool, 4, 2, 32, 32, torch.float32, seed=0)
    st, tab = pool.pool, pool.table
    with pytest.raises(ValueError, match="must be float32"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, st.half(), qsl, tab, init, 1.0, item_base=2)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        gated_delta_rule_recurrent_triton(q[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1), v, g, beta,
                                          st, qsl, tab, init, 1.0, item_base=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, st, qsl[:-1], tab, init, 1.0, item_base=2)
    with pytest.raises(ValueError, match=r"g must be"):
        gated_delta_rule_recurrent_triton(q, k, v, g[:, :1], beta, st, qsl, tab, init, 1.0, item_base=2)
    with pytest.raises(ValueError, match="more columns"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, st, qsl, tab, init, 1.0, item_base=3 * tab.shape[1])
    with pytest.raises(ValueError, match="both checkpoint_positions and checkpoint_pages"):
        gated_delta_rule_recurrent_triton(q, k, v, g, beta, st, qsl, tab, init, 1.0, item_base=2,
                                          checkpoint_positions=torch.full((5,), -1))


@pytest.mark.parametrize("kernel,q_lens,ro_dtype", [
    ("recurrent", Q_LENS, torch.bool),
    ("chunked", CHUNKED_Q_LENS, torch.int8),
    ("either", CHUNKED_Q_LENS, torch.bool),  # the 40- and 16-token runs chunked, the rest recurrent
])
def test_read_only_runs_compute_the_same_and_leave_their_state(paged_pool, kernel, q_lens, ro_dtype):
    """Speculative verify runs (``read_only``): outputs and checkpoints are the
    reference's, their state items stay as they were, the other runs' state advances
    as the reference's; nothing else in the arena changes."""
    q, k, v, g, beta, pool, qsl, init, ck = _case(paged_pool, 4, 2, 16, 16, torch.float32, seed=31,
                                                  q_lens=q_lens, ckpt=True)
    ro = torch.tensor([True, False, True, True, False])
    before = pool.clone()
    want_pool = pool.clone()
    want = gated_delta_rule_recurrent_ref(_expand(q, 4), _expand(k, 4), v, g, beta, want_pool.pool, qsl,
                                          want_pool.table, init, 0.25, **_kw(want_pool, ck))
    # The read-only runs with tokens have a state to leave unwritten (the reference moves it).
    ro_runs = [b for b in ro.nonzero().flatten().tolist() if q_lens[b]]
    assert ro_runs and all(not torch.equal(want_pool.items(b), before.items(b)) for b in ro_runs)
    for b in ro_runs:
        want_pool.set_items(b, before.items(b))
    fn = {"recurrent": gated_delta_rule_recurrent_triton, "chunked": gated_delta_rule_chunked_triton,
          "either": gated_delta_rule_triton}[kernel]
    got = fn(q, k, v, g, beta, pool.pool, qsl, pool.table, init, 0.25, read_only=ro.to(ro_dtype), **_kw(pool, ck))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_read_only_must_be_one_flag_per_sequence(paged_pool):
    q, k, v, g, beta, pool, qsl, init, _ = _case(paged_pool, 2, 2, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="read_only must be a bool or int8"):
        gated_delta_rule_triton(q, k, v, g, beta, pool.pool, qsl, pool.table, init, 0.25,
                                item_base=pool.item_base, read_only=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="read_only must be a bool or int8"):
        gated_delta_rule_triton(q, k, v, g, beta, pool.pool, qsl, pool.table, init, 0.25,
                                item_base=pool.item_base, read_only=torch.ones(5, dtype=torch.float32))
