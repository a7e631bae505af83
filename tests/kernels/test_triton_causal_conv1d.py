"""Triton causal conv1d vs the PyTorch reference (interpreter, CPU).

Both paths (serial per sequence; token-parallel plus a state-update launch), each
over a mixed batch: a prefill longer than the window, a decode
token continuing from its state, a prefill shorter than the window continuing from
its state (the new state mixes old state and new inputs), a sequence with no tokens
(its slot must stay untouched) and a fresh single token; slots shuffled in a pool
with spare slots. Tolerances: float32 ``atol = rtol = 1e-5`` (same products, summed
in a different order); float16 input/state ``2e-3`` on ``y`` (one rounding), the new
state is a copy of inputs and is compared exactly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.causal_conv1d import causal_conv1d_ref
from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_triton

Q_LENS = [40, 1, 2, 0, 1]  # 40: two 32-token blocks in the token-parallel path
INIT = [False, True, True, False, False]
SLOTS = [4, 0, 2, 5, 1]


def _case(c, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(Q_LENS)
    x = torch.randn(t, c, generator=gen).to(dtype)
    weight = torch.randn(c, width, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype)
    state = torch.randn(7, c, width - 1, generator=gen).to(dtype)
    qsl = torch.tensor([0] + Q_LENS).cumsum(0).to(torch.int32)
    return x, weight, bias, state, qsl, torch.tensor(SLOTS), torch.tensor(INIT)


@pytest.mark.parametrize("token_parallel", [False, True])
@pytest.mark.parametrize(
    "c,width,dtype,use_bias,activation",
    [
        (96, 4, torch.float32, False, "silu"),  # C not a power of two
        (300, 4, torch.float32, True, "silu"),  # two channel blocks
        (64, 3, torch.float32, True, None),
        (64, 2, torch.float32, False, "silu"),
        (64, 4, torch.float16, False, "silu"),
    ],
)
def test_matches_reference(c, width, dtype, use_bias, activation, token_parallel):
    x, weight, bias, state, qsl, slots, init = _case(c, width, dtype, seed=c + width)
    bias = bias if use_bias else None
    state_want = state.clone()
    want = causal_conv1d_ref(x, weight, bias, state_want, qsl, slots, init, activation)
    got = causal_conv1d_triton(x, weight, bias, state, qsl, slots, init, activation, token_parallel=token_parallel)
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(state, state_want)


@pytest.mark.parametrize("token_parallel", [False, True])
def test_strided_input_and_weight_view(token_parallel):
    # As in the model: x a column slice of a projection, weight HF's [C, 1, W][:, 0, :].
    x, weight, _, state, qsl, slots, init = _case(64, 4, torch.float32, seed=2)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)
    w3 = weight[:, None, :].clone()
    state_want = state.clone()
    want = causal_conv1d_ref(x, weight, None, state_want, qsl, slots, init)
    got = causal_conv1d_triton(wide[:, :64], w3[:, 0, :], None, state, qsl.long(), slots, init, token_parallel=token_parallel)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, state_want)


def test_bad_input_raises_clear_error():
    x, weight, bias, state, qsl, slots, init = _case(64, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="unsupported activation"):
        causal_conv1d_triton(x, weight, bias, state, qsl, slots, init, "gelu")
    with pytest.raises(ValueError, match=r"conv_state must be"):
        causal_conv1d_triton(x, weight, bias, state[:, :, :2], qsl, slots, init)
    with pytest.raises(ValueError, match="conv width 5"):
        causal_conv1d_triton(x, torch.randn(64, 5), bias, torch.zeros(7, 64, 4), qsl, slots, init)
