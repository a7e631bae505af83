"""The native CPU kernels (``hybridserve._core.kernels`` via ``hybridserve.kernels.native``)
against the plain-PyTorch references, on random mixed batches: whole prompts, chunks
continuing from a state, decodes and empty runs in one call, state in scattered pages of
a paged pool (fresh pages NaN-filled), checkpoints inside runs, inputs that are column
ranges of a wider buffer (as the model passes them), KV caches a page apart."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import native
from hybridserve.kernels.causal_conv1d import causal_conv1d_ref
from hybridserve.kernels.gated_delta_rule import gated_delta_rule_recurrent_ref
from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu, paged_attention_ref

PICK = [0, 1, 1, 1, 2, 3, 5, 16, 17, 40, 64, 65, 130]


def _batch(gen, n_max=10):
    n = int(torch.randint(2, n_max, (1,), generator=gen))
    lens = [PICK[i] for i in torch.randint(len(PICK), (n,), generator=gen).tolist()]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    init = torch.rand(n, generator=gen) < 0.6
    ck = torch.tensor([int(torch.randint(1, m + 1, (1,), generator=gen)) if m and bool(torch.rand(1, generator=gen) < 0.5)
                       else -1 for m in lens], dtype=torch.int32)
    return lens, qsl, init, ck


def _fresh(init, ck):
    return [b for b in range(len(init)) if not init[b]], [b for b in range(len(ck)) if ck[b] >= 0]


def _wide(t, cols, gen, extra=7):
    """A [t, cols] column range in the middle of a wider buffer."""
    buf = torch.randn(t, cols + extra, generator=gen)
    return buf[:, 3:3 + cols]


@pytest.mark.parametrize("seed", range(6))
def test_conv1d_matches_reference(seed, paged_pool):
    gen = torch.Generator().manual_seed(seed)
    lens, qsl, init, ck = _batch(gen)
    c, w = [(24, 4), (40, 3), (300, 4), (8, 2), (17, 4), (64, 5)][seed]
    t = sum(lens)
    x = _wide(t, c, gen)
    weight = torch.randn(c, w, generator=gen)
    bias = torch.randn(c, generator=gen) if seed % 2 else None
    want = paged_pool(len(lens), 1, (c, w - 1), gen, per_page=2, item_base=3)
    want.nan_fill(*_fresh(init, ck))  # fresh pages are never read
    got = want.clone()
    kw = dict(checkpoint_positions=ck, checkpoint_pages=want.ck_table)
    for _ in range(2):  # the second call continues from the first one's state
        y_want = causal_conv1d_ref(x, weight, bias, want.pool, qsl, want.table, init, "silu", item_base=3, **kw)
        y_got = native.causal_conv1d(x, weight, bias, got.pool, native.Varlen(qsl, got.table, init, **kw), "silu",
                                     item_base=3)
        torch.testing.assert_close(y_got, y_want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.buf, want.buf, rtol=0, atol=0, equal_nan=True)
        init = torch.ones_like(init)
    plain = native.causal_conv1d(x, weight, bias, got.clone().pool, native.Varlen(qsl, got.table, init), None,
                                 item_base=3)
    torch.testing.assert_close(plain, causal_conv1d_ref(x, weight, bias, want.clone().pool, qsl, want.table, init,
                                                        None, item_base=3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_delta_rule_matches_recurrent_reference(seed, paged_pool):
    gen = torch.Generator().manual_seed(50 + seed)
    lens, qsl, init, ck = _batch(gen)
    hk, rep, kd, vd = [(1, 1, 8, 12), (2, 2, 16, 16), (3, 1, 8, 4), (2, 3, 32, 32), (4, 2, 32, 32), (1, 4, 5, 7)][seed]
    h, t = hk * rep, sum(lens)
    q, k = _wide(t, hk * kd, gen), _wide(t, hk * kd, gen)
    v = _wide(t, h * vd, gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    want = paged_pool(len(lens), h, (kd, vd), gen)
    want.nan_fill(*_fresh(init, ck))
    got = want.clone()
    kw = dict(checkpoint_positions=ck, checkpoint_pages=want.ck_table)
    for _ in range(2):
        o_want = gated_delta_rule_recurrent_ref(
            q.reshape(t, hk, kd).repeat_interleave(rep, 1), k.reshape(t, hk, kd).repeat_interleave(rep, 1),
            v.reshape(t, h, vd), g, beta, want.pool, qsl, want.table, init, kd ** -0.5, item_base=2, **kw)
        o_got = native.gated_delta_rule(q, k, v, got.pool, native.Varlen(qsl, got.table, init, **kw), key_heads=hk,
                                        value_heads=h, scale=kd ** -0.5, g=g, beta=beta, item_base=2)
        torch.testing.assert_close(o_got, o_want.reshape(t, h * vd), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.buf, want.buf, rtol=1e-4, atol=1e-5, equal_nan=True)
        init = torch.ones_like(init)


def test_delta_rule_fused_gates_and_norm_match_the_model_formulas(paged_pool):
    """Gates from a/b and the gated output norm, as Qwen3.5's Gated DeltaNet computes them."""
    gen = torch.Generator().manual_seed(7)
    lens, qsl, init, ck = _batch(gen)
    hk, h, kd, vd, t = 2, 4, 16, 8, sum(lens)
    q, k, v = _wide(t, hk * kd, gen), _wide(t, hk * kd, gen), _wide(t, h * vd, gen)
    a, b, z = _wide(t, h, gen) * 3, _wide(t, h, gen) * 3, _wide(t, h * vd, gen)
    a[0, 0] = 30.0  # softplus past its threshold
    A_log, dt_bias = torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    weight, eps = 1 + 0.1 * torch.randn(vd, generator=gen), 1e-6
    want_pool = paged_pool(len(lens), h, (kd, vd), gen)
    got_pool = want_pool.clone()
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    o = gated_delta_rule_recurrent_ref(
        q.reshape(t, hk, kd).repeat_interleave(h // hk, 1), k.reshape(t, hk, kd).repeat_interleave(h // hk, 1),
        v.reshape(t, h, vd), g, beta, want_pool.pool, qsl, want_pool.table, init, kd ** -0.5,
        item_base=2).reshape(-1, vd)
    want = (weight * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z.reshape(-1, vd)))
    got = native.gated_delta_rule(q, k, v, got_pool.pool, native.Varlen(qsl, got_pool.table, init), key_heads=hk,
                                  value_heads=h, scale=kd ** -0.5, a=a, b=b, A_log=A_log, dt_bias=dt_bias, z=z,
                                  norm_weight=weight, norm_eps=eps, item_base=2)
    torch.testing.assert_close(got, want.reshape(t, h * vd), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pool.buf, want_pool.buf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_attention_decodes_native_and_the_rest_grouped_match_reference(seed):
    gen = torch.Generator().manual_seed(90 + seed)
    hq, hkv, d, bs = [(4, 2, 16, 4), (6, 1, 8, 16), (4, 4, 32, 8), (8, 2, 64, 16)][seed]
    n = int(torch.randint(3, 12, (1,), generator=gen))
    q_lens = [1 if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(2, 20, (1,), generator=gen))
              for _ in range(n)]
    seq_lens = [ql + int(torch.randint(0, 70, (1,), generator=gen)) for ql in q_lens]
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-s // bs) for s in seq_lens) + 2
    tables = torch.zeros(n, width, dtype=torch.int32)
    at = 0
    for i, s in enumerate(seq_lens):
        nb = -(-s // bs)
        tables[i, :nb] = torch.tensor(perm[at:at + nb], dtype=torch.int32)
        at += nb
    # As the arena holds them: one page per block holding K and V of two layers and
    # padding; this layer's K and V are strided views of it.
    blk = bs * hkv * d
    page = 4 * blk + 16
    arena = torch.randn(num_blocks * page, generator=gen)
    k_cache = arena.as_strided((num_blocks, bs, hkv, d), (page, hkv * d, d, 1), 2 * blk)
    v_cache = arena.as_strided((num_blocks, bs, hkv, d), (page, hkv * d, d, 1), 3 * blk)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = paged_attention_ref(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5)
    plan = AttentionPlan(qsl, lens, tables, bs, split_decodes=True)
    if 1 in q_lens:
        assert plan.decode is not None and len(plan.decode[0]) == q_lens.count(1)
    got = paged_attention_cpu(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5, plan)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bad_input_is_a_value_error_that_names_the_argument():
    x = torch.randn(4, 8)
    pool = torch.zeros(3, 1, 8, 3)
    tab = torch.tensor([[0]])

    def conv(table, qsl=(0, 4), init=(True,), **kw):
        native.causal_conv1d(x, torch.randn(8, 4), None, pool,
                             native.Varlen(list(qsl), torch.tensor(table), list(init), **kw), item_base=0)

    with pytest.raises(ValueError, match="weight"):
        native.causal_conv1d(x, torch.randn(7, 4), None, pool, native.Varlen([0, 4], tab, [True]), item_base=0)
    with pytest.raises(ValueError, match="state page 5"):
        conv([[5]])
    with pytest.raises(ValueError, match="written by two runs"):
        conv([[1], [1]], qsl=(0, 2, 4), init=(True, True))
    with pytest.raises(ValueError, match="written by two runs"):
        conv([[1]], checkpoint_positions=[2], checkpoint_pages=[[1]])
    with pytest.raises(ValueError, match="must lie in 1..=4"):
        conv([[1]], checkpoint_positions=[5], checkpoint_pages=[[2]])
    with pytest.raises(ValueError, match="query_start_loc"):
        conv([[1]], qsl=(0, 3))
    with pytest.raises(ValueError, match="columns of the state page table"):
        native.causal_conv1d(x, torch.randn(8, 4), None, pool, native.Varlen([0, 4], tab, [True]), item_base=1)
    state = torch.zeros(2, 2, 4, 4)
    with pytest.raises(ValueError, match="v must be"):
        native.gated_delta_rule(x, x, torch.randn(5, 8), state, native.Varlen([0, 4], tab, [True]), key_heads=2,
                                value_heads=2, scale=1.0, g=torch.zeros(4, 2), beta=torch.zeros(4, 2), item_base=0)
    with pytest.raises(ValueError, match="either g and beta"):
        native.gated_delta_rule(x, x, x, state, native.Varlen([0, 4], tab, [True]), key_heads=2, value_heads=2,
                                scale=1.0, g=torch.zeros(4, 2), item_base=0)
    kc = torch.zeros(4, 4, 2, 8)
    out = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="block 9"):
        native.paged_attention_decode(torch.zeros(2, 2, 8), kc, kc, np.array([0], dtype=np.int64),
                                      np.array([3], dtype=np.int64), torch.tensor([[9]], dtype=torch.int32), 1.0, out)
    with pytest.raises(ValueError, match="needs 1..=4"):
        native.paged_attention_decode(torch.zeros(2, 2, 8), kc, kc, np.array([0], dtype=np.int64),
                                      np.array([5], dtype=np.int64), torch.tensor([[1]], dtype=torch.int32), 1.0, out)


def test_thread_count_is_settable_and_results_do_not_depend_on_it():
    gen = torch.Generator().manual_seed(3)
    lens, qsl, init, ck = _batch(gen, 12)
    t, h, kd = sum(lens), 4, 32
    q, k, v = _wide(t, h * kd, gen), _wide(t, h * kd, gen), _wide(t, h * kd, gen)
    g, beta = -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    n = len(lens)
    pool = torch.randn(n + 2, h, kd, kd, generator=gen)
    table = torch.randperm(n + 2, generator=gen)[:n, None]
    before = native.threads()
    outs = []
    try:
        for n in (1, 3):
            native.set_threads(n)
            assert native.threads() == n
            p = pool.clone()
            outs.append((native.gated_delta_rule(q, k, v, p, native.Varlen(qsl, table, init), key_heads=h,
                                                 value_heads=h, scale=0.2, g=g, beta=beta, item_base=0), p))
    finally:
        native.set_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("centered", [True, False])
def test_rms_norm_with_and_without_the_residual_add(centered):
    gen = torch.Generator().manual_seed(11)
    t, d, eps = 77, 48, 1e-6
    x, residual = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    weight = 0.1 * torch.randn(d, generator=gen)
    scale = (1 + weight) if centered else weight

    def want(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * scale

    torch.testing.assert_close(native.rms_norm(x, weight, eps, centered=centered), want(x), rtol=1e-5, atol=1e-6)
    total = residual + x
    got = native.rms_norm(x, weight, eps, residual=residual, centered=centered)
    torch.testing.assert_close(residual, total, rtol=0, atol=0)  # updated in place, exactly
    torch.testing.assert_close(got, want(total), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="residual"):
        native.rms_norm(x, weight, eps, residual=torch.zeros(t + 1, d))


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 130])
def test_few_rows_linear_matches_f_linear(m):
    """Weights stored transposed (as the CPU path keeps them); widths with and without
    a partial 16-column strip; an input that is a column range of a wider buffer."""
    gen = torch.Generator().manual_seed(m)
    for n_out, k in ((48, 32), (35, 20), (272, 256)):
        w = torch.randn(n_out, k, generator=gen).t().contiguous().t()
        x = _wide(m, k, gen)
        torch.testing.assert_close(native.linear_few_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="wt must be"):
        native.linear_few_rows(torch.randn(3, 8), torch.randn(5, 9).t().contiguous().t())


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 130])
def test_row_major_linear_matches_f_linear(m):
    """Weights as checkpoints store them ([out, in], C-contiguous); widths with and
    without a partial register block of weight rows or of 16 keys; an input that is a
    column range of a wider buffer."""
    gen = torch.Generator().manual_seed(m)
    for n_out, k in ((48, 32), (35, 20), (272, 256), (9, 771)):
        w = torch.randn(n_out, k, generator=gen)
        x = _wide(m, k, gen)
        # float32 sums in another order than MKL's: rounding grows like sqrt(K).
        torch.testing.assert_close(native.linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6 * k ** 0.5)
    with pytest.raises(ValueError, match="w must be"):
        native.linear_rows(torch.randn(3, 8), torch.randn(5, 9))
    with pytest.raises(ValueError, match="C-contiguous"):
        native.linear_rows(torch.randn(3, 8), torch.randn(8, 5).t())


def test_state_shapes_that_only_divide_are_refused():
    """A pool whose element count happens to divide, but whose shape disagrees with the
    head sizes the inputs imply, is an error, not a silently wrong layout."""
    x = torch.randn(3, 4)
    tab = torch.tensor([[0]])
    with pytest.raises(ValueError, match=r"state must be a pool \[num_pages, per_page, K=4, V=4\]"):
        native.gated_delta_rule(x, x, x, torch.zeros(4, 2, 8, 8), native.Varlen([0, 3], tab, [True]), key_heads=1,
                                value_heads=1, scale=1.0, g=torch.zeros(3, 1), beta=torch.zeros(3, 1), item_base=0)
    with pytest.raises(ValueError, match=r"state a pool \[num_pages, per_page, C, W-1\]"):
        native.causal_conv1d(torch.randn(3, 8), torch.randn(8, 4), None, torch.zeros(2, 1, 8, 4),
                             native.Varlen([0, 3], tab, [True]), item_base=0)
    # A pool whose items are not contiguous (not an arena view) is refused, not misread.
    with pytest.raises(ValueError, match="C-contiguous items"):
        native.causal_conv1d(torch.randn(3, 8), torch.randn(8, 4), None, torch.zeros(2, 1, 3, 8).transpose(2, 3),
                             native.Varlen([0, 3], tab, [True]), item_base=0)


def test_a_written_tensor_overlapping_an_input_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="residual overlaps x"):
        native.rms_norm(x, torch.zeros(8), 1e-6, residual=x)
    pool = torch.zeros(2, 1, 8, 3)
    with pytest.raises(ValueError, match="conv_state overlaps x"):
        native.causal_conv1d(pool.view(2, 24)[:, :8], torch.randn(8, 4), None, pool,
                             native.Varlen([0, 2], torch.tensor([[0]]), [True]), item_base=0)


def test_single_rows_and_broadcast_views_work_like_f_linear():
    """Strides torch allows for one row (anything in the outer stride) and expanded
    inputs (outer stride 0) must not make the native path refuse what F.linear takes."""
    from hybridserve.model.qwen3_5 import Projection

    proj = Projection(5, 3, bias=True)
    with torch.no_grad():
        proj.weight.data = proj.weight.data.t().contiguous().t()
    for x in (torch.randn(5, 1).t(), torch.randn(5).expand(4, 5), torch.randn(1, 5)):
        torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rotary", [8, 32])
def test_qk_norm_rope_matches_the_model_formulas(rotary):
    """Query heads interleaved with their output gates ([q_h | gate_h] per head, as
    Qwen3.5's q_proj yields them), partial and full rotary, against the model's torch
    norm and HF-style rotate_half."""
    from hybridserve.model.qwen3_5 import RotaryEmbedding, ZeroCenteredRMSNorm

    gen = torch.Generator().manual_seed(rotary)
    t, heads, d = 9, 3, 32
    qg = _wide(t, heads * 2 * d, gen)
    norm = ZeroCenteredRMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(d, generator=gen))
    angles = torch.randn(t, rotary // 2, generator=gen)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    want = RotaryEmbedding.apply(norm(qg.reshape(t, heads, 2 * d)[..., :d]), cos, sin)
    got = native.qk_norm_rope(qg, heads, 2 * d, norm.weight, norm.eps, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        native.qk_norm_rope(qg, heads + 1, 2 * d, norm.weight, norm.eps, cos, sin)
