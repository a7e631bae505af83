"""One workload served by llama-server and by hybridserve, one after the other, through
the same streaming client (:func:`hybridserve.bench.http_runner.run_http`), and what
each run measured.

Per run: useful output tokens/s (output tokens / first arrival to last finish), TTFT,
ITL and per-request decode tokens/s ((output - 1) / (E2E - TTFT)) percentiles; for
hybridserve also where its engine steps' time went (``/metrics``:
``step_phase_seconds`` per phase, steps, admission limits), taken before and after.

Output tokens are each server's own count (``usage.completion_tokens``) over every
finished stream, the *empty streams* included (``RequestRecord.empty_stream``: finished,
tokens counted, no text chunk). llama-server sends those when the random-weight model
repeats a UTF-8 lead byte: it holds back an incomplete trailing character and drops it
at the end of a stream. ``empty_streams`` counts them per run and ``text_tok_s`` is the
rate over the streams that delivered text, for comparison; the TTFT percentiles cover the
streams that delivered text (``per_request`` lets the caller pick a common set).

TTFT split (means over the run's requests): ``prefill_ms``, the request's own prefill as
the server measured it (llama-server: ``timings.prompt_ms`` of each stream's last chunk;
hybridserve: its TTFT histogram's mean less its queue-time histogram's mean, i.e. first
schedule to first token), and ``wait_ms``, the client's TTFT less that prefill: queueing
behind other requests plus HTTP.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.bench.http_runner import run_http
from hybridserve.bench.report import summarize
from hybridserve.bench.workload import Workload, generate_workload

from .servers import Server


def peer_workload(num_prompts: int, seed: int = 0) -> Workload:
    """Issue 22's workload: prompts 64-256 tokens, outputs 32-96, all at t=0."""
    return generate_workload(num_prompts=num_prompts, seed=seed, prompt_len=(64, 256), output_len=(32, 96),
                             request_rate=float("inf"))


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` keyed ``name{label=value,...}`` (empty if none)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def engine_profile(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """hybridserve's step accounting over the run: steps, seconds and ms/step per phase,
    and how often admission was held back by each limit."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = d("hybridserve:engine_steps_total")
    phases = {}
    for key in after:
        if key.startswith("hybridserve:step_phase_seconds_sum{"):
            phase = key.split("phase=", 1)[1].rstrip("}")
            phases[phase] = {"seconds": round(d(key), 3), "ms_per_step": round(1e3 * d(key) / max(steps, 1), 2)}
    limits = {key.split("{", 1)[1].rstrip("}"): d(key) for key in after
              if key.startswith("hybridserve:admission_limited_total{")}
    return {"steps": int(steps), "phases": phases, "admission_limited": limits,
            "preemptions": d("hybridserve:num_preemptions_total")}


def _warm_up(server: Server) -> None:
    """One short request, so that first-call costs (thread pools, allocations) are not
    charged to the measured run."""
    wl = generate_workload(num_prompts=1, seed=99, prompt_len=(64, 64), output_len=(8, 8))
    asyncio.run(run_http(server.url, wl, send_class_fields=False, progress=False))


class _PeakRSS:
    """Samples a server's resident memory in a thread while the workload runs."""

    def __init__(self, server: Server, every_s: float = 0.25):
        self.server, self.every_s, self.peak = server, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.rss_bytes())
            self._stop.wait(self.every_s)

    def __enter__(self) -> "_PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.server.rss_bytes())


def measure(server: Server, workload: Workload) -> dict[str, Any]:
    """Start ``server``, warm it up, run ``workload``, stop it; the run's numbers, with
    the server's resident memory after the warm-up (``rss_loaded_bytes``: weights, cache
    and runtime as loaded) and at its peak during the run (``rss_peak_bytes``)."""
    load = os.getloadavg()
    with server:
        _warm_up(server)
        rss_loaded = server.rss_bytes()
        before = scrape(server.url)
        t0 = time.time()
        with _PeakRSS(server) as rss:
            records, _srv, _timeline, duration = asyncio.run(
                run_http(server.url, workload, send_class_fields=False, progress=False))
        after = scrape(server.url)
    ok = [r for r in records if r.ok]
    errors = sorted({r.error for r in records if r.error})
    decode = [x for x in map(_decode_rate, ok) if x is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    text_tokens = sum(r.output_tokens for r in ok if not r.empty_stream)
    res: dict[str, Any] = {
        "server": server.name, "started_utc": time.strftime("%H:%M:%S", time.gmtime(t0)),
        "load_avg_1m_before": round(load[0], 2), "completed": len(ok), "failed": len(records) - len(ok),
        "empty_streams": sum(1 for r in ok if r.empty_stream),
        "errors": errors[:3], "duration_s": round(duration, 3), "output_tokens": out_tokens,
        "useful_tok_s": out_tokens / max(duration, 1e-9),
        "text_tok_s": text_tokens / max(duration, 1e-9),
        "ttft_s": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": summarize([x for r in ok for x in r.itls]),
        "decode_tok_s_per_request": summarize(decode),
        "rss_loaded_bytes": rss_loaded, "rss_peak_bytes": rss.peak,
        "per_request": {r.request_id: {"ttft_s": r.ttft, "itl_s": r.itls, "decode_tok_s": _decode_rate(r),
                                       "empty": r.empty_stream, "ok": r.ok,
                                       "prompt_tokens": r.prompt_len, "output_tokens": r.output_tokens,
                                       "finish_reason": r.finish_reason,
                                       "prompt_ms": (r.server_timings or {}).get("prompt_ms")}
                        for r in records},
    }
    res["ttft_split"] = ttft_split(records, before, after)
    if server.name == "hybridserve":
        res["engine"] = engine_profile(before, after)
    return res


def _decode_rate(r: Any) -> float | None:
    """A request's decode tokens/s after its first token: (output - 1) / (E2E - TTFT)."""
    if not r.ok or r.output_tokens < 2 or r.e2e is None or r.ttft is None or r.e2e <= r.ttft:
        return None
    return (r.output_tokens - 1) / (r.e2e - r.ttft)


def _hist_delta(before: dict[str, float], after: dict[str, float], name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over the run, summed over its labels."""
    out = [0.0, 0.0]
    for key, v in after.items():
        for i, suffix in enumerate(("_sum", "_count")):
            if key == name + suffix or key.startswith(name + suffix + "{"):
                out[i] += v - before.get(key, 0.0)
    return out[0], out[1]


def ttft_split(records: list, before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """The run's mean TTFT split into the request's own prefill (the server's measure) and
    the rest (queueing behind other requests, HTTP); None when the server reports neither
    per-request timings nor the two histograms."""
    with_ttft = [r for r in records if r.ok and r.ttft is not None]
    if not with_ttft:
        return None
    ttft_ms = 1e3 * float(np.mean([r.ttft for r in with_ttft]))
    timed = [r for r in with_ttft if (r.server_timings or {}).get("prompt_ms") is not None]
    if timed:  # llama-server: every stream's last chunk has its timings
        prefill_ms = float(np.mean([r.server_timings["prompt_ms"] for r in timed]))
        prompt_tokens = float(np.mean([r.server_timings.get("prompt_n", r.prompt_len) for r in timed]))
        source = "timings.prompt_ms per stream"
        ttft_ms = 1e3 * float(np.mean([r.ttft for r in timed]))
    else:
        q_sum, q_n = _hist_delta(before, after, "hybridserve:request_queue_time_seconds")
        t_sum, t_n = _hist_delta(before, after, "hybridserve:time_to_first_token_seconds")
        if not q_n or not t_n:
            return None
        prefill_ms = 1e3 * (t_sum / t_n - q_sum / q_n)
        prompt_tokens = float(np.mean([r.prompt_len for r in with_ttft]))
        source = "time_to_first_token - request_queue_time histograms (means)"
    return {"ttft_ms": round(ttft_ms, 1), "prefill_ms": round(prefill_ms, 1), "wait_ms": round(ttft_ms - prefill_ms, 1),
            "prompt_tokens": round(prompt_tokens, 1),
            "prefill_tok_s": round(1e3 * prompt_tokens / prefill_ms, 1) if prefill_ms > 0 else None,
            "source": source}


def percentile_over(runs: list[dict[str, Any]], exclude: set[str], key: str, q: float = 50.0) -> list[float]:
    """Per run, the percentile ``q`` of ``per_request[...][key]`` (``ttft_s``, or the
    list ``itl_s``) over the requests not in ``exclude``: the ones some run of either
    server streamed no text for (llama-server's empty streams; hybridserve streams those
    as U+FFFD, four tokens to a chunk), so both servers' latencies cover the same requests."""
    out = []
    for run in runs:
        vals: list[float] = []
        for rid, v in run.get("per_request", {}).items():
            x = v.get(key)
            if rid in exclude or x is None:
                continue
            vals.extend(x if isinstance(x, list) else [x])
        if vals:
            out.append(float(np.percentile(vals, q)))
    return out


def median_of(runs: list[dict[str, Any]], path: tuple[str, ...]) -> float | None:
    vals = []
    for r in runs:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            vals.append(float(v))
    return float(np.median(vals)) if vals else None
