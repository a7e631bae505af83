"""The pre-arena memory split, kept as the baseline the arena is measured against.

Before issue 17 the engine split its budget at start-up into a KV block pool and a
DeltaNet slot pool sized for an expected context length; whichever pool the traffic
did not need sat idle. The engine no longer sizes memory this way (see :mod:`.arena`);
the benchmarks still build this split to show, side by side, what it capped
concurrency at.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.planner.sessions import paged_sequence_bytes, reserved_blocks_per_sequence
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    MATRIX_STATE_DTYPE,
    block_bytes,
    blocks_for_tokens,
    cache_dtype,
    conv_state_bytes,
    kv_bytes_per_token,
    matrix_state_bytes,
    state_slot_bytes,
)
from hybridserve.planner.units import format_bytes, format_mib, positive_int


@dataclass(frozen=True)
class PoolPlan:
    """The pre-arena split: ``num_blocks`` KV blocks and ``num_state_slots`` DeltaNet
    slots, from ``pool_bytes``.

    ``kv_pool_bytes + state_pool_bytes + unused_bytes == pool_bytes``; ``unused_bytes``
    is less than one block.
    """

    num_blocks: int
    num_state_slots: int
    block_size: int
    kv_dtype: str
    state_dtype: str
    conv_dtype: str
    kv_bytes_per_token: int
    block_bytes: int
    matrix_state_bytes: int
    conv_state_bytes: int
    slot_bytes: int
    pool_bytes: int
    kv_pool_bytes: int
    state_pool_bytes: int
    unused_bytes: int
    #: Blocks one sequence takes under the reserve-the-maximum baseline policy.
    reserved_blocks_per_sequence: int = 0
    expected_context_len: int | None = None
    max_num_seqs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_pools(
    config: ModelConfig,
    pool_bytes: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    expected_context_len: int | None = None,
    num_state_slots: int | None = None,
    max_num_seqs: int | None = None,
) -> PoolPlan:
    """Split ``pool_bytes`` between the KV block pool and the DeltaNet slot pool.

    Slots are decided first, blocks take the rest:

    * ``num_state_slots`` given: exactly that many slots.
    * else ``expected_context_len`` given: as many slots as sequences of that length
      fit (each costing its whole blocks + one slot), capped at ``max_num_seqs``; a cap
      leaves more bytes to blocks, i.e. room for longer sequences.
    * else ``max_num_seqs`` given: that many slots.

    Each slot holds the matrix state (float32) and the conv state (cache dtype).
    Raises :class:`ConfigError` if none of the three is given, or if the pool cannot
    hold the slots plus one block (or one sequence of ``expected_context_len``).
    O(1).
    """
    positive_int("pool size in bytes", pool_bytes)
    kv_dtype = cache_dtype(config, kv_dtype)
    bb = block_bytes(config, block_size, kv_dtype)
    slot = state_slot_bytes(config, include_conv=True, kv_dtype=kv_dtype)
    if max_num_seqs is not None:
        positive_int("max_num_seqs", max_num_seqs)
    if num_state_slots is not None:
        slots = positive_int("num_state_slots", num_state_slots)
    elif expected_context_len is not None:
        per_seq = paged_sequence_bytes(config, expected_context_len, block_size, kv_dtype)
        slots = pool_bytes // per_seq
        if slots == 0:
            raise ConfigError(
                f"a pool of {format_mib(pool_bytes)} cannot hold one sequence of "
                f"{expected_context_len:,} tokens ({format_mib(per_seq)}); lower the "
                "expected context length or give the engine more memory"
            )
        if max_num_seqs is not None:
            slots = min(slots, max_num_seqs)
    elif max_num_seqs is not None:
        slots = max_num_seqs
    else:
        raise ConfigError(
            "cannot split the pool between KV blocks and DeltaNet state slots: give an "
            "expected context length, a number of state slots, or max_num_seqs"
        )
    state_pool = slots * slot
    if state_pool > pool_bytes:
        raise ConfigError(
            f"{slots} state slots need {format_mib(state_pool)}, more than the pool's "
            f"{format_mib(pool_bytes)}; ask for fewer slots or a larger pool"
        )
    if bb == 0:
        # No attention layers: nothing to page. (Not a Qwen3.5 shape, but arithmetic holds.)
        num_blocks = 0
    else:
        num_blocks = max(pool_bytes - state_pool, 0) // bb
        if num_blocks == 0:
            raise ConfigError(
                f"{slots} state slots of {format_mib(slot)} leave no room for a single "
                f"KV block of {format_mib(bb)} in a pool of {format_mib(pool_bytes)}; "
                "ask for fewer slots or a larger pool"
            )
    kv_pool = num_blocks * bb
    return PoolPlan(
        num_blocks=num_blocks,
        num_state_slots=slots,
        block_size=block_size,
        kv_dtype=kv_dtype,
        state_dtype=MATRIX_STATE_DTYPE,
        conv_dtype=kv_dtype,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        block_bytes=bb,
        matrix_state_bytes=matrix_state_bytes(config),
        conv_state_bytes=conv_state_bytes(config, kv_dtype),
        slot_bytes=slot,
        pool_bytes=pool_bytes,
        kv_pool_bytes=kv_pool,
        state_pool_bytes=state_pool,
        unused_bytes=pool_bytes - kv_pool - state_pool,
        reserved_blocks_per_sequence=reserved_blocks_per_sequence(config, block_size),
        expected_context_len=expected_context_len,
        max_num_seqs=max_num_seqs,
    )


def max_concurrency(plan: PoolPlan, context_len: int) -> int:
    """Sequences of ``context_len`` tokens that can run at once in ``plan``'s pools:
    min(slots, blocks // blocks-per-sequence[, max_num_seqs]). O(1)."""
    positive_int("context length", context_len)
    limit = plan.num_state_slots
    if plan.block_bytes:
        limit = min(limit, plan.num_blocks // blocks_for_tokens(context_len, plan.block_size))
    if plan.max_num_seqs is not None:
        limit = min(limit, plan.max_num_seqs)
    return limit


def max_concurrency_reserved(plan: PoolPlan) -> int:
    """Sequences that can run at once in ``plan``'s pools when each reserves the native
    maximum up front (the baseline policy): min(slots, blocks // reserved blocks
    [, max_num_seqs]), whatever the sequences' actual lengths. O(1)."""
    limit = plan.num_state_slots
    if plan.block_bytes:
        limit = min(limit, plan.num_blocks // plan.reserved_blocks_per_sequence)
    if plan.max_num_seqs is not None:
        limit = min(limit, plan.max_num_seqs)
    return limit


def format_pool_log(plan: PoolPlan) -> list[str]:
    """One line per pool, for the engine's start-up log."""
    return [
        f"KV block pool: {plan.num_blocks:,} blocks x {plan.block_size} tokens x "
        f"{format_bytes(plan.block_bytes)} ({plan.kv_dtype}) = {format_mib(plan.kv_pool_bytes)}, "
        f"{plan.num_blocks * plan.block_size:,} tokens",
        f"DeltaNet state pool: {plan.num_state_slots:,} slots x {format_bytes(plan.slot_bytes)} "
        f"(matrix {format_bytes(plan.matrix_state_bytes)} {plan.state_dtype} + conv "
        f"{format_bytes(plan.conv_state_bytes)} {plan.conv_dtype}) = "
        f"{format_mib(plan.state_pool_bytes)}",
    ]


def format_max_concurrency(plan: PoolPlan, context_len: int) -> str:
    """``"max concurrency at L tokens: X"`` for the engine's start-up log."""
    return f"max concurrency at {context_len:,} tokens: {max_concurrency(plan, context_len):,}"
