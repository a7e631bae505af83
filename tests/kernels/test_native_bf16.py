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


@pytest.mark.parametrize("vd", [8, 32])
def test_deltanet_mixer_on_bf16_inputs_matches_hf_bf16_math(vd):
    """ops.gated_delta_net_mixer with bfloat16 q/k/v/a/b/z and parameters, read in place
    by the native kernel over a float32 state: against HF's bfloat16 Gated DeltaNet
    math (``b.sigmoid()`` in bfloat16, ``g`` in float32, the reference recurrence in
    float32 on the bfloat16 values, its output rounded to bfloat16, then
    ``Qwen3_5RMSNormGated``'s rounding points), the state advanced in float32 in place.
    vd 8: the portable task; 32: the AVX2 one."""
    from hybridserve.kernels import ops

    g = torch.Generator().manual_seed(3 + vd)
    hk, h, kd = 2, 4, 16
    lens = [1, 5, 1]
    t = sum(lens)
    qsl = torch.tensor([0, 1, 6, 7])
    b_ = len(lens)
    # q/k/v/z as column ranges of one wider bfloat16 buffer, as the model passes them.
    wide = torch.randn(t, 2 * hk * kd + 2 * h * vd + 2 * h + 3, generator=g).to(BF16)
    q, k, v, z, a, bb, _ = torch.split(wide, [hk * kd, hk * kd, h * vd, h * vd, h, h, 3], dim=-1)
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

    f = lambda x: x.float()  # noqa: E731
    beta = f(torch.sigmoid(bb))  # HF: b.sigmoid() on the bfloat16 projection
    gg = -f(a_log).exp() * torch.nn.functional.softplus(f(a) + f(dt_bias))
    ref_state = before.clone()
    rep = h // hk
    o = gated_delta_rule_recurrent_ref(
        f(q).view(t, hk, kd).repeat_interleave(rep, 1), f(k).view(t, hk, kd).repeat_interleave(rep, 1),
        f(v).view(t, h, vd), gg, beta, ref_state, qsl, pages, init, kd ** -0.5, True, item_base=0)
    o = o.to(BF16).float()  # core_attn_out.to(initial_dtype)
    x = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)
    ref = ((norm_w * x).float() * torch.nn.functional.silu(f(z).view(t, h, vd))).reshape(t, h * vd)
    assert torch.allclose(state, ref_state, atol=1e-4, rtol=1e-4)
    assert not torch.equal(state, before)
    # Equal to HF's rounding but where float32 noise moved a value across a bfloat16
    # rounding boundary on the way (a step or two there).
    assert (out == ref.to(BF16)).float().mean() > 0.9
    assert ((out.float() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-4 * ref.abs().max()).all()


@pytest.mark.parametrize("seed", range(4))
def test_conv1d_bf16_matches_the_reference_on_bf16_values(seed, paged_pool):
    """Mixed batch (decodes, chunks, empty runs, fresh and continued sequences,
    checkpoints), bfloat16 pool pages scattered: outputs within one bfloat16 rounding of
    the float32 reference on the same values, the state and checkpoints bit-equal."""
    from hybridserve.kernels.causal_conv1d import causal_conv1d_ref

    gen = torch.Generator().manual_seed(seed)
    lens = [[1, 1, 0, 17, 2], [5, 1, 64, 1], [1] * 6, [130, 3, 1]][seed]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    init = torch.rand(len(lens), generator=gen) < 0.6
    ck = torch.tensor([int(torch.randint(1, m + 1, (1,), generator=gen)) if m and seed % 2 else -1 for m in lens])
    c, w = [(24, 4), (300, 4), (40, 3), (64, 5)][seed]
    t = sum(lens)
    x = torch.randn(t, c + 7, generator=gen).to(BF16)[:, 3:3 + c]
    weight = torch.randn(c, w, generator=gen).to(BF16)
    bias = torch.randn(c, generator=gen).to(BF16) if seed % 2 else None
    got = paged_pool(len(lens), 1, (c, w - 1), gen, per_page=2, item_base=3, dtype=BF16)
    want = got.clone()
    want.buf = want.buf.float()
    kw = dict(checkpoint_positions=ck, checkpoint_pages=got.ck_table)
    for _ in range(2):  # the second call continues from the first one's state
        y_want = causal_conv1d_ref(x.float(), weight.float(), None if bias is None else bias.float(), want.pool,
                                   qsl, want.table, init, "silu", item_base=3, **kw)
        y_got = native.causal_conv1d_bf16(x, weight, bias, got.pool, native.Varlen(qsl, got.table, init, **kw),
                                          "silu", item_base=3)
        assert y_got.dtype == BF16
        assert ((y_got.float() - y_want).abs() <= 2 ** -8 * y_want.abs() + 1e-6).all()
        assert torch.equal(got.buf.float(), want.buf)
        init = torch.ones_like(init)


def test_bf16_model_ops_dispatch_conv1d_natively(monkeypatch):
    """ops.causal_conv1d sends bfloat16 CPU tensors to the native bfloat16 kernel."""
    from hybridserve.kernels import ops

    seen = []
    monkeypatch.setattr(native, "causal_conv1d_bf16", lambda *a, **kw: seen.append(1) or a[0])
    x = torch.zeros(2, 8, dtype=BF16)
    ops.causal_conv1d(x, torch.zeros(8, 4, dtype=BF16), None, torch.zeros(2, 1, 8, 3, dtype=BF16),
                      torch.tensor([0, 2]), torch.tensor([[0]]), torch.tensor([False]), item_base=0)
    assert seen == [1]


@pytest.mark.parametrize("centered", [True, False])
def test_rms_norm_bf16_matches_hf_style_rounding(centered):
    """residual + x as a bfloat16 add (in place), the norm in float32 from it, one
    rounding at the end: HF's ``Qwen3_5RMSNorm`` on bfloat16 tensors."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 96, generator=g).to(BF16)
    res = torch.randn(37, 96, generator=g).to(BF16)
    w = (0.1 * torch.randn(96, generator=g)).to(BF16)
    s = res + x  # torch's bfloat16 add: the residual stream HF carries
    sf = s.float()
    ref = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1.0 if centered else 0.0) + w.float())
    r = res.clone()
    got = native.rms_norm_bf16(x, w, 1e-6, residual=r, centered=centered)
    assert torch.equal(r, s)
    assert ((got.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()
    plain = native.rms_norm_bf16(s, w, 1e-6, centered=centered)
    assert torch.equal(plain, got)


@pytest.mark.parametrize("seed", range(3))
def test_attention_bf16_decodes_native_and_the_rest_grouped_match_reference(seed, monkeypatch):
    """A mixed step over a bfloat16 cache in arena pages: decodes through the native
    bfloat16 kernel, the rest through SDPA groups in bfloat16; against the reference in float32 on
    the same bfloat16 values, within one bfloat16 rounding of the output."""
    from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu, paged_attention_ref

    gen = torch.Generator().manual_seed(190 + seed)
    hq, hkv, d, bs = [(4, 2, 16, 4), (8, 2, 64, 16), (6, 1, 32, 8)][seed]
    q_lens = [1, 3, 1, 1, 7, 1][: 4 + seed]
    seq_lens = [ql + int(torch.randint(0, 70, (1,), generator=gen)) for ql in q_lens]
    n = len(q_lens)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-s // bs) for s in seq_lens) + 2
    tables = torch.zeros(n, width, dtype=torch.int32)
    at = 0
    for i, s in enumerate(seq_lens):
        nb = -(-s // bs)
        tables[i, :nb] = torch.tensor(perm[at:at + nb], dtype=torch.int32)
        at += nb
    blk = bs * hkv * d
    page = 4 * blk + 16
    arena = torch.randn(num_blocks * page, generator=gen).to(BF16)
    k_cache = arena.as_strided((num_blocks, bs, hkv, d), (page, hkv * d, d, 1), 2 * blk)
    v_cache = arena.as_strided((num_blocks, bs, hkv, d), (page, hkv * d, d, 1), 3 * blk)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen).to(BF16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), qsl, lens, tables, d ** -0.5)
    plan = AttentionPlan(qsl, lens, tables, bs, split_decodes=True)
    assert plan.decode is not None and len(plan.decode[0]) == q_lens.count(1)
    # The groups' SDPA runs on the gathered bfloat16 blocks, not on float32 copies.
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*a, **kw):
        seen.append({t.dtype for t in a[:3]})
        return sdpa(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = paged_attention_cpu(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5, plan)
    assert seen and all(s == {BF16} for s in seen)
    assert got.dtype == BF16
    assert ((got.float() - want).abs() <= 2 ** -8 * want.abs() + 1e-3 * want.abs().max()).all()


def test_qk_norm_rope_bf16_matches_float32_math_on_the_bf16_values():
    """Per-head zero-centred RMSNorm then half-split rotary on the first channels, heads
    a stride apart in the row (the query's gate between them), as the model calls it."""
    from hybridserve.model.qwen3_5 import RotaryEmbedding

    g = torch.Generator().manual_seed(5)
    t, heads, d, r = 7, 4, 32, 8
    qkv = torch.randn(t, heads * 2 * d + 5, generator=g).to(BF16)
    x = qkv[:, : heads * 2 * d]
    w = (0.1 * torch.randn(d, generator=g)).to(BF16)
    ang = torch.randn(t, r // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos().to(BF16), torch.cat([ang, ang], -1).sin().to(BF16)
    got = native.qk_norm_rope(x, heads, 2 * d, w, 1e-6, cos, sin)
    assert got.dtype == BF16 and got.shape == (t, heads, d)
    xf = x.float().view(t, heads, 2 * d)[..., :d]
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
    ref = RotaryEmbedding.apply(y, cos.float(), sin.float())
    scale = y.abs().amax(-1, keepdim=True)  # rope mixes two channels: error relative to the head's scale
    assert ((got.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * scale).all()
