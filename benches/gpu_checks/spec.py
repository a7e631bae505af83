"""Speculative decoding (MTP drafts) on the device: eager and from CUDA graphs."""

from __future__ import annotations

import random
import time
from typing import Any

from gpu_checks.common import Ctx, criterion, free_memory, log, make_engine, sync


def _run(model_dir: str, ctx: Ctx, groups: dict[str, list[list[int]]], n_tokens: int, k: int | None,
         eager: bool) -> dict[str, Any]:
    """One engine, with ``k`` drafts per step or none: each group of prompts run to the
    end in turn (all of a group at once), greedy. Per group its tokens and wall time;
    then the verify and decode graphs' replay counts, the drafts' acceptance, the most
    staging copies (host to device) any step made, and how many verify replays found
    their slot layout in the step's staging copy."""
    from hybridserve import staging
    from hybridserve.runner.verify_graphs import VERIFY_LAYOUT
    from hybridserve.sampling import SamplingParams

    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0}
    eng = make_engine(model_dir, ctx, dtype="float32", max_num_seqs=4, num_pages=400, max_model_len=256,
                      enforce_eager=eager, speculative_config=spec)
    copies, real_copy, staged = [0], staging.h2d_copy, [0, 0]

    def counted_copy(dst, src):
        copies[0] += 1
        real_copy(dst, src)

    vg = eng.runner.verify_graphs
    if vg is not None:
        fill = vg._fill

        def staged_fill(batch, n):
            staged[0] += VERIFY_LAYOUT in batch.op_plans
            staged[1] += 1
            fill(batch, n)

        vg._fill = staged_fill
    out: dict[str, Any] = {}
    most_copies = 0
    staging.h2d_copy = counted_copy
    try:
        for name, prompts in groups.items():
            for i, p in enumerate(prompts):
                eng.add_request(f"{name}{i}", p, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                                ignore_eos=True))
            res: dict[str, list[int]] = {}
            sync(ctx)
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                copies[0] = 0
                for o in eng.step():
                    if o.finished:
                        res[o.request_id] = o.outputs[0].token_ids
                most_copies = max(most_copies, copies[0])
            sync(ctx)
            out[name] = {"tokens": [res[f"{name}{i}"] for i in range(len(prompts))],
                         "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        staging.h2d_copy = real_copy
    runner, st = eng.runner, eng.stats()
    out.update(verify_replays=getattr(runner.verify_graphs, "replays", 0),
               decode_replays=getattr(runner.graphs, "replays", 0),
               draft_tokens=st.get("spec_draft_tokens", 0), accepted_tokens=st.get("spec_accepted_tokens", 0),
               most_staging_copies_per_step=most_copies, verify_fills_staged=staged[0], verify_fills=staged[1])
    del eng, runner
    free_memory()
    return out


def check_spec(ctx: Ctx) -> dict[str, Any]:
    """Issue 34 on the device: greedy tokens with MTP speculation (k = 3 drafts per
    step) identical to those without, eager and with CUDA graphs, on the trained
    default model (most drafts accepted) and a random-weight tiny checkpoint (most
    rejected), at batch 4 and 1 (one engine per configuration runs both in turn); with
    graphs, the verify steps must have replayed the verify graphs, each with its slot
    layout from the step's one staging copy (no step made more than one). Wall times on
    and off are reported beside them."""
    from hybridserve import default_model

    rng = random.Random(3)
    models = {"default": str(default_model.path()), "random": ctx.tiny("test-a")}
    k = 2 if ctx.small else 3
    n_tokens = 8 if ctx.small else 48
    groups = {"batch4": [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 9, 30)],
              "batch1": [[rng.randrange(3, 200) for _ in range(12)]]}
    cases, same_eager, same_graphs, replayed, one_copy = [], [], [], [], []
    for name, d in models.items():
        for eager in ([True, False] if ctx.cuda else [True]):
            off, on = _run(d, ctx, groups, n_tokens, None, eager), _run(d, ctx, groups, n_tokens, k, eager)
            for shape in groups:
                rec = {"model": name, "shape": shape, "k": k, "graphs": not eager,
                       "identical": on[shape]["tokens"] == off[shape]["tokens"],
                       "seconds_on": on[shape]["seconds"], "seconds_off": off[shape]["seconds"]}
                cases.append(rec)
                log("spec", rec)
                (same_eager if eager else same_graphs).append(rec["identical"])
            stats = {key: on[key] for key in ("draft_tokens", "accepted_tokens", "verify_replays", "decode_replays",
                                              "most_staging_copies_per_step", "verify_fills_staged", "verify_fills")}
            cases.append({"model": name, "k": k, "graphs": not eager, **stats})
            log("spec", cases[-1])
            if not eager:
                replayed.append(on["verify_replays"] > 0 and on["draft_tokens"] > 0)
                one_copy.append(on["most_staging_copies_per_step"] <= 1 and on["verify_fills"] > 0
                                and on["verify_fills_staged"] == on["verify_fills"])
    criteria = [
        criterion("greedy tokens identical with speculation on and off (eager)", all(same_eager),
                  cases=len(same_eager)),
        criterion("greedy tokens identical with speculation on and off (CUDA graphs)",
                  all(same_graphs) if ctx.cuda else None, cases=len(same_graphs)),
        criterion("verify steps replayed the verify CUDA graphs", all(replayed) if ctx.cuda else None),
        criterion("one staging copy per step; every verify replay's slot layout came in it",
                  all(one_copy) if ctx.cuda else None),
    ]
    return {"cases": cases, "criteria": criteria}
