"""What one token, one KV block and one sequence's DeltaNet state cost, in bytes.

The model is hybrid, so a sequence costs two kinds of memory:

* **KV cache** of the full-attention layers only, growing with the sequence, paged in
  blocks of ``block_size`` tokens; one block holds K and V of every attention layer for
  those tokens (the seed's "1 MiB block").
* **DeltaNet state** of the linear-attention layers, fixed-size per sequence: a float32
  matrix state (value heads x key_head_dim x value_head_dim per layer) and a causal-conv
  state (conv channels x (kernel - 1) per layer) kept in the **cache dtype**, as the
  cache allocates it.

These are the raw sizes, without the arena's page rounding; how they land in pages is
:mod:`hybridserve.memory.layout`'s business (see :mod:`.arena`).
"""

from __future__ import annotations

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.planner.units import ceil_div, positive_int

#: The DeltaNet matrix state is kept in float32 whatever the model dtype: the
#: recurrence accumulates over the whole sequence, where bf16 rounding would drift.
MATRIX_STATE_DTYPE = "float32"

DEFAULT_BLOCK_SIZE = 16


def cache_dtype(config: ModelConfig, kv_dtype: str | None) -> str:
    """The cache dtype (KV and conv state): ``kv_dtype``, or the model dtype when None."""
    return config.torch_dtype if kv_dtype is None else kv_dtype


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str | None = None) -> int:
    """KV bytes one token occupies: attention layers x (K, V) x kv heads x head_dim x dtype.

    ``kv_dtype`` is the cache dtype (defaults to the model dtype). DeltaNet layers keep
    no per-token cache, so they contribute nothing.
    """
    return (
        config.num_full_attention_layers
        * 2
        * config.num_key_value_heads
        * config.head_dim
        * dtype_bytes(cache_dtype(config, kv_dtype))
    )


def block_bytes(
    config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str | None = None
) -> int:
    """Bytes of one KV block: ``block_size`` tokens of K and V across all attention layers."""
    positive_int("block_size", block_size)
    return block_size * kv_bytes_per_token(config, kv_dtype)


def blocks_for_tokens(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a sequence of ``num_tokens`` occupies: rounded up (one partly-filled tail)."""
    if num_tokens < 0:
        raise ConfigError(f"a token count cannot be negative, got {num_tokens}")
    return ceil_div(num_tokens, positive_int("block_size", block_size))


def matrix_state_bytes(config: ModelConfig) -> int:
    """DeltaNet matrix state of one sequence: linear layers x value heads x d_k x d_v x 4 B.

    Fixed size whatever the sequence length; float32 (:data:`MATRIX_STATE_DTYPE`).
    """
    return (
        config.num_linear_attention_layers
        * config.linear_num_value_heads
        * config.linear_key_head_dim
        * config.linear_value_head_dim
        * dtype_bytes(MATRIX_STATE_DTYPE)
    )


def conv_state_bytes(config: ModelConfig, kv_dtype: str | None = None) -> int:
    """DeltaNet causal-conv state of one sequence: linear layers x conv channels x (kernel-1)
    x the **cache** dtype (``kv_dtype``, default the model dtype).

    The cache allocates it in the KV dtype (it holds the last ``kernel - 1`` projected
    inputs next to the KV); the planner used to size it in the model dtype, which is
    wrong whenever the two differ (e.g. an fp8 cache on a bf16 model). The seed's
    arithmetic leaves it out; it is 2% of the matrix state at the 27B shape.
    """
    return (
        config.num_linear_attention_layers
        * config.linear_conv_dim
        * (config.linear_conv_kernel_dim - 1)
        * dtype_bytes(cache_dtype(config, kv_dtype))
    )


def state_slot_bytes(
    config: ModelConfig, include_conv: bool = True, kv_dtype: str | None = None
) -> int:
    """Bytes of one sequence's DeltaNet state: the matrix state, plus the conv state (in
    the cache dtype) unless excluded. No page rounding (see :mod:`.arena` for that)."""
    return matrix_state_bytes(config) + (conv_state_bytes(config, kv_dtype) if include_conv else 0)


def check_context(config: ModelConfig, context_len: int) -> int:
    """``context_len`` if it is a positive int within the model's native maximum."""
    positive_int("context length", context_len)
    if context_len > config.max_position_embeddings:
        raise ConfigError(
            f"context length {context_len:,} exceeds the model's native maximum "
            f"{config.max_position_embeddings:,} (max_position_embeddings); ask for less"
        )
    return context_len
