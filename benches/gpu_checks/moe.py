"""The fused MoE kernel and a tiny MoE model against HF."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from gpu_checks.common import (FP32_LOGIT_TOL, Ctx, _engine_greedy, _hf_greedy, _worst_prefill_error, criterion,
                               free_memory, log, sync)


def check_moe(ctx: Ctx) -> dict[str, Any]:
    """Issue 18's GPU path: the Triton fused MoE against its plain-PyTorch reference at
    the 35B-A3B's layer shape (H 2048, 256 experts, 8 routed of 512 channels), float32
    within 1e-4 and bfloat16 within 2e-2 of the output's scale, timed; then a tiny MoE
    checkpoint (``moe-a``) against HF ``Qwen3_5MoeForCausalLM``: float32 logits within
    ``FP32_LOGIT_TOL`` and the engine's greedy tokens equal to HF's, with and without
    CUDA graphs."""
    import random

    import torch
    import transformers

    from hybridserve.kernels.moe import fused_moe_ref, route_ref
    from hybridserve.kernels.moe_triton import fused_moe_triton
    from hybridserve.model.loader import load_model
    from hybridserve.model.tiny import write_tiny_checkpoint

    dev = ctx.device
    h, e, k, i = (32, 6, 2, 24) if ctx.small else (2048, 256, 8, 512)
    cases = [(t, torch.float32) for t in ((1, 9) if ctx.small else (1, 256))]
    if not ctx.small:
        cases += [(t, torch.bfloat16) for t in (1, 16, 256, 2048)]
    out: dict[str, Any] = {"shape": {"hidden": h, "experts": e, "top_k": k, "inter": i}, "kernel": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, h, 2 * i, device=dev, generator=gen) / math.sqrt(h)
    w2 = torch.randn(e, i, h, device=dev, generator=gen) / math.sqrt(i)
    for t, dt in cases:
        x = torch.randn(t, h, device=dev, generator=gen)
        w, ids = route_ref(torch.randn(t, e, device=dev, generator=gen), k)
        want = fused_moe_ref(x, w13, w2, w, ids)
        args = (x.to(dt), w13.to(dt), w2.to(dt), w.to(dt), ids)
        got = fused_moe_triton(*args).float()
        err = float((got - want).abs().max() / want.abs().max())
        tol = 1e-4 if dt == torch.float32 else 2e-2
        rec = {"tokens": t, "dtype": str(dt).removeprefix("torch."), "max_rel_err": err, "tol": tol,
               "ok": err <= tol}
        if ctx.cuda:
            times = []
            for _ in range(20):
                sync(ctx)
                t0 = time.perf_counter()
                fused_moe_triton(*args)
                sync(ctx)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            active = int((torch.zeros(e, device=dev).index_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=dev))
                          > 0).sum())
            rec["ms"] = round(ms, 4)
            rec["expert_weight_GBps"] = round(active * 3 * h * i * args[1].element_size() / ms / 1e6, 1)
        out["kernel"].append(rec)
        log("moe kernel", rec)
    del w13, w2
    free_memory()

    d = write_tiny_checkpoint(ctx.tmp / "moe-a", preset="moe-a", seed=5)
    rng = random.Random(4)
    prompts = [[rng.randrange(259) for _ in range(n)] for n in ((9,) if ctx.small else (7, 33, 100))]
    n_tokens = 4 if ctx.small else 24
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=torch.float32).to(dev).eval()
    ours, config = load_model(d, dtype="float32", device=dev, progress=False)
    worst = _worst_prefill_error(hf, ours, config, prompts, dev)
    want_tokens = [_hf_greedy(hf, p, n_tokens, dev) for p in prompts]
    greedy = {m: t == want_tokens for m, t in _engine_greedy(d, ctx, "float32", prompts, n_tokens).items()}
    out["model"] = {"preset": "moe-a", "max_rel_logit_err": worst, "tol": FP32_LOGIT_TOL,
                    "greedy_match_hf": greedy}
    out["criteria"] = [
        criterion("fused MoE within tolerance of its reference at every size and dtype",
                  all(r["ok"] for r in out["kernel"]), cases=len(out["kernel"])),
        criterion("tiny MoE float32 logits within FP32_LOGIT_TOL of HF", worst <= FP32_LOGIT_TOL,
                  max_rel_err=worst, tol=FP32_LOGIT_TOL),
        criterion("engine greedy tokens equal HF's, eager", greedy["eager"]),
        # CUDA graphs exist only on a device: not applicable in the CPU dry run.
        criterion("engine greedy tokens equal HF's, CUDA graphs", greedy["graphs"] if ctx.cuda else None),
    ]
    del hf, ours
    free_memory()
    return out
