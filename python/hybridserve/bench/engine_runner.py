"""Run a workload through an in-process :class:`LLMEngine` (``bench throughput``).

The loop is the engine's own: add the requests whose arrival time has come, one
``step()``, then look at each live request's sample (the engine's ``RequestState``,
kept by reference) to time its new tokens. Finished-only outputs are asked of the
engine (``emit_unfinished=False``), so the bench costs O(live requests) per step, as
``LLM.generate`` does. After each step the core's ``stats()`` gives the pool and queue
gauges (peak KV blocks, DeltaNet state pages, running, waiting) and counters.
"""

from __future__ import annotations

import time
from typing import Any

from hybridserve.bench.report import RequestRecord
from hybridserve.bench.workload import Workload
from hybridserve.errors import HybridServeError
from hybridserve.sampling import SamplingParams


def prefix_skip_key(stats: dict[str, Any]) -> tuple[str, str]:
    """Which core counter says how many prompt tokens a prefix hit saved.

    Prefers a counter of tokens whose compute was actually skipped (the hybrid
    model needs a DeltaNet state checkpoint for that, not just cached KV blocks);
    falls back to the prefix cache's KV hit tokens, and says which one it used."""
    for key in ["prefix_skipped_tokens", *sorted(stats)]:
        if key in stats and "skip" in key and "token" in key:
            return key, f"engine stat {key!r} (prefill tokens skipped)"
    return "prefix_hit_tokens", "engine stat 'prefix_hit_tokens' (KV-matched tokens; no skipped-token counter in this build)"


def phase_report(before: dict[str, float], after: dict[str, float], steps: int,
                 seq_steps: int) -> dict[str, dict[str, float]]:
    """Per phase of the engine's step (``stats()["step_phase_seconds"]`` taken before
    and after a run): microseconds per step and per scheduled sequence per step."""
    out = {}
    for phase, total in after.items():
        sec = total - before.get(phase, 0.0)
        out[phase] = {"us_per_step": 1e6 * sec / max(steps, 1), "us_per_seq": 1e6 * sec / max(seq_steps, 1)}
    return out


class _Timed:
    """Wraps a callable and accumulates its wall time (for the step breakdown)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:  # the wrapped object's other methods
        return getattr(self.fn, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class _TimedScheduler:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.schedule = _Timed(inner.schedule)
        self.update = _Timed(inner.update)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def run_engine(
    engine: Any,
    workload: Workload,
    *,
    temperature: float = 0.0,
    keep_tokens: bool = False,
    progress: bool = True,
    breakdown: bool = False,
) -> tuple[list[RequestRecord], dict[str, Any], list[dict[str, float]], float]:
    """Serve ``workload`` on ``engine``; returns (records, server stats, timeline, duration)."""
    reqs = workload.requests
    records = [
        RequestRecord(r.request_id, r.request_class, r.priority, r.arrival_time, r.prompt_len, r.output_len)
        for r in reqs
    ]
    if breakdown:
        engine.scheduler = _TimedScheduler(engine.scheduler)
        engine.runner.execute = _Timed(engine.runner.execute)
        engine.sampler = _Timed(engine.sampler)
    stats0 = engine.stats()
    skip_key, skip_source = prefix_skip_key(stats0)
    peaks = {"used_blocks": 0, "running_state_pages": 0, "num_running_requests": 0, "num_waiting_requests": 0}
    timeline: list[dict[str, float]] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs), desc="bench", unit="req", leave=False)

    live: dict[int, Any] = {}  # record index -> the engine's RequestState
    nxt = 0
    out_total = 0
    steps = 0
    seq_steps = 0  # sequences scheduled, summed over steps (for per-sequence phase costs)
    saved_emit = engine.emit_unfinished
    engine.emit_unfinished = False
    timeline.append({"t": 0.0, "running": 0, "waiting": 0, "kv_blocks_used": stats0.get("used_blocks", 0),
                     "state_pages_used": stats0.get("running_state_pages", 0), "output_tokens": 0})
    start = time.perf_counter()
    try:
        while nxt < len(reqs) or live:
            now = time.perf_counter() - start
            arrived = nxt
            while nxt < len(reqs) and reqs[nxt].arrival_time <= now:
                r, rec = reqs[nxt], records[nxt]
                params = SamplingParams(temperature=temperature, max_tokens=r.output_len,
                                        ignore_eos=True, seed=workload.seed + nxt)
                try:
                    engine.add_request(f"bench-{r.request_id}", r.prompt, params,
                                       priority=r.priority, request_class=r.request_class)
                    live[nxt] = engine.requests[f"bench-{r.request_id}"]
                except HybridServeError as e:
                    rec.error = f"{type(e).__name__}: {e}"
                    if bar is not None:
                        bar.update(1)
                nxt += 1
            if not live:
                if nxt < len(reqs):
                    time.sleep(max(0.0, reqs[nxt].arrival_time - (time.perf_counter() - start)))
                continue
            if nxt > arrived:
                # A sample at the arrivals, before the step that admits them (which may
                # take seconds): the timeline shows them waiting from the moment they came.
                s = engine.stats()
                timeline.append({
                    "t": now, "running": s.get("num_running_requests", 0),
                    "waiting": s.get("num_waiting_requests", 0), "kv_blocks_used": s.get("used_blocks", 0),
                    "state_slots_used": s.get("used_slots", 0), "output_tokens": out_total,
                })
            engine.step()
            steps += 1
            seq_steps += engine.last_step_stats["num_scheduled_seqs"]
            t = time.perf_counter() - start
            done = []
            for i, state in live.items():
                sample = state.samples[0]
                n = len(sample.token_ids)
                rec = records[i]
                if n > rec.output_tokens:
                    if rec.first_token_time is None:
                        rec.first_token_time = t
                    rec.token_times.append(t)
                    out_total += n - rec.output_tokens
                    rec.output_tokens = n
                if state.finished:
                    rec.finish_time = t
                    rec.ok = sample.finish_reason in ("length", "stop")
                    if not rec.ok:
                        rec.error = f"finished with {sample.finish_reason!r}"
                    rec.prompt_len = len(state.prompt_token_ids)
                    if keep_tokens:
                        rec.token_ids = list(sample.token_ids)
                    done.append(i)
            for i in done:
                del live[i]
            if bar is not None and done:
                bar.update(len(done))
            s = engine.stats()
            for k in peaks:
                peaks[k] = max(peaks[k], int(s.get(k, 0)))
            timeline.append({
                "t": t, "running": s.get("num_running_requests", 0), "waiting": s.get("num_waiting_requests", 0),
                "kv_blocks_used": s.get("used_blocks", 0), "state_pages_used": s.get("running_state_pages", 0),
                "output_tokens": out_total,
            })
    finally:
        engine.emit_unfinished = saved_emit
        for state in live.values():  # an interrupted run leaves nothing queued
            if state.request_id in engine.requests:
                try:
                    engine.abort_request(state.request_id)
                except Exception:  # noqa: BLE001 - keep the error that stopped the run
                    pass
        if bar is not None:
            bar.close()
    duration = max((r.finish_time for r in records if r.finish_time is not None), default=0.0)
    s1 = engine.stats()
    server: dict[str, Any] = {
        "source": "engine stats",
        "steps": steps,
        "preemptions": int(s1.get("preemptions", 0) - stats0.get("preemptions", 0)),
        "peak_kv_blocks_used": peaks["used_blocks"],
        "kv_blocks_total": int(s1.get("num_blocks", 0)),
        "peak_state_pages_used": peaks["running_state_pages"],
        "arena_pages_total": int(s1.get("num_pages", 0)),
        "peak_running": peaks["num_running_requests"],
        "peak_waiting": peaks["num_waiting_requests"],
        "prefix_tokens_skipped": int(s1.get(skip_key, 0) - stats0.get(skip_key, 0)),
        "prefix_tokens_skipped_source": skip_source,
    }
    if "spec_draft_tokens" in s1 and "spec_verify_entries" in s1:
        for key, stat in (("spec_draft_tokens", "spec_draft_tokens"), ("spec_accepted_tokens", "spec_accepted_tokens"),
                          ("spec_verify_runs", "spec_verify_entries")):
            server[key] = int((s1.get(stat) or 0) - (stats0.get(stat) or 0))
    server["step_phases"] = phase_report(stats0.get("step_phase_seconds", {}),
                                         s1.get("step_phase_seconds", {}), steps, seq_steps)
    if breakdown:
        sched = engine.scheduler.schedule.seconds + engine.scheduler.update.seconds
        wall = max(duration, 1e-9)
        server["step_breakdown"] = {
            "scheduler_share": sched / wall,
            "scheduler_us_per_step": 1e6 * sched / max(engine.scheduler.schedule.calls, 1),
            "runner_share": engine.runner.execute.seconds / wall,
            "sampler_share": engine.sampler.seconds / wall,
        }
        engine.scheduler = engine.scheduler._inner
        engine.runner.execute = engine.runner.execute.fn
        engine.sampler = engine.sampler.fn
    return records, server, timeline, duration
