"""The float32 native MoE block's routing against HF's (``route_ref``: float32
softmax, ``torch.topk``, renormalise) where probabilities tie exactly: the choice and
its order are torch's selection's, which is not "the lower index first" (of three
tied experts 3, 4, 5 torch takes 3 and 5 for k = 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import native
from hybridserve.kernels.moe import route_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="built without hybridserve._core.kernels")


# Both of torch's selections: nth_element + sort (k * 64 > E) and partial_sort
# (k * 64 <= E), top-1 included; the published models' 256 / 8 and 512 / 10.
@pytest.mark.parametrize("e, k", [(3, 1), (7, 3), (9, 2), (64, 1), (64, 4), (130, 2), (256, 8), (512, 10),
                                  (300, 17)])
def test_equal_probabilities_route_as_torch_topk_routes_them(e, k):
    """Logits drawn from a handful of integers (each token reads one router column, so
    the float32 GEMM is exact), so most tokens' top-k boundary falls inside a run of
    equal probabilities; a few tokens get a NaN-free row of distinct values."""
    t, h, i = 96, 32, 8
    g = torch.Generator().manual_seed(e * 17 + k)
    x = torch.zeros(t, h)
    x[torch.arange(t), torch.arange(t) % h] = 1.0
    router = torch.randint(-2, 3, (e, h), generator=g).float()
    router[:, 0] = torch.randperm(e, generator=g).float()  # column 0: no ties
    w13 = torch.randn(e, h, 2 * i, generator=g) / 4
    w2 = torch.randn(e, i, h, generator=g) / 4
    _, ids, _ = native.moe_block(x, router.t().contiguous().t(), w13, w2, k)
    _, want = route_ref(F.linear(x, router), k)
    assert torch.equal(ids, want)
