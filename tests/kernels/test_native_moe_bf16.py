"""The native bfloat16 MoE block (``native.moe_block_bf16``) against the plain-PyTorch
references (``route_ref``, ``fused_moe_ref``, ``shared_expert_ref``) computed in
float32 from the same bfloat16 values: the routing HF's (its logits rounded to
bfloat16 as HF's bfloat16 router stores them, so near-ties resolve alike), the output
within the bfloat16 rounding of the intermediates the kernel rounds as HF does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import native
from hybridserve.kernels.moe import fused_moe_ref, route_ref, shared_expert_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="built without hybridserve._core.kernels")
BF16 = torch.bfloat16


def _weights(t, h, e, i, si, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(BF16)
    router = (torch.randn(e, h, generator=g) / h ** 0.5).to(BF16)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(BF16)  # HF's [E, 2I, H]
    down = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(BF16)          # HF's [E, H, I]
    shared = None
    if si:
        shared = ((torch.randn(2 * si, h, generator=g) / h ** 0.5).to(BF16),
                  (torch.randn(h, si, generator=g) / si ** 0.5).to(BF16),
                  (torch.randn(1, h, generator=g) / h ** 0.5).to(BF16))
    return x, router, gate_up, down, shared


def _packed(gate_up, down):
    """Copies of the expert tensors in the native block's panel layout."""
    gate_up, down = gate_up.clone(), down.clone()
    native.pack_experts_bf16(gate_up, down)
    return gate_up, down


def _packed_shared(shared):
    """The shared expert's (gate_up, down) packed as one expert; its gate as it is."""
    if shared is None:
        return None
    gu, dn = _packed(shared[0][None], shared[1][None])
    return gu[0], dn[0], shared[2]


def _reference(x, router, gate_up, down, k, shared):
    """float32 math on the bfloat16 values; the router's logits rounded to bfloat16 (HF's
    bfloat16 ``F.linear`` output) before HF's float32 softmax-topk-renormalise."""
    xf = x.float()
    logits = F.linear(xf, router.float()).to(BF16)
    w, ids = route_ref(logits, k)
    out = fused_moe_ref(xf, gate_up.float().transpose(1, 2), down.float().transpose(1, 2), w.float(), ids)
    if shared is not None:
        s13, s2, sg = (s.float() for s in shared)
        out = out + shared_expert_ref(xf, s13.t(), s2.t(), sg.reshape(-1))
    return out, ids, logits


# Top-1 and top-k > 1, expert counts not powers of two, with and without the shared
# expert, 1..70 tokens (groups of one or two rows, of a few, of more than a row tile),
# an intermediate size above a task's columns (both halves' runs) and one below.
@pytest.mark.parametrize("t, h, e, k, i, si", [
    (1, 64, 7, 3, 40, 48), (2, 48, 5, 1, 150, 0), (3, 96, 13, 4, 72, 80), (17, 64, 64, 4, 24, 0),
    (33, 80, 9, 2, 56, 64), (70, 64, 3, 2, 200, 16), (70, 40, 6, 6, 17, 20), (9, 33, 5, 2, 65, 0)])
@pytest.mark.parametrize("packed", [False, True])
def test_block_matches_the_float32_reference(t, h, e, k, i, si, packed):
    x, router, gate_up, down, shared = _weights(t, h, e, i, si, seed=t * 100 + e)
    want, want_ids, logits = _reference(x, router, gate_up, down, k, shared)
    if packed:
        gate_up, down = _packed(gate_up, down)
        shared = _packed_shared(shared)
    got, ids, busiest = native.moe_block_bf16(x, router, gate_up, down, k, shared, packed=packed,
                                              shared_packed=packed)
    assert got.dtype == BF16 and got.shape == (t, h)
    # The same experts where the k-th logit is more than a bfloat16 step or two above
    # the next (the kernel's float32 logit sums, in another order, may round to the
    # neighbouring bfloat16).
    kth = logits.float().topk(min(k + 1, e)).values
    clear = (kth[:, k - 1] - kth[:, -1]) > 2e-2 if k < e else torch.ones(t, dtype=torch.bool)
    assert clear.float().mean() > 0.5
    assert torch.equal(ids[clear].sort(-1).values, want_ids[clear].sort(-1).values)
    assert busiest == int(torch.bincount(ids.reshape(-1), minlength=e).max())
    # Outputs: intermediates rounded to bfloat16 (2^-8 relative each) through two GEMMs.
    scale = want[clear].abs().amax(-1, keepdim=True).clamp(min=1e-3)
    err = ((got[clear].float() - want[clear]).abs() / scale).max()
    assert err < 3e-2, float(err)


def test_exact_ties_go_to_the_lower_expert_in_hfs_order():
    """Equal router rows give equal logits: HF's ``torch.topk`` takes the lower expert
    first, and so does the kernel (ids in the same order, not just the same set)."""
    t, h, e, k, i = 64, 64, 6, 2, 16
    x, router, gate_up, down, _ = _weights(t, h, e, i, 0, seed=5)
    router[1] = router[2]
    router[3] = router[4] = router[5]
    _, ids, _ = native.moe_block_bf16(x, router, gate_up, down, k)
    _, want_ids, _ = _reference(x, router, gate_up, down, k, None)
    assert torch.equal(ids, want_ids)
    tied = (want_ids == torch.tensor([1, 2])).all(-1) | (want_ids == torch.tensor([3, 4])).all(-1)
    assert tied.sum() >= 5  # the ties decided many tokens' choice


# Both of torch's selections: nth_element + sort (k * 64 > E) and partial_sort
# (k * 64 <= E), top-1 included; the published models' 256 / 8 and 512 / 10.
@pytest.mark.parametrize("e, k", [(3, 1), (7, 3), (9, 2), (64, 1), (64, 4), (130, 2), (256, 4), (256, 8),
                                  (512, 10), (300, 17)])
def test_equal_probabilities_route_as_torch_topk_routes_them(e, k):
    """Logits drawn from a handful of integers, so most tokens' top-k boundary falls
    inside a run of equal probabilities: the kernel's choice and order equal HF's
    (``torch.topk`` of the float32 softmax), which is not "the lower index first"."""
    t, h, i = 96, 32, 8
    g = torch.Generator().manual_seed(e * 31 + k)
    x = torch.zeros(t, h, dtype=BF16)
    x[torch.arange(t), torch.arange(t) % h] = 1.0           # each token reads one router column
    router = torch.randint(-2, 3, (e, h), generator=g).to(BF16)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / 4).to(BF16)
    down = (torch.randn(e, h, i, generator=g) / 4).to(BF16)
    _, ids, _ = native.moe_block_bf16(x, router, gate_up, down, k)
    _, want_ids, _ = _reference(x, router, gate_up, down, k, None)
    assert torch.equal(ids, want_ids)


def test_near_ties_of_float32_logits_tie_after_bf16_rounding():
    """Logits a float32 router would separate by a hair (expert 3 above expert 2): HF's
    bfloat16 logits make them equal, so the lower expert wins; the kernel agrees."""
    t, h, e, k, i = 32, 32, 5, 1, 8
    x, router, gate_up, down, _ = _weights(t, h, e, i, 0, seed=9)
    x = torch.zeros(t, h, dtype=BF16)
    x[:, 0] = 1.0
    x[:, 1] = 2.0 ** -12                                    # adds a tiny amount to expert 3's logit
    router = torch.zeros(e, h, dtype=BF16)
    router[2, 0] = router[3, 0] = 4.0                       # the top two, tied at 4
    router[3, 1] = 1.0                                      # expert 3: 4 + 2^-12 in float32
    router[0, 0] = 1.0
    logits32 = F.linear(x.float(), router.float())
    assert (logits32[:, 3] > logits32[:, 2]).all()          # float32 would pick 3
    _, ids, _ = native.moe_block_bf16(x, router, gate_up, down, k)
    _, want_ids, _ = _reference(x, router, gate_up, down, k, None)
    assert torch.equal(want_ids, torch.full((t, 1), 2))     # HF's bfloat16 router picks 2
    assert torch.equal(ids, want_ids)


@pytest.mark.parametrize("packed", [False, True])
def test_a_token_gets_the_same_output_alone_and_in_a_batch(packed):
    x, router, gate_up, down, shared = _weights(40, 64, 9, 32, 48, seed=11)
    if packed:
        gate_up, down = _packed(gate_up, down)
        shared = _packed_shared(shared)
    opt = dict(packed=packed, shared_packed=packed)
    all_out, all_ids, _ = native.moe_block_bf16(x, router, gate_up, down, 3, shared, **opt)
    for tok in (0, 17, 39):
        one, ids, _ = native.moe_block_bf16(x[tok:tok + 1], router, gate_up, down, 3, shared, **opt)
        assert torch.equal(ids[0], all_ids[tok]) and torch.equal(one[0], all_out[tok])


def test_packing_is_in_place_and_unpacking_restores_hfs_layout():
    _, _, gate_up, down, _ = _weights(1, 48, 5, 40, 0, seed=4)
    gu, dn = gate_up.clone(), down.clone()
    ptrs = (gu.data_ptr(), dn.data_ptr())
    native.pack_experts_bf16(gu, dn)
    assert (gu.data_ptr(), dn.data_ptr()) == ptrs
    assert not torch.equal(gu, gate_up) and not torch.equal(dn, down)
    # A permutation within each expert matrix: the same multiset of values.
    assert torch.equal(gu[2, :40].flatten().sort().values, gate_up[2, :40].flatten().sort().values)
    native.pack_experts_bf16(gu, dn, unpack=True)
    assert torch.equal(gu, gate_up) and torch.equal(dn, down)
    with pytest.raises(ValueError, match=r"gate_up must be \[E, 2I, H\] and down \[E, H, I\]"):
        native.pack_experts_bf16(gu[:, :-1].contiguous(), dn)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.pack_experts_bf16(gu.transpose(1, 2), dn)


def test_bad_shapes_and_layouts_are_clear_errors():
    x, router, gate_up, down, shared = _weights(4, 32, 5, 16, 24, seed=1)
    with pytest.raises(ValueError, match=r"gate_up must be \[E, 2I, H\]"):
        native.moe_block_bf16(x, router, gate_up[:, :-1], down, 2)
    with pytest.raises(ValueError, match=r"router must be \[E, H\]"):
        native.moe_block_bf16(x, router[:, :-1], gate_up, down, 2)
    with pytest.raises(ValueError, match="top_k"):
        native.moe_block_bf16(x, router, gate_up, down, 6)
    with pytest.raises(ValueError, match=r"shared_gate must be \[1, H\]"):
        native.moe_block_bf16(x, router, gate_up, down, 2, (shared[0], shared[1], shared[2][:, :-1]))
    # A transposed (non-C-contiguous) weight would be read wrongly: refused.
    gt = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.moe_block_bf16(x, router, gt, down, 2)
