"""Prometheus metrics of one engine (names prefixed ``hybridserve:``).

Two sources, one registry:

* the Rust core's counters and gauges (arena pages by use, prefix cache,
  checkpoints, preemptions, what limited admission, queue sizes), read as one snapshot per scrape by a custom collector, so a scrape
  costs one ``stats()`` call and the core stays the single source of truth;
* per-request latencies observed on the engine thread after each step: queue delay,
  time to first token, inter-token latency and end-to-end latency, each labelled
  with the request's class so that throughput cannot hide one class starving.

``request_class`` comes from clients, and every distinct value adds a set of series
(~57 lines) to every scrape: its cardinality is bounded, as Prometheus practice asks.
Either the operator names the classes (``request_classes``; any other value is counted
as ``other``) or the first ``max_request_classes`` distinct values get their own label
and later ones are counted as ``other``.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "hybridserve:"

# The label for request classes beyond the configured set or the cap.
OTHER_CLASS = "other"
DEFAULT_MAX_REQUEST_CLASSES = 16


class RequestClassLabels:
    """Maps a request's class to its metrics label, bounding the label's values."""

    def __init__(self, request_classes: "list[str] | None" = None,
                 max_request_classes: int = DEFAULT_MAX_REQUEST_CLASSES) -> None:
        if max_request_classes < 1:
            raise ValueError(f"max_request_classes must be >= 1, got {max_request_classes}")
        self.fixed = request_classes is not None
        self.max = max_request_classes
        self._known: set[str] = set(request_classes or ()) | {"default"}
        self._lock = threading.Lock()

    def __call__(self, klass: str) -> str:
        if klass in self._known:
            return klass
        if self.fixed:
            return OTHER_CLASS
        with self._lock:
            # "default" is always known and does not count against the cap.
            if len(self._known) - 1 < self.max:
                self._known.add(klass)
                return klass
        return OTHER_CLASS

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
     "DeltaNet checkpoint writes skipped: no arena pages free or reclaimable"),
    ("checkpoint_evictions", "state_checkpoint_evictions",
     "DeltaNet checkpoints evicted for room (compute saved per byte, then recency)"),
    ("checkpoint_drops", "state_checkpoint_drops", "DeltaNet checkpoints dropped because their KV chain was evicted"),
    ("cow_copies", "copy_on_write_blocks", "Blocks copied on write (shared tail appended to)"),
    ("preemptions", "num_preemptions", "Requests preempted (recomputed later), all causes"),
    ("state_fork_copies", "state_fork_copies",
     "DeltaNet states copied by forks: n > 1 samples from their parent, beams re-parented"),
    ("steps", "engine_steps", "Scheduler steps"),
    ("finished_requests", "finished_requests", "Requests finished (stop or length)"),
    ("aborted_requests", "aborted_requests", "Requests aborted (client gone or cancelled)"),
    ("failed_steps", "failed_steps", "Engine steps that raised and were rolled back"),
    ("retried_requests", "retried_requests", "Requests caught in a failed step and retried from their committed tokens"),
    ("errored_requests", "errored_requests",
     "Requests ended with finish_reason 'error' (caught in a second failed step, or after the update)"),
]
# (stats key, metric name, help) — gauges of the core.
_GAUGES = [
    ("num_pages", "arena_pages_total", "Pages of the one cache arena (KV blocks, DeltaNet state, checkpoints)"),
    ("available_pages", "arena_pages_available",
     "Pages a new request could get now: free + cached blocks + evictable checkpoints"),
    ("page_bytes", "arena_page_bytes", "Bytes of one arena page"),
    ("pages_per_state", "arena_pages_per_state", "Pages one DeltaNet state (a sequence's or a checkpoint's) takes"),
    ("padding_bytes", "arena_padding_bytes",
     "Bytes of the pages in use that hold nothing (layout padding of KV pages and state pages)"),
    ("num_blocks", "kv_blocks_total", "Arena pages (every page can be a KV block)"),
    ("free_blocks", "kv_blocks_free", "Pages allocatable as KV blocks now (free + unreferenced cached)"),
    ("used_blocks", "kv_blocks_used", "KV blocks referenced by sequences"),
    ("cached_blocks", "kv_blocks_cached", "Unreferenced blocks kept for prefix reuse"),
    ("reserved_pages", "arena_pages_reserved", "Pages reserved by the reserve-max admission policy"),
    ("tail_waste", "kv_tail_waste_slots", "Unused token slots in the last blocks of running sequences"),
    ("shared_blocks", "kv_blocks_shared",
     "KV blocks referenced by more than one running sequence (samples, beams, a common prefix)"),
    ("running_state_pages", "arena_pages_running_state",
     "Arena pages holding running sequences' DeltaNet state (also in arena_pages{use=...})"),
    ("checkpoints", "state_checkpoints", "DeltaNet state checkpoints held (each pages_per_state pages)"),
    ("num_running_requests", "num_requests_running", "Requests running"),
    ("num_running_seqs", "num_seqs_running", "Live sequences of running requests: an n > 1 request counts 1 until its prompt is prefilled, "
     "then its unfinished samples; a beam request its live beams"),
    ("num_waiting_requests", "num_requests_waiting", "Requests waiting"),
    ("waiting_tokens", "num_tokens_waiting", "Prompt tokens of waiting requests"),
    ("last_step_tokens", "step_batched_tokens", "Tokens in the last step's batch"),
    ("last_step_seqs", "step_batched_seqs", "Sequences in the last step's batch"),
]

# Busiest expert / mean: 1 is even; k experts of E all taking one row is E / k.
_EXPERT_LOAD_BUCKETS = (1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
# Arena pages by use: (stats key, label value); they sum to num_pages.
_PAGE_USES = [
    ("kv_pages", "kv"),
    ("running_state_pages", "running_state"),
    ("checkpoint_pages", "checkpoint"),
    ("cached_pages", "cached"),
    ("free_pages", "free"),
]
# What stopped admission at the waiting head, one count per step at most.
_ADMISSION_LIMITS = [
    ("admission_limited_pages", "pages"),
    ("admission_limited_seqs", "max_num_seqs"),
    ("admission_limited_budget", "token_budget"),
]

# Step phases run from microseconds (a schedule) to seconds (a long prefill's forward).
_PHASE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _CoreCollector:
    def __init__(self, labels: RequestClassLabels) -> None:
        self.snapshot: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.labels = labels

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
        g = GaugeMetricFamily(PREFIX + "arena_pages", "Arena pages by use (they sum to arena_pages_total)",
                              labels=["use"])
        for key, use in _PAGE_USES:
            g.add_metric([use], float(snap.get(key, 0)))
        yield g
        c = CounterMetricFamily(PREFIX + "admission_limited",
                                "Steps whose admission stopped at the waiting head, by what was short: "
                                "arena pages, max_num_seqs or the step's token budget", labels=["limit"])
        for key, limit in _ADMISSION_LIMITS:
            c.add_metric([limit], float(snap.get(key, 0)))
        yield c
        c = CounterMetricFamily(PREFIX + "preemptions_by_cause", "Requests preempted, by cause "
                                "(blocks_needed, priority) and the victim's request_class",
                                labels=["cause", "request_class"])
        merged: dict[tuple[str, str], float] = {}
        for cause, klass, n in snap.get("preemptions_by", ()):
            key = (cause, self.labels(klass))
            merged[key] = merged.get(key, 0.0) + float(n)
        for (cause, klass), n in merged.items():
            c.add_metric([cause, klass], n)
        yield c
        total = float(snap.get("num_pages", 0)) or 1.0
        g = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                              "Fraction of the arena held by running sequences (KV blocks + DeltaNet state, 0..1)")
        g.add_metric([], float(snap.get("kv_pages", 0) + snap.get("running_state_pages", 0)) / total)
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
        from hybridserve.structured.metrics import families

        yield from families(PREFIX, snap.get("structured"))
        yield from _spec_families(snap)


def _spec_families(snap: dict[str, Any]):
    """Speculative decoding (vLLM's spec_decode_* names), when the engine drafts."""
    if "spec_draft_tokens" not in snap or "spec_verify_entries" not in snap:
        return
    for key, name, doc in (
        ("spec_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified"),
        ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
        ("spec_verify_entries", "spec_decode_num_drafts", "Verify runs (one per drafted sequence and step)"),
        ("spec_steps_not_drafting", "spec_decode_steps_not_drafting",
         "Steps that did not draft: the decoding batch reached disable_by_batch_size"),
    ):
        c = CounterMetricFamily(PREFIX + name, doc)
        c.add_metric([], float(snap.get(key) or 0))
        yield c
    c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted, by draft position (0 = the first draft)", labels=["position"])
    for i, n in enumerate(snap.get("spec_accepted_by_position_counts") or ()):
        c.add_metric([str(i)], float(n))
    yield c
    g = GaugeMetricFamily(PREFIX + "spec_decode_mean_accepted_length",
                          "Tokens kept per verify run (1 + accepted drafts), since start")
    g.add_metric([], float(snap.get("spec_mean_accepted_length") or 0.0))
    yield g


class EngineMetrics:
    """Holds the registry; ``observe_step`` and ``refresh`` run on the engine thread.

    The core's snapshot is taken per scrape (``refresh``), not per step: a step
    only records latencies, so serving pays nothing for gauges nobody reads.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, request_classes: "list[str] | None" = None,
                 max_request_classes: int = DEFAULT_MAX_REQUEST_CLASSES) -> None:
        self.registry = CollectorRegistry()
        self.class_label = RequestClassLabels(request_classes, max_request_classes)
        self._core = _CoreCollector(self.class_label)
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
        # Divides the phases' sums into per-sequence costs (``bench serve`` reads both).
        self.step_seqs = Counter(
            PREFIX + "step_scheduled_seqs", "Sequences scheduled, summed over engine steps",
            registry=self.registry)
        self._last_token: dict[str, float] = {}
        self._seen_first: set[str] = set()
        self._init_expert_load()

    def refresh(self, engine: Any) -> None:
        snap = engine.stats()
        with self._core.lock:
            self._core.snapshot = snap

    def observe_step(self, engine: Any, outputs: list[Any]) -> None:
        for phase, seconds in engine.last_step_stats.get("phase_seconds", {}).items():
            self.step_phase.labels(phase).observe(seconds)
        self.step_seqs.inc(engine.last_step_stats.get("num_scheduled_seqs", 0))
        for out in outputs:
            m = out.metrics
            if m is None:
                continue
            klass = self.class_label(m.request_class)
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
        self._observe_expert_load(engine)
        # Aborted requests never report a finished output: forget them in bulk.
        if len(self._last_token) > len(engine.requests) + 1024:
            live = engine.requests.keys()
            self._last_token = {r: t for r, t in self._last_token.items() if r in live}
            self._seen_first &= set(live)

    # ---- MoE routing balance (mixture-of-experts models only) ---------------------
    def _init_expert_load(self) -> None:
        # One series, not one per expert and layer (512 x 60 on the 397B model): the
        # imbalance that costs time is the busiest expert's, since a layer waits for it.
        self.expert_load = Histogram(
            PREFIX + "moe_expert_load_ratio",
            "Per step with MoE layers: rows routed to the busiest expert over the mean rows per "
            "expert, in the most imbalanced layer (1 = perfectly even)",
            registry=self.registry, buckets=_EXPERT_LOAD_BUCKETS)
        self._expert_load_step = -1

    def _observe_expert_load(self, engine: Any) -> None:
        model = getattr(engine, "model", None)
        step = getattr(engine, "step_count", None)
        if getattr(model, "expert_load", None) is None or step is None or step == self._expert_load_step:
            return
        self._expert_load_step = step
        if not getattr(engine, "last_step_stats", {}).get("num_batched_tokens"):
            return  # no forward ran this step: the model's numbers are an older step's
        ratio = model.expert_load()
        if ratio is not None:
            self.expert_load.observe(ratio)

    def render(self) -> bytes:
        return generate_latest(self.registry)
