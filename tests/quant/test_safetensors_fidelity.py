"""Tiny FP8 and AWQ checkpoints served against HF on their dequantized weights: dense and
MoE, with the weights kept in their quantized form or dequantized at load (the CPU's two
forms, ``HYBRIDSERVE_QUANT_CPU``). The formats' own tests (the definitions, the kernels,
the refusals) are in test_fp8.py and test_awq.py."""

from __future__ import annotations

import pytest
import torch

from hybridserve.model.layers import Projection

FORMATS = ["fp8", "awq"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_float32_logits_within_bound(fmt, kind, mode, quant_dirs, hf_oracle, fid):
    model = fid.check_logits(quant_dirs(fmt, kind)[0], hf_oracle(fmt, kind), "float32", mode, fid.F32_TOL)
    kept = [m for m in model.modules() if isinstance(m, Projection) and m.qweight is not None]
    assert bool(kept) == (mode == "keep")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bfloat16_logits_within_bound(fmt, kind, quant_dirs, hf_oracle, fid):
    fid.check_logits(quant_dirs(fmt, kind)[0], hf_oracle(fmt, kind, torch.bfloat16), "bfloat16", "keep",
                     fid.BF16_TOL)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("mode", ["keep", "dequantize"])
def test_greedy_16_tokens_equal_hf(fmt, kind, mode, quant_dirs, hf_oracle, monkeypatch, fid):
    monkeypatch.setenv("HYBRIDSERVE_QUANT_CPU", mode)
    ps = fid.prompts()
    want = [fid.hf_greedy(hf_oracle(fmt, kind), p) for p in ps]
    assert fid.engine_greedy(quant_dirs(fmt, kind)[0], "float32", ps) == want
