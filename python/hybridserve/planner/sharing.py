"""Sequences that share memory: a common prompt prefix (prefix caching) and the n
samples of one request (forks). Exact block accounting, checked against brute-force
copy-on-write and prefix-cache simulations in the tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.planner.arena import ArenaPlan
from hybridserve.planner.sessions import fit
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    block_bytes,
    blocks_for_tokens,
    check_context,
    state_slot_bytes,
)
from hybridserve.planner.units import positive_int


@dataclass(frozen=True)
class SharingPlan:
    """``count`` sequences of ``context_len`` tokens each that share their first
    ``shared_len`` tokens (a common prompt prefix, or the prompt of n parallel samples).

    Only *full* blocks of the shared part are shared (``shared_blocks``, counted once):
    a partly-filled block is written by every sequence, so copy-on-write gives each
    its own copy. Each sequence has ``private_blocks`` = ceil(context/bs) -
    floor(shared/bs) blocks of its own and one state slot (DeltaNet state cannot be
    shared once the sequences diverge). This is exact for prefix-cache sharing (only
    full blocks are cached, at any ``shared_len``) and for forked samples once each
    has written a token of its own (``shared_len < context_len``).

    With prefix caching on a hybrid model the shared prefix also keeps
    ``checkpoint_slots`` DeltaNet state checkpoint (one, at the end of the shared
    full blocks, when there is at least one), so that every session skips the
    prefix's compute; ``max_count`` keeps it. (Checkpoints are reclaimable: under
    pressure the engine evicts it and admits up to ``max_count_evicting_checkpoint``,
    the later sessions then recomputing the prefix.)
    """

    count: int
    context_len: int
    shared_len: int
    block_size: int
    shared_blocks: int
    private_blocks: int
    total_blocks: int
    total_bytes: int
    bytes_without_sharing: int
    #: Largest ``count`` that fits in the pool with sharing, and without.
    max_count: int
    max_count_without_sharing: int
    #: The prefix's DeltaNet checkpoint (not in ``total_bytes``, which is the sessions').
    checkpoint_slots: int = 0
    checkpoint_bytes: int = 0
    max_count_evicting_checkpoint: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _check_shared(context_len: int, shared_len: int, count: int) -> None:
    positive_int("number of sequences", count)
    if not 0 <= shared_len <= context_len:
        raise ConfigError(
            f"shared prefix of {shared_len:,} tokens must be between 0 and the context "
            f"length {context_len:,}"
        )


def _share(block: int, state: int, pool: int, context_len: int, shared_len: int, count: int,
           block_size: int) -> SharingPlan:
    """The accounting with a KV block costing ``block`` and a sequence's state ``state``
    (bytes, or pages times the page size in the arena) in a pool of ``pool``."""
    shared = shared_len // block_size
    private = blocks_for_tokens(context_len, block_size) - shared
    per_seq_private = private * block + state
    per_seq = (shared + private) * block + state
    total_blocks = shared + count * private
    checkpoints = 1 if shared > 0 else 0
    return SharingPlan(
        count=count,
        context_len=context_len,
        shared_len=shared_len,
        block_size=block_size,
        shared_blocks=shared,
        private_blocks=private,
        total_blocks=total_blocks,
        total_bytes=total_blocks * block + count * state,
        bytes_without_sharing=count * per_seq,
        max_count=fit(pool - shared * block - checkpoints * state, per_seq_private),
        max_count_without_sharing=fit(pool, per_seq),
        checkpoint_slots=checkpoints,
        checkpoint_bytes=checkpoints * state,
        max_count_evicting_checkpoint=fit(pool - shared * block, per_seq_private),
    )


def sharing_plan(
    config: ModelConfig,
    pool_bytes: int,
    context_len: int,
    shared_len: int,
    count: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> SharingPlan:
    """Memory of ``count`` sequences sharing a ``shared_len``-token prefix, in raw bytes
    (see :class:`SharingPlan`; :func:`arena_sharing_plan` for the arena's pages). O(1)."""
    check_context(config, context_len)
    _check_shared(context_len, shared_len, count)
    return _share(block_bytes(config, block_size, kv_dtype),
                  state_slot_bytes(config, include_conv, kv_dtype),
                  pool_bytes, context_len, shared_len, count, block_size)


def arena_sharing_plan(arena: ArenaPlan, context_len: int, shared_len: int, count: int) -> SharingPlan:
    """:func:`sharing_plan` in the arena: a block is one page, a state (and the prefix's
    checkpoint) ``state_pages`` pages, the pool the scheduler's ``num_pages`` (scratch
    excluded); byte fields are pages x the page size. O(1)."""
    arena.sessions(context_len)  # checks the length against max_model_len
    _check_shared(context_len, shared_len, count)
    page = arena.page_bytes
    return _share(page, arena.state_pages * page, arena.num_pages * page,
                  context_len, shared_len, count, arena.block_size)


@dataclass(frozen=True)
class ParallelSamplingPlan:
    """Requests of ``n`` samples each: a ``prompt_len`` prompt shared, every sample at
    ``context_len`` tokens (prompt + its own output). See :class:`SharingPlan` for the
    block accounting of one request (``per_request``)."""

    n: int
    per_request: SharingPlan
    bytes_per_request: int
    #: Whole requests (n sequences each) that fit, with prompt sharing and without.
    requests_that_fit: int
    requests_that_fit_without_sharing: int

    @property
    def sequences_that_fit(self) -> int:
        return self.requests_that_fit * self.n

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "prompt_len": self.per_request.shared_len,
            "context_len": self.per_request.context_len,
            "shared_blocks": self.per_request.shared_blocks,
            "private_blocks_per_sample": self.per_request.private_blocks,
            "blocks_per_request": self.per_request.total_blocks,
            "bytes_per_request": self.bytes_per_request,
            "bytes_per_request_without_sharing": self.per_request.bytes_without_sharing,
            "requests_that_fit": self.requests_that_fit,
            "sequences_that_fit": self.sequences_that_fit,
            "requests_that_fit_without_sharing": self.requests_that_fit_without_sharing,
        }


def _check_prompt(context_len: int, n: int, prompt_len: int | None) -> int:
    positive_int("n (samples per request)", n)
    prompt = context_len - 1 if prompt_len is None else prompt_len
    if not 0 <= prompt < context_len:
        raise ConfigError(
            f"prompt length {prompt:,} must be below the per-sample context length "
            f"{context_len:,}: each sample holds the prompt plus at least one token of its own"
        )
    return prompt


def _sampling(req: SharingPlan, pool: int, n: int) -> ParallelSamplingPlan:
    return ParallelSamplingPlan(
        n=n,
        per_request=req,
        bytes_per_request=req.total_bytes,
        requests_that_fit=fit(pool, req.total_bytes),
        requests_that_fit_without_sharing=fit(pool, req.bytes_without_sharing),
    )


def parallel_sampling_plan(
    config: ModelConfig,
    pool_bytes: int,
    context_len: int,
    n: int,
    prompt_len: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> ParallelSamplingPlan:
    """How many ``n``-sample requests fit, each sample at ``context_len`` tokens, in raw
    bytes (:func:`arena_parallel_sampling_plan` for the arena's pages).

    ``prompt_len`` defaults to ``context_len - 1``: the step after prefill, when every
    sample has written its first token, so each holds one (copied, partly-filled)
    tail block and one state of its own beyond the shared full prompt blocks.
    ``prompt_len`` must be < ``context_len`` (samples diverge at their first token).
    """
    check_context(config, context_len)
    prompt = _check_prompt(context_len, n, prompt_len)
    req = sharing_plan(config, pool_bytes, context_len, prompt, n, block_size, kv_dtype, include_conv)
    return _sampling(req, pool_bytes, n)


def arena_parallel_sampling_plan(
    arena: ArenaPlan, context_len: int, n: int, prompt_len: int | None = None
) -> ParallelSamplingPlan:
    """:func:`parallel_sampling_plan` in the arena's pages (see :func:`arena_sharing_plan`)."""
    arena.sessions(context_len)
    prompt = _check_prompt(context_len, n, prompt_len)
    req = arena_sharing_plan(arena, context_len, prompt, n)
    return _sampling(req, arena.num_pages * arena.page_bytes, n)
