"""Prometheus series of constrained decoding, read from ``engine.stats()["structured"]``."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily

_COUNTERS = (
    ("compiles", "structured_grammar_compiles", "Constraints compiled (cache misses)"),
    ("cache_hits", "structured_grammar_cache_hits", "Constraints served from the compiled-grammar cache"),
    ("compile_seconds", "structured_grammar_compile_seconds", "Seconds spent compiling constraints"),
    ("compile_timeouts", "structured_grammar_compile_timeouts",
     "Constraints refused because they did not compile within the time bound"),
    ("mask_sequence_steps", "structured_mask_sequence_steps", "Token masks filled (one per constrained row and step)"),
    ("mask_seconds", "structured_mask_fill_seconds",
     "Seconds filling token masks (on the mask thread, overlapping the forward)"),
    ("mask_wait_seconds", "structured_mask_wait_seconds",
     "Seconds the engine waited for a step's masks after its forward (the part on the critical path)"),
    ("mask_apply_seconds", "structured_mask_apply_seconds", "Seconds applying masks to the logits"),
)


def families(prefix: str, snap: dict[str, Any] | None) -> Iterator[Any]:
    snap = snap or {}
    for key, name, doc in _COUNTERS:
        c = CounterMetricFamily(prefix + name, doc)
        c.add_metric([], float(snap.get(key, 0)))
        yield c
    c = CounterMetricFamily(prefix + "structured_requests", "Constrained requests by kind "
                            "(json, json_object, regex, choice, grammar, structural_tag)", labels=["kind"])
    for kind, n in sorted((snap.get("requests_by_kind") or {}).items()):
        c.add_metric([kind], float(n))
    yield c
