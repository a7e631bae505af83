"""Typed stubs of ``hybridserve._core`` (the Rust core, built by maturin).

Errors come from :mod:`hybridserve.errors`: ``OutOfBlocks``, ``OutOfSlots``,
``InvalidBlock``, ``InvalidSlot``; bad constructor sizes raise ``ConfigError`` (a
``ValueError``). Id and count arrays are ``int32``. The GIL is released around
work that is not O(1).
"""

from typing import Sequence

import numpy as np
import numpy.typing as npt

__version__: str

Int32Array = npt.NDArray[np.int32]
Tokens = Sequence[int] | npt.NDArray[np.integer]

class BlockAllocator:
    """Lock-free pool of ``num_blocks`` KV blocks with atomic refcounts.

    Every method is safe to call from any thread at once. Fresh pools hand out
    ids 0, 1, 2, ...; afterwards the most recently freed block first.
    """

    def __init__(self, num_blocks: int) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int:
        """Free-list length (exact when no call is in flight)."""
    def allocate(self) -> int:
        """One free block with refcount 1. Raises OutOfBlocks."""
    def allocate_n(self, n: int) -> Int32Array:
        """``n`` fresh blocks, or none (OutOfBlocks)."""
    def incref(self, block: int) -> int:
        """New refcount. InvalidBlock if the block is free, parked or out of range."""
    def decref(self, block: int) -> int:
        """New refcount; at 0 the block returns to the free list."""
    def decref_retain(self, block: int) -> int:
        """Like ``decref`` but at 0 the block is parked (not allocatable) until
        ``release`` or ``revive``."""
    def release(self, block: int) -> None:
        """Parked block -> free list. InvalidBlock if it is not parked."""
    def revive(self, block: int) -> None:
        """Parked block -> refcount 1. InvalidBlock if it is not parked."""
    def refcount(self, block: int) -> int:
        """0 for free, parked or out-of-range blocks."""
    def is_free(self, block: int) -> bool: ...
    def free_list(self) -> Int32Array:
        """Free-list contents, next to allocate first (debugging; O(free))."""

class BlockTable:
    """Opaque handle of one sequence's block table. Create it with
    ``KvCacheManager.new_table()``; use it only with that manager; release its
    blocks with ``KvCacheManager.free(table)`` (dropping it leaks them)."""

    def __init__(self) -> None: ...
    @property
    def blocks(self) -> Int32Array:
        """Physical block ids in logical order (a fresh array)."""
    @property
    def num_tokens(self) -> int:
        """Tokens whose KV slots are reserved."""
    @property
    def num_blocks(self) -> int: ...
    def block_hashes(self) -> list[int]:
        """Chained hashes of the leading full blocks known to the prefix cache."""

class KvCacheManager:
    """Block allocator + block tables + prefix cache. Single-threaded: call it
    from one thread (concurrent calls raise RuntimeError "already borrowed")."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        """ConfigError if num_blocks or block_size is 0 or num_blocks*block_size >= 2^31."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int:
        """Allocatable now: free list + unreferenced cached blocks."""
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced cached blocks kept for reuse (counted as free)."""
    @property
    def prefix_caching_enabled(self) -> bool: ...
    def new_table(self) -> BlockTable: ...
    def blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks ``append_slots(table, n)`` would take now (incl. a copy-on-write)."""
    def match_prefix(self, table: BlockTable, tokens: Tokens, extra_key: int = 0) -> int:
        """For an empty table: reuse the longest cached run of full blocks of
        ``tokens`` (leaving >= 1 token to compute); returns tokens covered."""
    def append_slots(self, table: BlockTable, n: int) -> tuple[Int32Array, Int32Array]:
        """Reserve ``n`` more slots: ``(slot_mapping[n], block_copies[K, 2])``,
        slot = block * block_size + offset, copies are (src, dst) to perform before
        writing. All or nothing: OutOfBlocks changes nothing."""
    def cache_full_blocks(self, table: BlockTable, tokens: Tokens, extra_key: int = 0) -> None:
        """Register the table's newly full blocks (their KV computed) in the cache."""
    def fork(self, table: BlockTable) -> BlockTable:
        """A child sharing every block (copy-on-write on the next partly-filled append)."""
    def free(self, table: BlockTable) -> None:
        """Drop every block, tail first; cached ones are parked in LRU order."""
    def tail_waste(self, table: BlockTable) -> int: ...
    def refcount(self, block: int) -> int: ...
    def is_cached(self, block: int) -> bool: ...
    def lru_order(self) -> Int32Array:
        """Parked cached blocks, next to be evicted first."""
    def stats(self) -> dict[str, int]:
        """prefix_queries, prefix_query_tokens, prefix_hit_tokens, prefix_hits,
        alloc_failures, evictions, cow_copies, num_free_blocks, num_used_blocks,
        num_cached_blocks."""

class StatePool:
    """DeltaNet state slots. Allocation order: most recently freed first."""

    def __init__(self, num_slots: int) -> None: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def allocate(self) -> int:
        """Raises OutOfSlots when none is free."""
    def allocate_n(self, n: int) -> Int32Array:
        """``n`` slots or none (OutOfSlots)."""
    def allocate_checkpoint(self, block_hash: int) -> int:
        """A slot holding the state after the block with this chained hash."""
    def free(self, slot: int) -> None:
        """InvalidSlot if free or out of range."""
    def fork(self, src: int) -> tuple[int, int]:
        """``(src, dst)``: a new slot for a forked child; copy the state src -> dst."""
    def slot_use(self, slot: int) -> str | None:
        """"free", "sequence", "checkpoint", or None out of range."""
