"""Exception classes of hybridserve, one per way a caller can go wrong.

Each message says what to change. The Rust core raises the same classes (the
bindings import them from here with ``pyo3::import_exception!``), so a Python
caller catches one hierarchy whichever side found the problem. ``http_status`` is
what the server answers when one of these reaches a client.
"""

from __future__ import annotations


class HybridServeError(Exception):
    """Base class of every error hybridserve raises on purpose."""

    http_status = 500


class ConfigError(HybridServeError, ValueError):
    """A config.json, or an engine setting, that hybridserve cannot serve."""

    http_status = 400


class CheckpointError(HybridServeError):
    """A checkpoint directory with a missing, unexpected or mis-shaped tensor."""

    http_status = 500


class OutOfBlocks(HybridServeError):
    """The KV block pool has too few free blocks for the operation."""

    http_status = 503


class OutOfSlots(HybridServeError):
    """The DeltaNet state pool has no free slot for the operation."""

    http_status = 503


class InvalidBlock(HybridServeError, ValueError):
    """A block id out of range, or one used after it was freed (a caller bug)."""

    http_status = 500


class InvalidSlot(HybridServeError, ValueError):
    """A state-slot id out of range, or one used after it was freed (a caller bug)."""

    http_status = 500


class RequestRejected(HybridServeError):
    """Admission refused a request before it used any resource."""

    http_status = 400


class InvalidRequest(RequestRejected, ValueError):
    """The request itself is malformed or can never fit (prompt too long, ...): HTTP 400."""

    http_status = 400


class QueueFull(RequestRejected):
    """The waiting queue is at its cap (requests or tokens); retry later: HTTP 503."""

    http_status = 503


class UnknownRequest(HybridServeError, KeyError):
    """A request id that the engine does not know (never added, or already gone)."""

    http_status = 404



class FatalEngineError(HybridServeError):
    """The engine cannot go on (a lost device, a dead rank, a fault that repeats): every
    open request fails and the server exits non-zero so a supervisor restarts it."""

    http_status = 500


class RequestFailed(HybridServeError):
    """The engine failed while running this request (a step that raised, twice): the
    request ended with ``finish_reason == "error"``; the server stays up, retry it."""

    http_status = 500

__all__ = [
    "HybridServeError",
    "ConfigError",
    "CheckpointError",
    "OutOfBlocks",
    "OutOfSlots",
    "InvalidBlock",
    "InvalidSlot",
    "RequestRejected",
    "InvalidRequest",
    "QueueFull",
    "UnknownRequest",
    "FatalEngineError",
    "RequestFailed",
]
