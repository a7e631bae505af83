"""The model against HF transformers on the device."""

from __future__ import annotations

from typing import Any

from gpu_checks.common import (BF16_LOGIT_TOL, FP32_LOGIT_TOL, Ctx, _engine_greedy, _hf_greedy, _worst_prefill_error,
                               criterion)


def check_fidelity(ctx: Ctx) -> dict[str, Any]:
    import random

    import torch
    import transformers

    from hybridserve.model.loader import load_model

    rng = random.Random(3)
    presets = ["test-a"] if (ctx.small or ctx.quick) else ["test-a", "test-b"]
    n_tokens = 4 if ctx.small else 32
    prompts = [[rng.randrange(259) for _ in range(n)] for n in ((9,) if ctx.small else (7, 33, 100, 5))]
    # bfloat16 matmuls on the CPU are slow and not what the device run measures.
    dtypes = ["float32"] if ctx.small else ["float32", "bfloat16"]
    out: dict[str, Any] = {"presets": presets, "greedy_tokens": n_tokens, "bf16_logit_tol": BF16_LOGIT_TOL,
                           "fp32_logit_tol": FP32_LOGIT_TOL, "cases": []}
    crit: list[dict[str, Any]] = []
    for preset in presets:
        d = ctx.tiny(preset)
        for dt in dtypes:
            tdt = getattr(torch, dt)
            hf = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=tdt).to(ctx.device).eval()
            ours, config = load_model(d, dtype=dt, device=ctx.device, progress=False)
            worst = _worst_prefill_error(hf, ours, config, prompts, ctx.device)
            tol = FP32_LOGIT_TOL if dt == "float32" else BF16_LOGIT_TOL
            want = [_hf_greedy(hf, p, n_tokens, ctx.device) for p in prompts]
            tokens = _engine_greedy(d, ctx, dt, prompts, n_tokens)
            case = {
                "preset": preset, "dtype": dt, "max_rel_logit_err": worst, "logits_ok": worst <= tol,
                "greedy_match_hf": {m: t == want for m, t in tokens.items()},
                "first_divergence": {m: next(((i, j) for i, (a, b) in enumerate(zip(t, want)) for j in range(len(a))
                                              if a[j] != b[j]), None) for m, t in tokens.items()},
            }
            case["graphs_equal_eager"] = tokens["graphs"] == tokens["eager"] if "graphs" in tokens else None
            tag = f"{preset} {dt}"
            crit += [
                criterion(f"{tag}: logits within {tol:g} of HF (relative)", case["logits_ok"], err=worst),
                criterion(f"{tag}: greedy tokens equal HF's", all(case["greedy_match_hf"].values())),
                criterion(f"{tag}: CUDA graphs give eager's tokens", case["graphs_equal_eager"]),
            ]
            out["cases"].append(case)
            del hf, ours
    out["criteria"] = crit
    return out
