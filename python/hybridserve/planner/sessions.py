"""Sessions that fit in a byte pool, paged or reserving the native maximum: the seed's
arithmetic, in raw bytes (no page rounding, no scratch).

The arena's page-exact count is :mod:`.arena`; these byte counts stay because the
seed's table is stated in them, and because the benchmarks compare an engine's peak
concurrency against "what the bytes hold".
"""

from __future__ import annotations

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    block_bytes,
    blocks_for_tokens,
    check_context,
    state_slot_bytes,
)


def paged_sequence_bytes(
    config: ModelConfig,
    context_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> int:
    """Bytes one sequence of ``context_len`` tokens holds under paging: whole blocks + its state."""
    check_context(config, context_len)
    return blocks_for_tokens(context_len, block_size) * block_bytes(
        config, block_size, kv_dtype
    ) + state_slot_bytes(config, include_conv, kv_dtype)


def reserved_blocks_per_sequence(config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks the reserve-the-maximum policy (the pre-paging baseline) takes per sequence
    at admission: ``max_position_embeddings`` rounded up to whole blocks."""
    return blocks_for_tokens(config.max_position_embeddings, block_size)


def reserved_sequence_bytes(
    config: ModelConfig,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> int:
    """Bytes one sequence holds when it reserves KV for ``max_position_embeddings`` up
    front (the pre-paging baseline), whatever its actual length, plus its state.

    The reservation is in whole blocks, as the engine's reserve-maximum policy takes
    it; for the usual power-of-two maxima that is exactly max x per-token bytes.
    """
    return reserved_blocks_per_sequence(config, block_size) * block_bytes(
        config, block_size, kv_dtype
    ) + state_slot_bytes(config, include_conv, kv_dtype)


def fit(pool: int, per_unit: int) -> int:
    """Whole units of ``per_unit`` bytes in ``pool`` (0 for a negative pool)."""
    if per_unit <= 0:
        raise ConfigError("this config keeps no per-sequence state (no layers?); check config.json")
    return max(pool, 0) // per_unit


def sessions_paged(
    config: ModelConfig,
    pool_bytes: int,
    context_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> int:
    """Sequences of ``context_len`` tokens that fit in ``pool_bytes`` under paging."""
    return fit(
        pool_bytes, paged_sequence_bytes(config, context_len, block_size, kv_dtype, include_conv)
    )


def sessions_reserved_max(
    config: ModelConfig,
    pool_bytes: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> int:
    """Sequences that fit in ``pool_bytes`` when each reserves the native maximum."""
    return fit(pool_bytes, reserved_sequence_bytes(config, block_size, kv_dtype, include_conv))
