"""The routed experts of a GGUF MoE layer in one native call
(``hybridserve.kernels.quant.experts``, ``QuantizedExperts.forward``) against the
per-expert loop on the reference product path: each product is the ``gguf`` package's
dequantized weight times the activation quantized by :func:`q8_act_ref` (llama.cpp's
Q8_0 / Q8_K in torch), in float64; ``silu(gate) * up`` and the weighted sum as the
loop takes them (rounded to bfloat16 where the bfloat16 loop rounds).

The tolerance: float32 summation rounding of each product (``RTOL`` of the sum of
absolute products, as tests/quant/test_ggml_kernels.py), and for the down product a
few elements of ``silu(gate) * up`` landing on the other side of a rounding boundary
than the float64 reference puts them (a bfloat16 rounding or a Q8 quantization step):
each costs at most one step of that element times its weight, allowed ``FLIPS`` times
per output. A wrong expert, weight, type or order is off by the whole product.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import quant as qk
from hybridserve.quant.ggml import GGML_TYPES, GGMLWeight
from hybridserve.quant.ggml_quantize import quantize
from hybridserve.quant.gguf.weights import QuantizedExperts

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not qk.experts_available(),
                                reason="extension built without the quantized experts kernel")

# The block types llama-quantize writes into qwen35moe files.
TYPES = ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q5_0"]
RTOL = 1e-5
FLIPS = 1


def _blocks(qtype, e, rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e * rows, k, generator=g) * 0.05
    w[::rows] += 0.1                               # rows with a large mean (the k-quants' min)
    data = torch.from_numpy(quantize(w.numpy(), qtype)).reshape(e, rows, -1)
    ws = [GGMLWeight(qtype, data[i], (rows, k)) for i in range(e)]
    return data, ws


def _experts(types, e, h, inter, seed):
    gt, ut, dt = types
    gd, gate = _blocks(gt, e, inter, h, seed)
    ud, up = _blocks(ut, e, inter, h, seed + 1)
    dd, down = _blocks(dt, e, h, inter, seed + 2)
    ex = QuantizedExperts(gate, up, down)
    assert ex.blocks is not None                   # the loader's views: one tensor each
    ref = [torch.stack([w.dequantize() for w in ws]).double() for ws in (gate, up, down)]
    return ex, ref


def _route(t, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.05
    return w / w.sum(-1, keepdim=True), ids


def _x(t, h, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    x[:, 5] *= 8
    return x.to(dtype)


def _reference(x, weights, ids, ref, types):
    """(out, tol) in float64: the per-expert loop on the reference path."""
    wg, wu, wd = ref
    gt, ut, dt = types
    bf16 = x.dtype == torch.bfloat16
    rnd = (lambda v: v.to(torch.bfloat16).double()) if bf16 else (lambda v: v)
    t, h = x.shape
    out = torch.zeros(t, h, dtype=torch.float64)
    tol = torch.zeros(t, h, dtype=torch.float64)
    xq = {kq: qk.q8_act_ref(x.float(), kq).double() for kq in (False, True)}
    for r in range(t):
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            g = rnd(wg[e] @ xq[gt.endswith("_k")][r])
            u = rnd(wu[e] @ xq[ut.endswith("_k")][r])
            a = rnd(rnd(F.silu(g)) * u)
            kq = dt.endswith("_k")
            aq = qk.q8_act_ref(a.float()[None], kq).double()[0]
            p = wd[e] * aq[None]
            y = rnd(p.sum(-1))
            wt = float(weights[r, j].float())
            out[r] += y * wt
            # One step of an element of a: its Q8 block's scale, plus a bfloat16 ulp.
            bs = 256 if kq else 32
            step = (a.abs().reshape(-1, bs).amax(-1) / 127).repeat_interleave(bs)
            if bf16:
                step = step + a.abs() * 2.0 ** -7
            flip = (wd[e].abs() * step[None]).amax(-1)
            prod_tol = RTOL * p.abs().sum(-1) + FLIPS * flip + 1e-6
            if bf16:
                prod_tol = prod_tol + y.abs() * 2.0 ** -8
            tol[r] += prod_tol * wt
    if bf16:
        tol += out.abs() * 2.0 ** -8
    return out, tol


def _check(got, x, weights, ids, ref, types):
    want, tol = _reference(x, weights, ids, ref, types)
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, excess {(err - tol).max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_against_the_reference_loop(qtype, dtype):
    # gate / up of one type, down of another (llama-quantize mixes them).
    types = (qtype, qtype, TYPES[(TYPES.index(qtype) + 2) % len(TYPES)])
    e, h, inter = 8, 256, 256
    ex, ref = _experts(types, e, h, inter, seed=TYPES.index(qtype))
    for t in range(1, 18):
        k = 1 + t % 4
        x = _x(t, h, seed=t, dtype=dtype)
        weights, ids = _route(t, k, e, seed=100 + t)
        gate, up, down = ex.blocks
        out, load = qk.experts(x, weights.to(dtype), ids, gate, up, down)
        assert out.shape == (t, h) and out.dtype == dtype
        assert load == int(torch.bincount(ids.reshape(-1), minlength=e).max())
        _check(out, x, weights.to(dtype), ids, ref, types)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_top_k_mixed_types_and_idle_experts(k):
    # Gate and up of different kinds (Q8_0 takes Q8_0 activations, Q5_K Q8_K), down Q6_K.
    types = ("q8_0", "q5_k", "q6_k")
    e, h, inter = 16, 256, 512
    ex, ref = _experts(types, e, h, inter, seed=40 + k)
    for t in (1, 2, 5, 17):
        x = _x(t, h, seed=t, dtype=torch.float32)
        weights, ids = _route(t, k, e, seed=7 * t + k)
        out = ex(x, weights, ids)
        _check(out, x, weights, ids, ref, types)


def test_an_idle_expert_is_not_read():
    # The blocks of experts no token chose may hold anything (here NaN scales).
    types = ("q4_k", "q4_k", "q6_k")
    ex, ref = _experts(types, 4, 256, 256, seed=3)
    x = _x(3, 256, seed=1, dtype=torch.float32)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2]])
    weights = torch.full((3, 2), 0.5)
    before = ex(x, weights, ids)
    for kind in ex.blocks:
        kind[0][1].view(torch.float16)[:, 0] = float("nan")      # every block's d of expert 1
        kind[0][3].view(torch.float16)[:, 0] = float("nan")
    after = ex(x, weights, ids)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_does_not_depend_on_the_step_or_the_threads(dtype):
    types = ("q4_k", "q4_k", "q6_k")
    e, h = 8, 256
    ex, _ = _experts(types, e, h, 256, seed=5)
    x = _x(16, h, seed=2, dtype=dtype)
    weights, ids = _route(16, 4, e, seed=3)
    weights = weights.to(dtype)
    gate, up, down = ex.blocks
    all_rows = qk.experts(x, weights, ids, gate, up, down)[0]
    for r in (0, 9, 15):
        one = qk.experts(x[r:r + 1], weights[r:r + 1], ids[r:r + 1], gate, up, down)[0]
        torch.testing.assert_close(one[0], all_rows[r], rtol=0, atol=0)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    shuffled = qk.experts(x[perm], weights[perm], ids[perm], gate, up, down)[0]
    torch.testing.assert_close(shuffled, all_rows[perm], rtol=0, atol=0)
    # Nor on the thread count (tasks split by expert and weight-row tile; each output
    # is written by one task, the sum's order fixed).
    from hybridserve.kernels import native

    before = native.threads()
    try:
        for n in (1, 2, 3):
            native.set_threads(n)
            again = qk.experts(x, weights, ids, gate, up, down)[0]
            torch.testing.assert_close(again, all_rows, rtol=0, atol=0)
    finally:
        native.set_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_takes_the_kernel_and_agrees_with_the_loop(dtype, monkeypatch):
    types = ("q5_k", "q5_k", "q8_0")
    e, h = 8, 256
    ex, ref = _experts(types, e, h, 256, seed=9)
    x = _x(6, h, seed=4, dtype=dtype)
    weights, ids = _route(6, 3, e, seed=5)
    weights = weights.to(dtype)
    calls = []
    real = qk.experts
    monkeypatch.setattr(qk, "experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = ex(x, weights, ids)
    assert calls, "forward did not take the native kernel"
    loop = ex.forward_loop(x, weights, ids)
    # Both on the same native products; only silu (torch's vs the kernel's) may differ
    # in its last bit, which can move an element of a across a rounding boundary.
    _check(out, x, weights, ids, ref, types)
    _check(loop, x, weights, ids, ref, types)
    same = (out == loop).double().mean()
    assert same > 0.9, f"only {same:.2%} of the outputs equal the loop's"
    # Past the types' few-row limit an expert: the loop (prefill's tiles).
    calls.clear()
    t = ex._native_rows() + 1
    xl = _x(t, h, seed=6, dtype=dtype)
    ids_l = torch.zeros(t, 1, dtype=torch.long)
    ex(xl, torch.ones(t, 1, dtype=dtype), ids_l)
    assert not calls


def test_fallback_loop_without_the_kernel(monkeypatch):
    types = ("q4_0", "q4_0", "q5_0")
    ex, ref = _experts(types, 4, 256, 256, seed=11)
    x = _x(3, 256, seed=1, dtype=torch.float32)
    weights, ids = _route(3, 2, 4, seed=2)
    monkeypatch.setattr(qk, "experts_available", lambda: False)
    _check(ex(x, weights, ids), x, weights, ids, ref, types)


def test_bad_calls_are_refused():
    types = ("q4_k", "q4_k", "q6_k")
    ex, _ = _experts(types, 4, 256, 256, seed=12)
    gate, up, down = ex.blocks
    x = torch.zeros(2, 256)
    w = torch.full((2, 1), 1.0)
    with pytest.raises(ValueError, match=r"routing ids must lie in \[0, 4\)"):
        qk.experts(x, w, torch.tensor([[0], [4]]), gate, up, down)
    with pytest.raises(ValueError, match="down must be"):
        qk.experts(x, w, torch.tensor([[0], [1]]), gate, up, (down[0][:, :128].contiguous(), down[1]))
    with pytest.raises(ValueError, match="no native kernel"):
        qk.experts(x, w, torch.tensor([[0], [1]]), gate, up, (down[0], 3))
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        qk.experts(x, torch.ones(2, 2), torch.tensor([[0], [1]]), gate, up, down)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        qk.experts(x.double(), w, torch.tensor([[0], [1]]), gate, up, down)
