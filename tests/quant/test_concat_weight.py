"""ConcatWeight (a fused projection of separately stored quantized parts) against the
plain product with the parts' dequantized weights stacked, and Projection.quantize_."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from hybridserve.kernels import quant as qk
from hybridserve.model.layers import Projection
from hybridserve.quant import ConcatWeight
from hybridserve.quant.ggml import GGMLWeight


def _q(rows: int, cols: int, seed: int, kind=gguf.GGMLQuantizationType.Q8_0, name="q8_0"):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return GGMLWeight(name, torch.from_numpy(quantize(w, kind)), (rows, cols)), w


def _seen(x):
    """``x`` as the block kernels see it: rounded per 32-block (Q8_0 / Q4_0 weights) where
    the native kernels run, else as it is (the reference products)."""
    return qk.q8_act_ref(x, k_quant=False) if qk.available() else x


def test_concat_of_mixed_types_equals_stacked_product():
    a, wa = _q(5, 64, 0)
    b, wb = _q(7, 64, 1, gguf.GGMLQuantizationType.Q4_0, "q4_0")
    c = ConcatWeight([a, b])
    assert c.shape == (12, 64) and c.qtype == "q4_0+q8_0" and c.nbytes == a.nbytes + b.nbytes
    x = torch.randn(3, 64)
    ref = _seen(x) @ torch.cat([a.dequantize(), b.dequantize()]).T
    torch.testing.assert_close(c.linear(x), ref)
    # Rows across the parts' boundary keep both parts' rows.
    torch.testing.assert_close(c.rows(3, 9).dequantize(), torch.cat([a.dequantize(), b.dequantize()])[3:9])
    # The stored bytes round-trip: Q8_0 is within half a step of the original.
    assert np.abs(a.dequantize().numpy() - wa).max() < np.abs(wa).max() / 127


def test_concat_refuses_mismatched_columns():
    a, _ = _q(2, 64, 0)
    b, _ = _q(2, 32, 1)
    with pytest.raises(ValueError, match="in_features"):
        ConcatWeight([a, b])


def test_projection_serves_its_quantized_weight():
    p = Projection(64, 8, bias=True)
    q, _ = _q(8, 64, 2)
    bias = p.bias.detach().clone()
    p.quantize_(q)
    assert p.weight is None
    x = torch.randn(4, 64)
    torch.testing.assert_close(p(x), _seen(x) @ q.dequantize().T + bias)
    with pytest.raises(ValueError, match="shape"):
        p.quantize_(_q(4, 64, 3)[0])
