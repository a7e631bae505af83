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

# ``hybridserve._core.kernels`` (the CPU kernels, unstubbed submodule; Python calls
# them through ``hybridserve.kernels.native`` / ``hybridserve.kernels.quant``). The
# kernels on llama.cpp's quantized blocks (``rust/kernels/src/quant``), GIL released:
#   quant_matmul(x: f32 | u16 (bfloat16 bits) [T, K], w: u8 [N, row_bytes],
#                ggml_type_id: int, out: f32 | u16 [T, N], isa: str | None = None) -> None
#       out = x @ W.T, x quantized per row as llama.cpp does (Q8_0 / Q8_K);
#       isa forces "avx512_vnni" | "avx2" | "scalar".
#   quant_dequantize(w: u8 [R, row_bytes], ggml_type_id: int, out: f32 | u16 [R, K]) -> None
#   quant_isa() -> str
#   ggml_type_id: 2 q4_0, 8 q8_0, 12 q4_k, 13 q5_k, 14 q6_k (ValueError otherwise).
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

# ---------------------------------------------------------------- scheduler

class SchedulerOutput:
    """The plan of one step; entries in batch order (decodes first, then prefill chunks).

    B = scheduled sequences, T = tokens. Apply ``buf[block_table_update_rows,
    block_table_update_cols] = block_table_update_values`` to the persistent
    ``int32[max_num_seqs, max_blocks_per_seq]`` buffer, perform ``block_copies``
    and ``state_copies`` ((src, dst) pairs), then run. ``slot_mapping == -1``: the
    token's KV is already cached (prefix hit), feed the token but do not write it.
    An entry starting at ``num_computed_tokens > 0`` continues from its state slot
    (a checkpoint hit is copied there by ``state_copies`` first).
    """

    @property
    def request_ids(self) -> list[str]: ...
    @property
    def sample_indices(self) -> Int32Array: ...
    @property
    def seq_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_scheduled_tokens(self) -> Int32Array: ...
    @property
    def query_start_loc(self) -> Int32Array: ...
    @property
    def num_computed_tokens(self) -> Int32Array: ...
    @property
    def seq_lens(self) -> Int32Array: ...
    @property
    def input_ids(self) -> Int32Array: ...
    @property
    def positions(self) -> Int32Array: ...
    @property
    def slot_mapping(self) -> Int32Array: ...
    @property
    def checkpoint_positions(self) -> Int32Array:
        """``[B]``: -1, or write the entry's DeltaNet state as it is after its first
        ``k`` scheduled tokens into its checkpoint pages (at most one per entry)."""
    @property
    def checkpoint_pages(self) -> Int32Array:
        """``state_pages`` page ids per entry with a checkpoint position, entry order."""
    @property
    def num_samples(self) -> Int32Array:
        """Tokens to sample from the entry's last position: 0, 1, or n (an n>1 fork).
        A drafted entry has 1: the caller samples all of its rows itself."""
    @property
    def num_draft_tokens(self) -> Int32Array:
        """``[B]`` speculative decoding: how many of the entry's scheduled tokens are
        drafts. Entry b's ``input_ids`` are its last committed token then
        ``num_draft_tokens[b]`` drafts (a prefix of what ``update(drafts=...)``
        gave, cut to the token budget and to ``max_tokens``: r outputs left, at
        most r - 1 drafts), with positions and slots for every row. 0 for entries
        without drafts and for prefill chunks; ``checkpoint_positions`` is -1 on a
        drafted entry."""
    @property
    def block_table_rows(self) -> Int32Array: ...
    @property
    def block_table_update_rows(self) -> Int32Array: ...
    @property
    def block_table_update_cols(self) -> Int32Array: ...
    @property
    def block_table_update_values(self) -> Int32Array: ...
    @property
    def state_table_update_rows(self) -> Int32Array:
        """Cells of the persistent ``[max_num_seqs, state_pages]`` state page table
        (entry ``b`` reads row ``block_table_rows[b]``): apply before the step."""
    @property
    def state_table_update_cols(self) -> Int32Array: ...
    @property
    def state_table_update_values(self) -> Int32Array: ...
    @property
    def block_copies(self) -> Int32Array:
        """``[K, 2]`` copy-on-write (src, dst) block pairs."""
    @property
    def state_copies(self) -> Int32Array:
        """``[M, 2]`` (src_page, dst_page) arena page copies of DeltaNet states: forks
        (n > 1, beams) and checkpoint restores. Read every source (of both copy
        lists) before writing any destination; do them before the forward."""
    @property
    def preempted(self) -> list[str]: ...
    @property
    def preempted_causes(self) -> list[str]:
        """Per ``preempted`` entry: "blocks_needed" or "priority"."""
    @property
    def finished(self) -> list[tuple[str, int, str]]:
        """(request_id, sample_index, reason) finished outside update() since the last plan."""
    @property
    def num_decodes(self) -> int: ...

class StepUpdate:
    """What update() did: one row per new token, and the sequences that finished."""

    @property
    def request_ids(self) -> list[str]: ...
    @property
    def sample_indices(self) -> Int32Array: ...
    @property
    def token_ids(self) -> Int32Array: ...
    @property
    def finished_request_ids(self) -> list[str]: ...
    @property
    def finished_sample_indices(self) -> Int32Array: ...
    @property
    def finished_reasons(self) -> list[str]:
        """"stop" or "length"."""

class Scheduler:
    """Continuous-batching scheduler over one arena of pages: KV blocks, DeltaNet
    states (``state_pages`` pages each) and checkpoints share one free count.

    ``add_request`` raises ``InvalidRequest`` (can never be served as given) or
    ``QueueFull`` (waiting cap) at once, changing nothing. ``schedule()`` and
    ``update()`` alternate; both release the GIL.
    """

    def __init__(
        self,
        num_pages: int,
        block_size: int,
        state_pages: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        *,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        max_waiting_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        aging_interval_steps: int = 256,
        reserve_max_context: bool = False,
        max_finished_retained: int = 4096,
        prefix_checkpoint_interval: int = 0,
        priority_preemption_threshold: int = 1,
        max_priority_preemptions_per_step: int = 4,
        max_request_classes: int = 16,
        num_speculative_tokens: int = 0,
    ) -> None:
        """``num_speculative_tokens`` = k > 0 turns on speculative decoding (MTP):
        decodes carry up to k drafts (see ``update``), and every entry that samples
        (decodes, and prefill chunks ending the prompt) also gets KV slots for the
        positions ``seq_lens[b] .. seq_lens[b] + k - 1`` (never reaching
        ``prompt + max_tokens``; none for beam search), in its block-table row,
        for the drafter to write before the next ``schedule()``. They count in
        admission and preemption like any other block."""
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def state_pages(self) -> int:
        """Columns of the state page table buffer (pages per DeltaNet state)."""
    @property
    def num_pages(self) -> int: ...
    def now(self) -> float:
        """Seconds on the scheduler's clock (arrival times and events use it)."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Tokens,
        *,
        max_tokens: int = 16,
        min_tokens: int = 0,
        stop_token_ids: Tokens | None = None,
        ignore_eos: bool = False,
        eos_token_ids: Tokens | None = None,
        n: int = 1,
        priority: int = 0,
        request_class: str = "default",
        arrival_time: float | None = None,
        extra_key: int = 0,
        beam_search: bool = False,
    ) -> None: ...
    def schedule(self) -> SchedulerOutput: ...
    def reorder_beams(self, request_id: str, parents: list[int]) -> None:
        """Between schedule() and update() of a step that decoded every beam: beam i
        continues beam ``parents[i]`` (blocks forked, state copied by the next plan)."""
    def update(
        self,
        sampled: Tokens,
        accepted: Sequence[int] | Int32Array | None = None,
        drafts: Sequence[Sequence[int] | Int32Array | None] | None = None,
    ) -> StepUpdate:
        """``num_samples[b]`` tokens per entry of the last plan, in batch order.

        Speculative decoding (``num_speculative_tokens`` > 0):

        * ``accepted`` (len B, or None): entry b contributes ``accepted[b]`` tokens of
          ``sampled`` instead of ``num_samples[b]``. For an entry that carried
          ``d = num_draft_tokens[b] > 0`` drafts, ``1 <= accepted[b] <= d + 1``: the
          first ``accepted[b] - 1`` drafts (their very ids) then the token the target
          drew. Its ``num_computed_tokens`` advances by ``accepted[b]`` and the tokens
          are committed one by one under the stop rule (eos / stop ids, min_tokens,
          max_tokens): a stop drops the rest. Entries without drafts need
          ``accepted[b] == num_samples[b]``. None: every entry gives
          ``num_samples[b]`` tokens (a drafted entry accepts none of its drafts).
        * ``drafts`` (len B, or None = no drafts): entry b's sequence's drafts for
          its NEXT step (at most ``num_speculative_tokens``; ``[]``/None = none).
          They replace what the sequence held; dropped on preemption,
          ``abort_step``, finish and fork. Ignored for sequences that finished and
          for the entry that forks an n > 1 request (its children start without
          drafts); refused for an entry that sampled nothing or a beam request.

        Anything else raises ValueError and changes nothing."""
    def finish(self, request_id: str, sample_index: int, reason: str = "stop") -> bool: ...
    def abort_step(self) -> list[str]:
        """Roll back the pending plan of a failed step; its requests wait again (recompute)."""
        ...
    def abort(self, request_id: str) -> bool:
        """Abort in any state; every page comes back. False if already finished."""
    def get_output_tokens(self, request_id: str, sample_index: int) -> Int32Array: ...
    def has_unfinished(self) -> bool: ...
    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...
    def block_tables(self) -> Int32Array:
        """Dense ``[B, width]`` block tables of the last plan (-1 padded)."""
    def take_events(self) -> list[tuple[str, str, float, float]]:
        """(request_id, request_class, time, queue_delay) of requests first scheduled since the last call."""
    def checkpoints(self) -> list[tuple[list[int], int, int, int]]:
        """Live DeltaNet checkpoints: (state pages, tokens, last KV block of its chain,
        generation of that block's prefix-cache entry), sorted."""
    def running_states(self) -> list[tuple[int, list[int]]]:
        """(sequence id, state pages) of running sequences' states (tests)."""
    def running_tables(self) -> list[list[int]]:
        """KV blocks of every live running sequence's table (tests)."""
    def free_and_cached_pages(self) -> tuple[list[int], list[int]]:
        """The free list and the parked cached blocks (tests)."""
    def stats(self) -> dict[str, int | str | list[int]]:
        """Arena pages by use (num_pages, free_pages, kv_pages, running_state_pages,
        checkpoint_pages, cached_pages; they sum to num_pages), available_pages,
        admission_limited_{pages,seqs,budget} and last_admission_limit, counters.
        Speculative decoding: spec_draft_tokens (drafts scheduled, summed over
        plans), spec_accepted_tokens (``accepted[b] - 1`` summed over updated
        entries with drafts) and spec_accepted_by_position (list of
        num_speculative_tokens ints: how often draft position i was accepted)."""
