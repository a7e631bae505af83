"""Prometheus metrics of one engine (names prefixed ``hybridserve:``).

Two sources, one registry:

* the Rust core's counters and gauges (blocks, slots, prefix cache, preemptions,
  queue sizes), read as one snapshot per scrape by a custom collector, so a scrape
  costs one ``stats()`` call and the core stays the single source of truth;
* per-request latencies observed on the engine thread after each step: queue delay,
  time to first token, inter-token latency and end-to-end latency, each labelled
  with the request's class so that throughput cannot hide one class starving.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "hybridserve:"

# (stats key, metric name, help) — cumulative counters of the core.
_COUNTERS = [
    ("alloc_failures", "block_allocation_failures", "KV block allocations refused for lack of free blocks"),
    ("prefix_queries", "prefix_cache_queries", "Prefix-cache lookups (one per admitted sequence)"),
    ("prefix_query_tokens", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hits", "prefix_cache_hits", "Lookups that reused at least one cached block"),
    ("prefix_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens served from cached blocks"),
    ("evictions", "prefix_cache_evictions", "Cached blocks evicted to satisfy an allocation"),
    ("prefix_skipped_tokens", "prefix_cache_skipped_tokens",
     "Prompt tokens not computed at all: a DeltaNet state checkpoint ended their prefix"),
    ("prefix_lost_tokens", "prefix_cache_lost_tokens",
     "Prompt tokens with cached KV recomputed for want of a DeltaNet checkpoint at their end"),
    ("checkpoint_queries", "state_checkpoint_queries", "Admissions that looked for a DeltaNet state checkpoint"),
    ("checkpoint_hits", "state_checkpoint_hits", "Admissions that resumed from a DeltaNet state checkpoint"),
    ("checkpoint_writes", "state_checkpoint_writes", "DeltaNet state checkpoints written"),
    ("checkpoint_writes_skipped", "state_checkpoint_writes_skipped",
     "DeltaNet checkpoint writes skipped: every state slot held by a sequence"),
    ("checkpoint_evictions", "state_checkpoint_evictions",
     "DeltaNet checkpoints evicted for room (compute saved per byte, then recency)"),
    ("checkpoint_drops", "state_checkpoint_drops", "DeltaNet checkpoints dropped because their KV chain was evicted"),
    ("cow_copies", "copy_on_write_blocks", "Blocks copied on write (shared tail appended to)"),
    ("preemptions", "num_preemptions", "Requests preempted (recomputed later), all causes"),
    ("state_fork_copies", "state_slot_fork_copies",
     "DeltaNet state slots copied by forks: n > 1 samples from their parent, beams re-parented"),
    ("steps", "engine_steps", "Scheduler steps"),
    ("finished_requests", "finished_requests", "Requests finished (stop or length)"),
    ("aborted_requests", "aborted_requests", "Requests aborted (client gone or cancelled)"),
]
# (stats key, metric name, help) — gauges of the core.
_GAUGES = [
    ("num_blocks", "kv_blocks_total", "KV blocks in the pool"),
    ("free_blocks", "kv_blocks_free", "KV blocks allocatable now (free + unreferenced cached)"),
    ("used_blocks", "kv_blocks_used", "KV blocks referenced by sequences"),
    ("cached_blocks", "kv_blocks_cached", "Unreferenced blocks kept for prefix reuse"),
    ("reserved_blocks", "kv_blocks_reserved", "Blocks reserved by the reserve-max admission policy"),
    ("tail_waste", "kv_tail_waste_slots", "Unused token slots in the last blocks of running sequences"),
    ("shared_blocks", "kv_blocks_shared",
     "KV blocks referenced by more than one running sequence (samples, beams, a common prefix)"),
    ("num_slots", "state_slots_total", "DeltaNet state slots in the pool"),
    ("free_slots", "state_slots_free", "DeltaNet state slots allocatable now (free + reclaimable checkpoints)"),
    ("checkpoint_slots", "state_slots_checkpoint", "DeltaNet state slots holding prefix checkpoints (reclaimable)"),
    ("used_slots", "state_slots_used", "DeltaNet state slots held by sequences"),
    ("num_running_requests", "num_requests_running", "Requests running"),
    ("num_running_seqs", "num_seqs_running", "Sequences running (n > 1 requests count n)"),
    ("num_waiting_requests", "num_requests_waiting", "Requests waiting"),
    ("waiting_tokens", "num_tokens_waiting", "Prompt tokens of waiting requests"),
    ("last_step_tokens", "step_batched_tokens", "Tokens in the last step's batch"),
    ("last_step_seqs", "step_batched_seqs", "Sequences in the last step's batch"),
]

# Step phases run from microseconds (a schedule) to seconds (a long prefill's forward).
_PHASE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _CoreCollector:
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snap = dict(self.snapshot)
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(snap.get(key, 0)))
            yield c
        for key, name, doc in _GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(snap.get(key, 0)))
            yield g
        c = CounterMetricFamily(PREFIX + "preemptions_by_cause", "Requests preempted, by cause "
                                "(blocks_needed, priority) and the victim's request_class",
                                labels=["cause", "request_class"])
        for cause, klass, n in snap.get("preemptions_by", ()):
            c.add_metric([cause, klass], float(n))
        yield c
        total = float(snap.get("num_blocks", 0)) or 1.0
        g = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        g.add_metric([], float(snap.get("used_blocks", 0)) / total)
        yield g
        q = float(snap.get("prefix_query_tokens", 0))
        g = GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prompt tokens served from cache / looked up")
        g.add_metric([], float(snap.get("prefix_hit_tokens", 0)) / q if q else 0.0)
        yield g
        # The rate that moves time to first token on a hybrid model: KV hits count
        # only as far as a state checkpoint lets the prefill skip them.
        g = GaugeMetricFamily(PREFIX + "prefix_cache_skip_rate",
                              "Prompt tokens whose compute was skipped / looked up")
        g.add_metric([], float(snap.get("prefix_skipped_tokens", 0)) / q if q else 0.0)
        yield g


class EngineMetrics:
    """Holds the registry; ``observe_step`` and ``refresh`` run on the engine thread.

    The core's snapshot is taken per scrape (``refresh``), not per step: a step
    only records latencies, so serving pays nothing for gauges nobody reads.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._core = _CoreCollector()
        self.registry.register(self._core)
        labels = ["request_class"]
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first schedule", labels,
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token", labels,
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between a request's consecutive steps that produced tokens",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish", labels,
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        # Per engine step, the wall time of each phase (schedule, prepare_inputs,
        # forward, sample, process_outputs): where a step's time goes.
        self.step_phase = Histogram(
            PREFIX + "step_phase_seconds", "Wall time of one engine step's phase", ["phase"],
            registry=self.registry, buckets=_PHASE_BUCKETS)
        self._last_token: dict[str, float] = {}
        self._seen_first: set[str] = set()

    def refresh(self, engine: Any) -> None:
        snap = engine.stats()
        with self._core.lock:
            self._core.snapshot = snap

    def observe_step(self, engine: Any, outputs: list[Any]) -> None:
        for phase, seconds in engine.last_step_stats.get("phase_seconds", {}).items():
            self.step_phase.labels(phase).observe(seconds)
        for out in outputs:
            m = out.metrics
            if m is None:
                continue
            klass = m.request_class
            rid = out.request_id
            if rid not in self._seen_first and m.first_token_time is not None:
                self._seen_first.add(rid)
                if m.queue_delay is not None:
                    self.queue_time.labels(klass).observe(m.queue_delay)
                self.ttft.labels(klass).observe(m.first_token_time - m.arrival_time)
            elif m.last_token_time is not None and rid in self._last_token:
                self.itl.labels(klass).observe(m.last_token_time - self._last_token[rid])
            if m.last_token_time is not None:
                self._last_token[rid] = m.last_token_time
            if out.finished:
                if m.finished_time is not None:
                    self.e2e.labels(klass).observe(m.finished_time - m.arrival_time)
                self._last_token.pop(rid, None)
                self._seen_first.discard(rid)
        # Aborted requests never report a finished output: forget them in bulk.
        if len(self._last_token) > len(engine.requests) + 1024:
            live = engine.requests.keys()
            self._last_token = {r: t for r, t in self._last_token.items() if r in live}
            self._seen_first &= set(live)

    def render(self) -> bytes:
        return generate_latest(self.registry)
