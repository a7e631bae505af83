"""One memory arena for KV blocks and DeltaNet state (see :mod:`.layout`)."""

from hybridserve.memory.layout import ArenaLayout, arena_layout

__all__ = ["ArenaLayout", "arena_layout"]
