"""Issue 35's GPU path for quantized safetensors: the Triton FP8 block-scaled and int4
GEMMs against the plain-PyTorch reference, and tiny FP8 and AWQ checkpoints served
with their weights kept quantized against HF on the dequantized weights."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from gpu_checks.common import (FP32_LOGIT_TOL, Ctx, _engine_greedy, _hf_greedy, _worst_prefill_error, criterion,
                               free_memory, log, sync)


def check_quant(ctx: Ctx) -> dict[str, Any]:
    """Kernels: ``fp8_matmul_triton`` / ``int4_matmul_triton`` against ``x @ W.T`` with the
    weight's ``dequantize`` (the format's definition) at the 0.8B preset's MLP shape,
    1 / 16 / 256 rows, float32 (IEEE dots) within 1e-4 and bfloat16 within 2e-2 of the
    output's scale; on CUDA timed beside torch's bfloat16 ``F.linear`` on the dequantized
    weight (``ratio_vs_bf16`` above 1: the quantized kernel is faster). Models: tiny FP8
    and AWQ checkpoints (``hybridserve.quant.tiny``, dense) loaded on the device (the
    projections stay quantized there): float32 logits within ``FP32_LOGIT_TOL`` of HF
    on the dequantized weights, engine greedy tokens equal to HF's, eager and with CUDA
    graphs."""
    import torch
    import torch.nn.functional as F

    from hybridserve.kernels.quant_matmul_triton import fp8_matmul_triton, int4_matmul_triton
    from hybridserve.quant.awq import AWQWeight
    from hybridserve.quant.fp8 import FP8BlockWeight
    from hybridserve.quant.tiny import awq_quantize, fp8_quantize

    dev = ctx.device
    n, k = (96, 256) if ctx.small else (7168, 1024)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    q, s, _ = fp8_quantize(w)
    f8 = FP8BlockWeight(q, s).to(dev)
    qw, qz, sc, _ = awq_quantize(w, 128)
    i4 = AWQWeight.from_awq(qw, qz, sc, 128).to(dev)
    kernels = {
        "fp8": (lambda x: fp8_matmul_triton(x, f8.weight, f8.scale, f8.row_offset), f8.dequantize().to(dev), f8.nbytes),
        "int4": (lambda x: int4_matmul_triton(x, i4.packed, i4.scales, i4.zeros, 128), i4.dequantize().to(dev),
                 i4.nbytes),
    }
    rows = (1, 16) if ctx.small else (1, 16, 256)
    dtypes = [torch.float32] + ([torch.bfloat16] if ctx.cuda else [])
    out: dict[str, Any] = {"shape": [n, k], "kernel": []}
    for name, (fn, deq, nbytes) in kernels.items():
        for m in rows:
            for dt in dtypes:
                x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(dt)
                want = x.float() @ deq.T
                got = fn(x).float()
                err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
                tol = 1e-4 if dt == torch.float32 else 2e-2
                rec = {"format": name, "rows": m, "dtype": str(dt).removeprefix("torch."), "max_rel_err": err,
                       "tol": tol, "ok": err <= tol}
                if ctx.cuda and dt == torch.bfloat16:
                    wb = deq.to(torch.bfloat16)
                    times = {"quant": [], "bf16": []}
                    for _ in range(30):
                        for key, f in (("quant", lambda: fn(x)), ("bf16", lambda: F.linear(x, wb))):
                            sync(ctx)
                            t0 = time.perf_counter()
                            f()
                            sync(ctx)
                            times[key].append(time.perf_counter() - t0)
                    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
                    rec.update(ms=round(ms["quant"], 4), bf16_ms=round(ms["bf16"], 4),
                               ratio_vs_bf16=round(ms["bf16"] / ms["quant"], 3),
                               weight_GBps=round(nbytes / ms["quant"] / 1e6, 1))
                out["kernel"].append(rec)
                log("quant kernel", rec)
    del kernels, f8, i4
    free_memory()

    # On the CPU (the dry run) keep the projections quantized too, on the native
    # kernels, as on CUDA (the CPU's default is to dequantize at load).
    import os
    old_mode = os.environ.get("HYBRIDSERVE_QUANT_CPU")
    os.environ["HYBRIDSERVE_QUANT_CPU"] = "keep"
    try:
        _models(ctx, out)
    finally:
        if old_mode is None:
            os.environ.pop("HYBRIDSERVE_QUANT_CPU", None)
        else:
            os.environ["HYBRIDSERVE_QUANT_CPU"] = old_mode
    models = out["models"]
    out["criteria"] = [
        criterion("FP8 and int4 Triton GEMMs within tolerance of the reference at every size and dtype",
                  all(r["ok"] for r in out["kernel"]), cases=len(out["kernel"])),
        criterion("projections kept quantized (Triton kernels on CUDA, native ones on the CPU)",
                  all(m["quantized_projections"] > 0 for m in models.values())),
        criterion("tiny FP8 and AWQ float32 logits within FP32_LOGIT_TOL of HF on the dequantized weights",
                  all(m["max_rel_logit_err"] <= FP32_LOGIT_TOL for m in models.values()),
                  errors={k: m["max_rel_logit_err"] for k, m in models.items()}),
        criterion("engine greedy tokens equal HF's, eager", all(m["greedy_match_hf"]["eager"] for m in models.values())),
        criterion("engine greedy tokens equal HF's, CUDA graphs",
                  all(m["greedy_match_hf"]["graphs"] for m in models.values()) if ctx.cuda else None),
    ]
    return out


def _models(ctx: Ctx, out: dict[str, Any]) -> None:
    import torch
    import transformers

    from hybridserve.model.layers import Projection
    from hybridserve.model.loader import load_model
    from hybridserve.quant.tiny import DENSE, write_quantized_checkpoint

    dev = ctx.device
    rng = random.Random(4)
    prompts = [[rng.randrange(259) for _ in range(n)] for n in ((9,) if ctx.small else (7, 33, 100))]
    n_tokens = 4 if ctx.small else 24
    out["models"] = {}
    for method in ("fp8", "awq"):
        qdir, ddir = write_quantized_checkpoint(ctx.tmp / f"quant-{method}", method, seed=5, **DENSE)
        hf = transformers.Qwen3_5ForCausalLM.from_pretrained(ddir, dtype=torch.float32).to(dev).eval()
        ours, config = load_model(qdir, dtype="float32", device=dev, progress=False)
        kept = sum(1 for m in ours.modules() if isinstance(m, Projection) and m.qweight is not None)
        worst = _worst_prefill_error(hf, ours, config, prompts, dev)
        del ours
        want_tokens = [_hf_greedy(hf, p, n_tokens, dev) for p in prompts]
        greedy = {m: t == want_tokens for m, t in _engine_greedy(qdir, ctx, "float32", prompts, n_tokens).items()}
        out["models"][method] = {"max_rel_logit_err": worst, "tol": FP32_LOGIT_TOL, "quantized_projections": kept,
                                 "greedy_match_hf": greedy}
        log("quant model", method, out["models"][method])
        del hf
        free_memory()
