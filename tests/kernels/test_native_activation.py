"""The fused SwiGLU activation (``native.silu_mul``) against torch's own ops, the
oracle: ``F.silu(gate) * up`` in float32, and for bfloat16 torch's ``silu_`` then
``mul_`` on bfloat16 tensors (HF's ``act_fn(gate_proj(x)) * up_proj(x)``), which round
the activation and then the product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import native
from hybridserve.model.qwen3_5 import MLP

pytestmark = pytest.mark.skipif(not native.available(), reason="built without hybridserve._core.kernels")


@pytest.mark.parametrize("t,inter", [(1, 8), (3, 37), (16, 768), (70, 200)])
def test_silu_mul_float32_matches_torch(t, inter):
    g = torch.Generator().manual_seed(t * 100 + inter)
    gu = torch.randn(t, 2 * inter, generator=g) * 4
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    up = gu[:, inter:].clone()
    got = native.silu_mul(gu, inter)
    assert got.data_ptr() == gu.data_ptr() and got.shape == (t, inter)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(gu[:, inter:], up)  # the up half is left as it was


@pytest.mark.parametrize("t,inter", [(1, 64), (16, 3072), (33, 100)])
def test_silu_mul_bfloat16_rounds_like_torchs_two_ops(t, inter):
    g = torch.Generator().manual_seed(t + inter)
    gu = (torch.randn(t, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    ref = gu.clone()
    want = F.silu(ref[:, :inter], inplace=True).mul_(ref[:, inter:])
    got = native.silu_mul(gu, inter)
    assert got.dtype == torch.bfloat16
    # Bit-equal but where torch's and the kernel's float32 exp differ in the last bit
    # across a bfloat16 rounding boundary: one bfloat16 step (2^-7 relative) then.
    step = want.float().abs() * 2.0 ** -7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


def test_silu_mul_rejects_a_strided_or_short_input():
    gu = torch.zeros(4, 20)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.silu_mul(gu[:, :16], 8)
    with pytest.raises(ValueError, match="row stride"):
        native.silu_mul(gu, 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_runs_the_fused_activation_and_matches_torchs_ops(monkeypatch, dtype):
    torch.manual_seed(0)
    mlp = MLP(64, 96).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    gu = F.linear(x, mlp.gate_up_proj.weight)
    want = F.linear(F.silu(gu[:, :96]) * gu[:, 96:], mlp.down_proj.weight)
    calls = []
    real = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda *a: calls.append(1) or real(*a))
    got = mlp(x)
    assert calls, "the MLP did not take the native activation"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
