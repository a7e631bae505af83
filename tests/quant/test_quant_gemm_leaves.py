"""A fused projection's parts: the GGUF loader stacks adjacent parts of one block type
into one weight (one kernel call per run of parts), and the native decode step's
QuantGemm writes each remaining part into its columns of the output. Both must give the
products of the parts one by one, bit for bit (the module path's ConcatWeight.linear
over the file's own tensors is the oracle)."""

import numpy as np
import pytest
import torch

from hybridserve.kernels import quant as qk
from hybridserve.model import quant_gemm
from hybridserve.model.native_decode import _view
from hybridserve.quant import ConcatWeight
from hybridserve.quant.ggml import GGMLWeight
from hybridserve.quant.ggml_quantize import quantize
from hybridserve.quant.gguf.load import _merge_same_type
from hybridserve.quant.gguf.weights import ColumnPermutedWeight

needs_kernels = pytest.mark.skipif(not qk.available(), reason="the extension lacks the block kernels")


def _q(rows: int, cols: int, seed: int, qtype: str) -> GGMLWeight:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return GGMLWeight(qtype, torch.from_numpy(quantize(w, qtype)), (rows, cols))


def _parts(cols: int = 512):
    # DeltaNet's in_proj as a Q4_K_M file stores it: q|k|v in one type, z in another,
    # then the small b and a tensors in the first type again.
    return [_q(64, cols, 0, "q6_k"), _q(32, cols, 1, "q4_k"), _q(16, cols, 2, "q4_k"), _q(16, cols, 3, "q4_k"),
            _q(32, cols, 4, "q6_k")]


def test_merge_stacks_runs_of_one_type_only():
    parts = _parts()
    merged = _merge_same_type(parts)
    assert [(p.qtype, p.shape[0]) for p in merged] == [("q6_k", 64), ("q4_k", 64), ("q6_k", 32)]
    # The stacked blocks are the parts' blocks in order: the same weight.
    torch.testing.assert_close(ConcatWeight(merged).dequantize(), ConcatWeight(parts).dequantize(), rtol=0, atol=0)
    # A permuted part is never stacked with its neighbours (its columns are other columns).
    perm = torch.randperm(512)
    odd = [parts[1], ColumnPermutedWeight(parts[2], perm), parts[3]]
    assert [type(p).__name__ for p in _merge_same_type(odd)] == ["GGMLWeight", "ColumnPermutedWeight", "GGMLWeight"]
    with pytest.raises(ValueError, match="one block type"):
        GGMLWeight.cat_rows([parts[0], parts[1]])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_parts_give_the_parts_products(rows, dtype):
    parts = _parts()
    x = torch.randn(rows, 512).to(dtype)
    want = ConcatWeight(parts).linear(x)
    got = ConcatWeight(_merge_same_type(parts)).linear(x)
    assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_gemm_writes_each_part_into_its_columns(rows, dtype):
    parts = _parts()
    perm = torch.randperm(512)
    cases = [ConcatWeight(parts), ConcatWeight(_merge_same_type(parts)), ColumnPermutedWeight(parts[0], perm),
             ConcatWeight([parts[1], ColumnPermutedWeight(parts[2], perm), parts[0]])]
    kernel = quant_gemm.quant_matmul_kernel()
    for w in cases:
        g = quant_gemm.QuantGemm(w, dtype, None, kernel)
        x = torch.randn(rows, 512).to(dtype)
        # Columns 0..N of a wider buffer, as the step's fused outputs are (a row's
        # range is contiguous, its next row is not).
        wide = torch.full((rows, w.shape[0] + 8), 7.0, dtype=dtype)
        out = wide[:, :w.shape[0]]
        if rows == 1:
            g(_view(x), _view(out))
        else:
            dense = torch.empty(rows, w.shape[0], dtype=dtype)
            g(_view(x), _view(dense))
            out.copy_(dense)
        assert torch.equal(out, w.linear(x)), w
        assert bool((wide[:, w.shape[0]:] == 7.0).all())
