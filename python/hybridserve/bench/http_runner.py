"""Run a workload against a live OpenAI-compatible server (``bench serve``).

Each request is a streaming ``POST /v1/completions`` (token-id prompt, ``ignore_eos``,
``stream_options.include_usage``) sent at its arrival time; every SSE chunk that
carries text is one token delivery for the latency numbers, and the final usage
chunk gives the exact output token count. A stream that finishes (a ``finish_reason``
or ``[DONE]``) with output tokens but without any text chunk is an *empty stream*
(``RequestRecord.empty_stream``): it completed and its tokens count, but it has no
TTFT or ITL. Meanwhile ``GET /metrics`` is polled for
the server's pool and queue gauges and counters (``hybridserve:`` names, or vLLM's
``vllm:`` names for the subset vLLM exposes); a server without ``/metrics`` leaves
those fields null. A hybridserve server's step phases (the ``step_phase_seconds``
histogram by ``phase``, and ``step_scheduled_seqs_total``) read before and after the
run give the same per-step and per-sequence phase costs as ``bench throughput``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.bench.engine_runner import phase_report
from hybridserve.bench.report import RequestRecord
from hybridserve.bench.workload import Workload


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: ``{name: value}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


_PHASES = "hybridserve:step_phase_seconds"
_SEQ_STEPS = "hybridserve:step_scheduled_seqs_total"


def parse_phase_seconds(text: str) -> dict[str, tuple[float, float]]:
    """``{phase: (seconds, steps)}``: the sums and counts of the ``step_phase_seconds``
    histogram by its ``phase`` label (empty when the server has none)."""
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != _PHASES:
            continue
        for smp in fam.samples:
            phase = smp.labels.get("phase")
            if phase is None:
                continue
            cell = out.setdefault(phase, [0.0, 0.0])
            if smp.name == _PHASES + "_sum":
                cell[0] = smp.value
            elif smp.name == _PHASES + "_count":
                cell[1] = smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


# (our key, hybridserve metric, vLLM metric)
_GAUGES = [
    ("running", "hybridserve:num_requests_running", "vllm:num_requests_running"),
    ("waiting", "hybridserve:num_requests_waiting", "vllm:num_requests_waiting"),
    ("kv_blocks_used", "hybridserve:kv_blocks_used", None),
    ("kv_blocks_total", "hybridserve:kv_blocks_total", None),
    ("state_pages_used", "hybridserve:arena_pages_running_state", None),
    ("arena_pages_total", "hybridserve:arena_pages_total", None),
]
_COUNTERS = [
    ("preemptions", "hybridserve:num_preemptions_total", "vllm:num_preemptions_total"),
    # Speculative decoding (servers that draft; vLLM's names as the fallback).
    ("spec_draft_tokens", "hybridserve:spec_decode_num_draft_tokens_total",
     "vllm:spec_decode_num_draft_tokens_total"),
    ("spec_accepted_tokens", "hybridserve:spec_decode_num_accepted_tokens_total",
     "vllm:spec_decode_num_accepted_tokens_total"),
    ("spec_verify_runs", "hybridserve:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
]


def _get(m: dict[str, float], *names: str | None) -> float | None:
    for n in names:
        if n is not None and n in m:
            return m[n]
    return None


def _skip_metric(m: dict[str, float]) -> tuple[str | None, str | None]:
    for name in ["hybridserve:prefix_cache_skipped_tokens_total", *sorted(m)]:
        if name in m and name.startswith("hybridserve:") and "skip" in name and "token" in name \
                and name.endswith("_total"):
            return name, f"metric {name} (prefill tokens skipped)"
    if "hybridserve:prefix_cache_hit_tokens_total" in m:
        return ("hybridserve:prefix_cache_hit_tokens_total",
                "metric hybridserve:prefix_cache_hit_tokens_total (KV-matched tokens; no skipped-token metric on this server)")
    if "vllm:prefix_cache_hits_total" in m:
        return "vllm:prefix_cache_hits_total", "metric vllm:prefix_cache_hits_total (cached prompt tokens)"
    return None, None


class _MetricsPoller:
    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float, start: float) -> None:
        self.session, self.url, self.interval, self.start = session, url, interval, start
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self.peaks: dict[str, float] = {}
        self.timeline: list[dict[str, float]] = []
        self.delivered = 0  # token deliveries seen by the client so far
        self.available = True
        self.first_phases: dict[str, tuple[float, float]] = {}
        self.last_phases: dict[str, tuple[float, float]] = {}

    async def poll_once(self) -> None:
        try:
            async with self.session.get(self.url) as resp:
                if resp.status != 200:
                    self.available = False
                    return
                text = await resp.text()
        except aiohttp.ClientError:
            self.available = False
            return
        m = parse_metrics(text)
        phases = parse_phase_seconds(text)
        if self.first is None:
            self.first, self.first_phases = m, phases
        self.last, self.last_phases = m, phases
        point: dict[str, float] = {"t": time.perf_counter() - self.start, "output_tokens": self.delivered}
        for key, ours, vllm in _GAUGES:
            v = _get(m, ours, vllm)
            if v is not None:
                point[key] = v
                self.peaks[key] = max(self.peaks.get(key, v), v)
        self.timeline.append(point)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll_once()
            if not self.available:
                return
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def _phases(self, a: dict[str, float], b: dict[str, float]) -> dict[str, dict[str, float]] | None:
        """Per phase, microseconds per step and per scheduled sequence per step over
        the run (None: the server does not export its step phases)."""
        if not self.last_phases or _SEQ_STEPS not in b:
            return None
        before = {k: v[0] for k, v in self.first_phases.items()}
        after = {k: v[0] for k, v in self.last_phases.items()}
        steps = max(int(v[1] - self.first_phases.get(k, (0.0, 0.0))[1]) for k, v in self.last_phases.items())
        return phase_report(before, after, steps, int(b[_SEQ_STEPS] - a.get(_SEQ_STEPS, 0.0)))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": "GET /metrics" if self.first is not None else "no /metrics on this server",
            "steps": None,
            "preemptions": None,
            "peak_kv_blocks_used": self.peaks.get("kv_blocks_used"),
            "kv_blocks_total": self.peaks.get("kv_blocks_total"),
            "peak_state_pages_used": self.peaks.get("state_pages_used"),
            "arena_pages_total": self.peaks.get("arena_pages_total"),
            "peak_running": self.peaks.get("running"),
            "peak_waiting": self.peaks.get("waiting"),
            "prefix_tokens_skipped": None,
            "prefix_tokens_skipped_source": None,
        }
        if self.first is None or self.last is None:
            return out
        a, b = self.first, self.last
        for key, ours, vllm in _COUNTERS:
            v0, v1 = _get(a, ours, vllm), _get(b, ours, vllm)
            if v0 is not None and v1 is not None:
                out[key] = int(v1 - v0)
        steps0, steps1 = _get(a, "hybridserve:engine_steps_total"), _get(b, "hybridserve:engine_steps_total")
        if steps0 is not None and steps1 is not None:
            out["steps"] = int(steps1 - steps0)
        out["step_phases"] = self._phases(a, b)
        name, source = _skip_metric(b)
        if name is not None:
            out["prefix_tokens_skipped"] = int(b[name] - a.get(name, 0.0))
            out["prefix_tokens_skipped_source"] = source
        return out


async def _one(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], rec: RequestRecord,
    start: float, poller: _MetricsPoller, keep_raw_sse: bool = False,
) -> None:
    delay = rec.arrival_time - (time.perf_counter() - start)
    if delay > 0:
        await asyncio.sleep(delay)
    if keep_raw_sse:
        rec.raw_sse = []
    done = False  # the stream said it was complete: a finish_reason or [DONE]
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = await resp.text()
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec.error = f"HTTP {resp.status}: {str(body)[:300]}"
                return
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if rec.raw_sse is not None and line:
                    rec.raw_sse.append((time.perf_counter() - start, line))
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"in-stream error: {chunk['error'].get('message', chunk['error'])}"
                    return
                if chunk.get("usage"):
                    rec.usage_tokens = chunk["usage"].get("completion_tokens")
                    if chunk["usage"].get("prompt_tokens"):
                        rec.prompt_len = int(chunk["usage"]["prompt_tokens"])
                if isinstance(chunk.get("timings"), dict):
                    rec.server_timings = chunk["timings"]
                choices = chunk.get("choices") or []
                for c in choices:
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                        done = True
                if any(c.get("text") for c in choices):
                    t = time.perf_counter() - start
                    if rec.first_token_time is None:
                        rec.first_token_time = t
                    rec.token_times.append(t)
                    poller.delivered += 1
        rec.finish_time = time.perf_counter() - start
        rec.output_tokens = int(rec.usage_tokens) if rec.usage_tokens is not None else len(rec.token_times)
        # A finished stream with tokens but no text is an empty stream (``rec.empty_stream``):
        # the server did the work and says so. A stream cut off before any text and before
        # its end fails.
        rec.ok = rec.first_token_time is not None or done
        if not rec.ok:
            rec.error = "the stream ended without any token and without a finish_reason"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_http(
    base_url: str,
    workload: Workload,
    *,
    model: str | None = None,
    temperature: float = 0.0,
    send_class_fields: bool = True,
    max_concurrency: int | None = None,
    metrics_interval: float = 0.25,
    timeout_s: float = 3600.0,
    progress: bool = True,
    keep_raw_sse: bool = False,
) -> tuple[list[RequestRecord], dict[str, Any], list[dict[str, float]], float]:
    """Send ``workload`` to ``base_url``; returns (records, server stats, timeline, duration).

    ``keep_raw_sse`` keeps every non-empty line of each stream, timestamped, in
    ``RequestRecord.raw_sse`` (for finding out what a server sent)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    records = [
        RequestRecord(r.request_id, r.request_class, r.priority, r.arrival_time, r.prompt_len, r.output_len)
        for r in workload.requests
    ]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            try:
                async with session.get(f"{base}/v1/models") as resp:
                    data = await resp.json()
                    model = data["data"][0]["id"]
            except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
                raise ConnectionError(f"cannot list models at {base}/v1/models ({e}); is the server up? "
                                      "Give --model if it has no /v1/models") from None
        start = time.perf_counter()
        poller = _MetricsPoller(session, f"{base}/metrics", metrics_interval, start)
        await poller.poll_once()
        stop = asyncio.Event()
        poll_task = asyncio.create_task(poller.run(stop))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(records), desc="bench", unit="req", leave=False)
        tasks = []
        for r, rec in zip(workload.requests, records):
            payload: dict[str, Any] = {
                "model": model, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }
            if send_class_fields:
                payload["priority"] = r.priority
                payload["request_class"] = r.request_class
            task = asyncio.create_task(_one(session, f"{base}/v1/completions", payload, rec, start, poller,
                                            keep_raw_sse))
            if bar is not None:
                task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
        duration = max((r.finish_time for r in records if r.finish_time is not None), default=0.0)
        stop.set()
        await poll_task
        await poller.poll_once()  # counters after the last request
        if bar is not None:
            bar.close()
    server = poller.summary()
    server["model"] = model
    return records, server, poller.timeline, duration
