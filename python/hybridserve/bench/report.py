"""What one benchmark run measured: per-request records in, one JSON document and a
table out, overall and per request class (so that throughput cannot hide a class
starving).

Latencies are in seconds in the JSON and milliseconds in the table. Definitions
(vLLM's): TTFT = first output token - scheduled arrival; ITL = gaps between a
request's consecutive token deliveries (one per step in-process, one per SSE chunk
over HTTP); TPOT = (E2E - TTFT) / (output tokens - 1); E2E = finish - arrival.
Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft_s", "itl_s", "tpot_s", "e2e_s")


@dataclass
class RequestRecord:
    request_id: str
    request_class: str
    priority: int
    arrival_time: float
    prompt_len: int
    output_len: int  # tokens asked for
    ok: bool = False
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per delivery
    output_tokens: int = 0
    token_ids: list[int] | None = None
    # Over HTTP: what the stream's last chunks said. ``usage_tokens`` is the server's own
    # count (usage.completion_tokens); ``server_timings`` is llama-server's per-request
    # ``timings`` object (prompt_n, prompt_ms, predicted_n, ...) when the server sends one.
    finish_reason: str | None = None
    usage_tokens: int | None = None
    server_timings: dict[str, Any] | None = None
    raw_sse: list[tuple[float, str]] | None = None  # (seconds since start, line), when asked for

    @property
    def empty_stream(self) -> bool:
        """The server finished the request and counted its output tokens, but no chunk
        carried text: llama-server holds back a trailing incomplete UTF-8 character until it
        completes, and drops it at the end of a stream, so a model that repeats a UTF-8 lead
        byte streams nothing. Its tokens count; it has no TTFT or ITL."""
        return self.ok and self.first_token_time is None and self.output_tokens > 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "request_class": self.request_class,
            "priority": self.priority,
            "arrival_time": self.arrival_time,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "output_tokens": self.output_tokens,
            "ok": self.ok,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "empty_stream": self.empty_stream,
            "ttft_s": self.ttft,
            "e2e_s": self.e2e,
            "tpot_s": self.tpot,
        }


def summarize(values: list[float] | np.ndarray) -> dict[str, float | None]:
    """mean, p50, p90, p99 of ``values`` (None for each when empty)."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def _slice(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    d = max(duration, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "empty_streams": sum(1 for r in ok if r.empty_stream),
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / d,
        "request_throughput_req_s": len(ok) / d,
        "ttft_s": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": summarize([x for r in ok for x in r.itls]),
        "tpot_s": summarize([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": summarize([r.e2e for r in ok if r.e2e is not None]),
    }


def build_report(
    records: list[RequestRecord],
    *,
    duration: float,
    class_names: list[str],
    mode: str,
    config: dict[str, Any],
    server: dict[str, Any],
    timeline: list[dict[str, float]],
) -> dict[str, Any]:
    """The JSON document of a run (every key always present; unknowns are null)."""
    return {
        "mode": mode,
        "config": config,
        "duration_s": duration,
        "overall": _slice(records, duration),
        "classes": {
            name: _slice([r for r in records if r.request_class == name], duration) for name in class_names
        },
        "server": server,
        "timeline": timeline,
        "requests": [r.to_dict() for r in records],
        "errors": sorted({r.error for r in records if r.error}),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _num(x: Any, fmt: str = "{:,.1f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x) if isinstance(x, (int, float)) else str(x)


def render_table(report: dict[str, Any]) -> str:
    """The human table printed on stdout."""
    rows = [("overall", report["overall"])] + list(report["classes"].items())
    if len(rows) == 2:
        rows = rows[:1]  # one class: its row is the overall row
    head = ["class", "done", "fail", "out tok/s", "req/s"]
    for m in ("ttft", "itl", "e2e"):
        head += [f"{m} mean", f"{m} p50", f"{m} p90", f"{m} p99"]
    lines = []
    table = [head]
    for name, s in rows:
        row = [name, str(s["completed"]), str(s["failed"]), _num(s["output_throughput_tok_s"]),
               _num(s["request_throughput_req_s"], "{:.2f}")]
        for m in ("ttft_s", "itl_s", "e2e_s"):
            row += [_ms(s[m]["mean"])] + [_ms(s[m][f"p{p}"]) for p in PERCENTILES]
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    threads = report["config"].get("torch_threads")
    lines.append(f"hybridserve bench {report['mode']}: {report['duration_s']:.2f} s, latencies in ms"
                 + (f", torch threads {threads}" if threads else ""))
    for r in table:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    srv = report["server"]
    lines.append(
        "server: preemptions {} | peak KV blocks {} / {} | peak DeltaNet state pages {} / {} arena pages | "
        "peak running {} waiting {} | prefix tokens skipped {} ({})".format(
            _num(srv.get("preemptions"), "{:,}"), _num(srv.get("peak_kv_blocks_used"), "{:,.0f}"),
            _num(srv.get("kv_blocks_total"), "{:,.0f}"), _num(srv.get("peak_state_pages_used"), "{:,.0f}"),
            _num(srv.get("arena_pages_total"), "{:,.0f}"), _num(srv.get("peak_running"), "{:,.0f}"),
            _num(srv.get("peak_waiting"), "{:,.0f}"), _num(srv.get("prefix_tokens_skipped"), "{:,.0f}"),
            srv.get("prefix_tokens_skipped_source") or "not reported",
        )
    )
    drafts = srv.get("spec_draft_tokens")
    if drafts is not None:
        kept = srv.get("spec_accepted_tokens") or 0
        runs = srv.get("spec_verify_runs") or 0
        lines.append(
            "speculative decoding: {} drafts, {} accepted ({}) | mean accepted length {}".format(
                _num(drafts, "{:,}"), _num(kept, "{:,}"),
                f"{100 * kept / drafts:.1f} %" if drafts else "-",
                f"{1 + kept / runs:.2f}" if runs else "-"))
    phases = srv.get("step_phases")
    if phases:
        lines.append("step phases, us per step / per sequence: " + " | ".join(
            f"{name} {v['us_per_step']:.0f} / {v['us_per_seq']:.1f}" for name, v in phases.items()))
    b = srv.get("step_breakdown")
    if b:
        lines.append(
            f"wall time: scheduler {100 * b['scheduler_share']:.2f} % ({b['scheduler_us_per_step']:.1f} us/step), "
            f"runner {100 * b['runner_share']:.1f} %, sampler {100 * b['sampler_share']:.1f} %"
        )
    empty = report["overall"].get("empty_streams")
    if empty:
        lines.append(f"empty streams: {empty} finished with output tokens but no text chunk (no TTFT / ITL; "
                     "their tokens count in out tok/s)")
    if report.get("errors"):
        lines.append("errors: " + "; ".join(report["errors"][:5]))
    return "\n".join(lines)


def downsample(timeline: list[dict[str, float]], max_points: int = 2000) -> list[dict[str, float]]:
    """Keep at most ``max_points`` evenly spaced samples (the last always kept)."""
    if len(timeline) <= max_points:
        return timeline
    idx = np.linspace(0, len(timeline) - 1, max_points).round().astype(int)
    return [timeline[i] for i in sorted(set(idx.tolist()))]
