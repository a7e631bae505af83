"""The greedy token's row argmax (numpy on the CPU) against torch's ``argmax``, the
oracle, including its rules: the first maximum on ties, NaN counted as the maximum,
rows all ``-inf``."""

import torch

from hybridserve.sampler.batch_sampler import _argmax_rows


def test_row_argmax_matches_torch_including_ties_nan_and_inf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g)
    x[1, 10] = x[1, 900] = 50.0  # tie: the first wins
    x[2, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    x[4, 999] = float("inf")
    x[5, 3] = x[5, 4] = float("nan")
    got = _argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    # A non-contiguous or non-float32 input takes torch's own argmax.
    assert torch.equal(_argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))
    assert torch.equal(_argmax_rows(x.double()), x.double().argmax(dim=-1))
