"""Quantized safetensors on CUDA (issue 35): the Triton FP8 block-scaled and int4 GEMMs
in bfloat16 (which the interpreter cannot run) against ``x @ W.T`` with the weight's
dequantization, and a tiny FP8 / AWQ model on the device, projections kept quantized,
against HF on the dequantized weights."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("m", [1, 16, 100])
def test_bf16_gemms_against_the_reference(cuda_device, m):
    from hybridserve.quant.awq import AWQWeight
    from hybridserve.quant.fp8 import FP8BlockWeight
    from hybridserve.quant.tiny import awq_quantize, fp8_quantize

    g = torch.Generator().manual_seed(m)
    w = torch.randn(520, 384, generator=g) * 0.05
    q, s, _ = fp8_quantize(w)
    qw, qz, sc, _ = awq_quantize(w, 128)
    for weight in (FP8BlockWeight(q, s).rows(3, 500), AWQWeight.from_awq(qw, qz, sc, 128)):
        wd = weight.to(cuda_device)
        x = torch.randn(m, 384, generator=g).to(cuda_device, torch.bfloat16)
        got = wd.linear(x)
        want = x.float() @ weight.dequantize().to(cuda_device).T
        assert got.dtype == torch.bfloat16 and got.is_cuda
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= 1e-2, (type(weight).__name__, err)


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_tiny_quantized_model_on_cuda_matches_hf(cuda_device, method, tmp_path):
    import transformers

    from hybridserve.model.layers import Projection
    from hybridserve.model.loader import load_model
    from hybridserve.quant.tiny import DENSE, write_quantized_checkpoint

    qdir, ddir = write_quantized_checkpoint(tmp_path / method, method, seed=2, **DENSE)
    model, config = load_model(qdir, dtype="float32", device=cuda_device, progress=False)
    kept = [m for m in model.modules() if isinstance(m, Projection) and m.qweight is not None]
    assert kept
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(ddir, dtype=torch.float32).to(cuda_device).eval()
    x = torch.randint(0, 259, (1, 40), device=cuda_device)
    with torch.no_grad():
        ref = hf(x).logits[0]
    # The model's own prefill: one sequence, blocks then state pages in order.
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model.batch import ForwardBatch
    from hybridserve.model.cache import dtype_name

    n, bs = 40, 16
    nb = -(-n // bs)
    pages = arena_layout(config, bs, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, bs)
    batch = ForwardBatch.from_lists(
        input_ids=x[0].tolist(), positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))], has_initial_state=[False],
        logits_indices=range(n), device=cuda_device)
    with torch.no_grad():
        got = model(batch, cache).float()
    err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0))
    assert err <= 1e-4, err
