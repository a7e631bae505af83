"""Triton causal conv1d vs the PyTorch reference (interpreter, CPU).

Both paths (serial per sequence; token-parallel plus a state-update launch), each
over a mixed batch: a prefill longer than the window, a decode token continuing from
its state, a prefill shorter than the window continuing from its state (the new state
mixes old state and new inputs), a sequence with no tokens (its state must stay
untouched) and a fresh single token; the state in scattered pages of a paged pool
(fresh pages NaN-filled, padding between pages, everything else compared untouched);
checkpoints inside runs, including one that reaches back into the old state.
Tolerances: float32 ``atol = rtol = 1e-5`` (same products, summed in a different
order); float16 input/state ``2e-3`` on ``y`` (one rounding), the new state is a copy
of inputs and is compared exactly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.causal_conv1d import causal_conv1d_ref
from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_triton

Q_LENS = [40, 1, 2, 0, 1]  # 40: two 32-token blocks in the token-parallel path
INIT = [False, True, True, False, False]
# Checkpoints: mid-prefill, at a decode token, after 1 of 2 tokens (reads the old state).
CKPT = [33, 1, 1, -1, -1]


def _case(paged_pool, c, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(Q_LENS)
    x = torch.randn(t, c, generator=gen).to(dtype)
    weight = torch.randn(c, width, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype)
    pool = paged_pool(len(Q_LENS), 1, (c, width - 1), gen, per_page=2, item_base=3, dtype=dtype)
    pool.nan_fill([0, 4], [b for b, k in enumerate(CKPT) if k >= 0])
    qsl = torch.tensor([0] + Q_LENS).cumsum(0).to(torch.int32)
    return x, weight, bias, pool, qsl, torch.tensor(INIT), torch.tensor(CKPT, dtype=torch.int32)


@pytest.mark.parametrize("token_parallel", [False, True])
@pytest.mark.parametrize(
    "c,width,dtype,use_bias,activation,ckpt",
    [
        (96, 4, torch.float32, False, "silu", True),  # C not a power of two
        (300, 4, torch.float32, True, "silu", False),  # two channel blocks
        (64, 3, torch.float32, True, None, True),
        (64, 2, torch.float32, False, "silu", True),
        (64, 4, torch.float16, False, "silu", True),
    ],
)
def test_matches_reference(paged_pool, c, width, dtype, use_bias, activation, ckpt, token_parallel):
    x, weight, bias, pool, qsl, init, ck = _case(paged_pool, c, width, dtype, seed=c + width)
    bias = bias if use_bias else None
    kw = dict(item_base=3)
    if ckpt:
        kw.update(checkpoint_positions=ck, checkpoint_pages=pool.ck_table)
    want_pool = pool.clone()
    want = causal_conv1d_ref(x, weight, bias, want_pool.pool, qsl, want_pool.table, init, activation, **kw)
    got = causal_conv1d_triton(x, weight, bias, pool.pool, qsl, pool.table, init, activation,
                               token_parallel=token_parallel, **kw)
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("token_parallel", [False, True])
def test_checkpoint_equals_feeding_the_first_k_tokens(paged_pool, token_parallel):
    x, weight, bias, pool, qsl, init, ck = _case(paged_pool, 64, 4, torch.float32, seed=8)
    got = pool.clone()
    causal_conv1d_triton(x, weight, bias, got.pool, qsl, got.table, init, token_parallel=token_parallel,
                         item_base=3, checkpoint_positions=ck, checkpoint_pages=got.ck_table)
    for b, k in enumerate(CKPT):
        if k < 0:
            continue
        s = int(qsl[b])
        prefix = pool.clone()
        causal_conv1d_ref(x[s:s + k], weight, bias, prefix.pool, torch.tensor([0, k]), prefix.table[b:b + 1],
                          init[b:b + 1], item_base=3)
        torch.testing.assert_close(got.items(b, checkpoint=True), prefix.items(b))


@pytest.mark.parametrize("token_parallel", [False, True])
def test_strided_input_and_weight_view(paged_pool, token_parallel):
    # As in the model: x a column slice of a projection, weight HF's [C, 1, W][:, 0, :].
    x, weight, _, pool, qsl, init, _ = _case(paged_pool, 64, 4, torch.float32, seed=2)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)
    w3 = weight[:, None, :].clone()
    want_pool = pool.clone()
    want = causal_conv1d_ref(x, weight, None, want_pool.pool, qsl, want_pool.table, init, item_base=3)
    got = causal_conv1d_triton(wide[:, :64], w3[:, 0, :], None, pool.pool, qsl.long(), pool.table.long(), init,
                               token_parallel=token_parallel, item_base=3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=0, rtol=0, equal_nan=True)


def test_bad_input_raises_clear_error(paged_pool):
    x, weight, bias, pool, qsl, init, _ = _case(paged_pool, 64, 4, torch.float32, seed=3)
    st, tab = pool.pool, pool.table
    with pytest.raises(ValueError, match="unsupported activation"):
        causal_conv1d_triton(x, weight, bias, st, qsl, tab, init, "gelu", item_base=3)
    with pytest.raises(ValueError, match=r"conv_state must be"):
        causal_conv1d_triton(x, weight, bias, st[:, :, :, :2], qsl, tab, init, item_base=3)
    with pytest.raises(ValueError, match="conv width 5"):
        causal_conv1d_triton(x, torch.randn(64, 5), bias, torch.zeros(7, 1, 64, 4), qsl, tab, init, item_base=3)
    with pytest.raises(ValueError, match="more columns"):
        causal_conv1d_triton(x, weight, bias, st, qsl, tab, init, item_base=2 * tab.shape[1])


@pytest.mark.parametrize("token_parallel", [False, True])
@pytest.mark.parametrize("ro_dtype", [torch.bool, torch.int8])
def test_read_only_runs_compute_the_same_and_leave_their_state(paged_pool, token_parallel, ro_dtype):
    """Speculative verify runs (``read_only``): outputs and checkpoints are the
    reference's, their state item stays as it was, the other runs' state advances as the
    reference's; nothing else in the arena changes."""
    x, weight, bias, pool, qsl, init, ck = _case(paged_pool, 96, 4, torch.float32, seed=17)
    ro = torch.tensor([False, True, True, False, True])
    kw = dict(item_base=3, checkpoint_positions=ck, checkpoint_pages=pool.ck_table)
    before = pool.clone()
    want_pool = pool.clone()
    want = causal_conv1d_ref(x, weight, bias, want_pool.pool, qsl, want_pool.table, init, "silu", **kw)
    # The read-only runs with tokens have a state to leave unwritten (the reference moves it).
    ro_runs = [b for b in ro.nonzero().flatten().tolist() if Q_LENS[b]]
    assert ro_runs and all(not torch.equal(want_pool.items(b), before.items(b)) for b in ro_runs)
    for b in ro_runs:
        want_pool.set_items(b, before.items(b))
    got = causal_conv1d_triton(x, weight, bias, pool.pool, qsl, pool.table, init, "silu",
                               token_parallel=token_parallel, read_only=ro.to(ro_dtype), **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.buf, want_pool.buf, atol=0, rtol=0, equal_nan=True)


def test_read_only_must_be_one_flag_per_sequence(paged_pool):
    x, weight, bias, pool, qsl, init, _ = _case(paged_pool, 64, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="read_only must be a bool or int8"):
        causal_conv1d_triton(x, weight, bias, pool.pool, qsl, pool.table, init, item_base=3,
                             read_only=torch.zeros(4, dtype=torch.bool))
