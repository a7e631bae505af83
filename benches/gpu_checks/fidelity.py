"""The model against HF transformers on the device."""

from __future__ import annotations

from typing import Any

from gpu_checks.common import BF16_LOGIT_TOL, FP32_LOGIT_TOL, criterion, Ctx, make_engine, free_memory, _hf_greedy, _our_prefill_logits


def check_fidelity(ctx: Ctx) -> dict[str, Any]:
    import random

    import torch
    import transformers

    from hybridserve.model.loader import load_model
    from hybridserve.sampling import SamplingParams

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
            worst = 0.0
            for p in prompts:
                with torch.no_grad():
                    ref = hf(torch.tensor([p], device=ctx.device)).logits[0].float()
                got = _our_prefill_logits(ours, config, p, ctx.device)
                worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0)))
            tol = FP32_LOGIT_TOL if dt == "float32" else BF16_LOGIT_TOL
            want = [_hf_greedy(hf, p, n_tokens, ctx.device) for p in prompts]
            modes = [False, True] if ctx.cuda else [True]
            tokens: dict[str, list[list[int]]] = {}
            for eager in modes:
                eng = make_engine(d, ctx, dtype=dt, max_num_seqs=8, num_gpu_blocks=256, num_state_slots=16,
                                  enforce_eager=eager)
                for i, p in enumerate(prompts):
                    eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                               ignore_eos=True))
                res: dict[str, list[int]] = {}
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        if o.finished:
                            res[o.request_id] = o.outputs[0].token_ids
                tokens["eager" if eager else "graphs"] = [res[f"p{i}"] for i in range(len(prompts))]
                del eng
                free_memory()
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
