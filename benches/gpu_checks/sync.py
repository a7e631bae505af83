"""Host-device synchronisations per step on the decode path."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from gpu_checks.common import criterion, Ctx, make_engine, free_memory


def _to_decode(eng, n_steps_max: int = 200) -> None:
    for _ in range(n_steps_max):
        eng.step()
        st = eng.last_step_stats
        if st["num_scheduled_seqs"] and st["num_batched_tokens"] == st["num_scheduled_seqs"]:
            return
    raise RuntimeError("the engine never reached a pure-decode step")


# The step's allowed device->host transfers: (file, what the line must contain).
SYNC_ALLOWED = {
    "sampler tokens": ("batch_sampler.py", ".tolist()"),
    "beam candidates": ("beam_search.py", ".tolist()"),
}


def check_sync(ctx: Ctx) -> dict[str, Any]:
    import linecache

    import torch

    from hybridserve.beam_search import BeamSearchParams
    from hybridserve.sampling import SamplingParams

    d = ctx.tiny("test-a")
    results: dict[str, Any] = {}
    crit: list[dict[str, Any]] = []
    for eager in ([False, True] if ctx.cuda else [True]):
        eng = make_engine(d, ctx, dtype="bfloat16" if ctx.cuda else "float32", max_num_seqs=8,
                          num_gpu_blocks=256, num_state_slots=16, enforce_eager=eager)
        # Seeded, penalised, biased and greedy rows (every sampler path) and a beam
        # request in one batch.
        kinds = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                 SamplingParams(temperature=0.8, seed=1, top_p=0.9, max_tokens=40, ignore_eos=True),
                 SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.5, max_tokens=40, ignore_eos=True),
                 SamplingParams(temperature=0.7, logit_bias={3: 1.0}, repetition_penalty=1.2, max_tokens=40,
                                ignore_eos=True, logprobs=2)]
        for i, p in enumerate(kinds):
            eng.add_request(f"s{i}", [1 + i, 2, 3, 4, 5], p)
        eng.add_request("beam", [9, 8, 7, 6], BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True))
        _to_decode(eng)
        _to_decode(eng)  # a second decode step: every row's device state exists now
        sources: dict[str, int] = {}
        steps = 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ctx.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                if ctx.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        counts = dict.fromkeys(SYNC_ALLOWED, 0)
        unexpected: dict[str, int] = {}
        for w in caught:
            if "synchroniz" not in str(w.message).lower():
                continue
            line = linecache.getline(w.filename, w.lineno).strip()
            key = f"{Path(w.filename).name}:{w.lineno}: {line}"
            sources[key] = sources.get(key, 0) + 1
            kind = next((k for k, (f, text) in SYNC_ALLOWED.items()
                         if Path(w.filename).name == f and text in line), None)
            if kind is None:
                unexpected[key] = unexpected.get(key, 0) + 1
            else:
                counts[kind] += 1
        mode = "eager" if eager else "graphs"
        beams_running = "beam" in eng.requests
        results[mode] = {"sync_sources": sources, "unexpected": unexpected, "transfers": counts,
                         "steps": steps, "beam_request_running": beams_running}
        # Only CUDA's sync debug mode sees synchronisations; elsewhere nothing is decided.
        crit += [
            criterion(f"{mode}: no synchronisation but the allowed transfers", not unexpected if ctx.cuda else None,
                      unexpected=len(unexpected)),
            criterion(f"{mode}: at most one token transfer and one beam transfer per step",
                      (all(n <= steps for n in counts.values()) and beams_running) if ctx.cuda else None,
                      transfers=counts),
        ]
        if not ctx.cuda:
            results[mode]["note"] = "CPU dry run: the sync debug mode exists only on CUDA; the code path ran"
        del eng
        free_memory()
    return {"criteria": crit, **results}
