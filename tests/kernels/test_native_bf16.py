"""The bfloat16 native kernels against plain-PyTorch float32 math on the same
bfloat16-rounded values (the oracle): the few-row GEMM, and the DeltaNet mixer on
bfloat16 activations over the float32 recurrent state."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import native
from hybridserve.kernels.gated_delta_rule import gated_delta_rule_recurrent_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="built without hybridserve._core.kernels")
BF16 = torch.bfloat16


@pytest.mark.parametrize("m,k,n", [(1, 64, 40), (2, 100, 33), (5, 768, 130), (32, 1031, 97)])
def test_linear_bf16_matches_float32_math_on_the_bf16_values(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k)
    # x as a column range of a wider buffer (row stride k + 7), as the model passes it.
    wide = torch.randn(m, k + 7, generator=g).to(BF16)
    x = wide[:, 3:3 + k]
    w = torch.randn(n, k, generator=g).to(BF16)
    ref = x.float() @ w.float().T
    got32 = native.linear_bf16(x, w, out_dtype=torch.float32)
    assert got32.dtype == torch.float32
    # float32 sums of k exact products, in another order: a few float32 ulps of the scale.
    assert torch.allclose(got32, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    got = native.linear_bf16(x, w)
    assert got.dtype == BF16
    # Rounded once to bfloat16: equal to the rounded reference but where the float32
    # sums straddle a rounding boundary (one bfloat16 step then).
    step = (ref.abs() * 2.0 ** -7).clamp(min=1e-30)
    assert ((got.float() - ref).abs() <= step).all()
    assert (got == ref.to(BF16)).float().mean() > 0.97


def test_linear_bf16_wrong_weight_shape_is_a_clear_error():
    x = torch.zeros(2, 8, dtype=BF16)
    with pytest.raises(ValueError, match="K=8"):
        native.linear_bf16(x, torch.zeros(4, 9, dtype=BF16))


def test_bf16_isa_is_the_best_this_cpu_has():
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if " avx512_bf16" in flags and " avx512bw" in flags:
        assert native.bf16_isa() == "avx512_bf16"
    else:
        assert native.bf16_isa() in ("avx2", "scalar")


def test_deltanet_mixer_on_bf16_activations_matches_the_float32_reference():
    """ops.gated_delta_net_mixer with bfloat16 q/k/v/a/b/z over a float32 state: gates,
    delta rule (reference) and gated output norm in float32 on the same bfloat16 values,
    the state advanced in float32 in place."""
    from hybridserve.kernels import ops

    g = torch.Generator().manual_seed(3)
    hk, h, kd, vd = 2, 4, 16, 8
    lens = [1, 5, 1]
    t = sum(lens)
    qsl = torch.tensor([0, 1, 6, 7])
    b_ = len(lens)
    q = torch.randn(t, hk * kd, generator=g).to(BF16)
    k = torch.randn(t, hk * kd, generator=g).to(BF16)
    v = torch.randn(t, h * vd, generator=g).to(BF16)
    a = torch.randn(t, h, generator=g).to(BF16)
    bb = torch.randn(t, h, generator=g).to(BF16)
    z = torch.randn(t, h * vd, generator=g).to(BF16)
    a_log = torch.randn(h, generator=g).to(BF16)
    dt_bias = torch.randn(h, generator=g).to(BF16)
    norm_w = (1 + 0.1 * torch.randn(vd, generator=g)).to(BF16)
    # One item per page, sequence b's heads on pages 4b..4b+3, a pool of 16 pages.
    state = torch.randn(16, 1, kd, vd, generator=g)
    pages = torch.arange(b_ * h).view(b_, h) + 1
    init = torch.tensor([True, False, True])
    before = state.clone()
    out = ops.gated_delta_net_mixer(q, k, v, a, bb, a_log, dt_bias, z, norm_w, 1e-6, state, qsl, pages, init,
                                    kd ** -0.5, key_heads=hk, value_heads=h, item_base=0)
    assert out is not None and out.dtype == BF16

    # The oracle: float32 math on the bfloat16 values (gates as Gated DeltaNet forms
    # them, the reference recurrence, the gated RMSNorm of the output).
    f = lambda x: x.float()  # noqa: E731
    beta = torch.sigmoid(f(bb))
    gg = -f(a_log).exp() * torch.nn.functional.softplus(f(a) + f(dt_bias))
    ref_state = before.clone()
    rep = h // hk
    o = gated_delta_rule_recurrent_ref(
        f(q).view(t, hk, kd).repeat_interleave(rep, 1), f(k).view(t, hk, kd).repeat_interleave(rep, 1),
        f(v).view(t, h, vd), gg, beta, ref_state, qsl, pages, init, kd ** -0.5, True, item_base=0)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * f(norm_w)
    ref = (o * torch.nn.functional.silu(f(z).view(t, h, vd))).reshape(t, h * vd)
    assert torch.allclose(state, ref_state, atol=1e-4, rtol=1e-4)
    assert not torch.equal(state, before)
    # Rounded once to bfloat16 (a relative step of 2^-8), plus float32 noise.
    assert ((out.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-4 * ref.abs().max()).all()
