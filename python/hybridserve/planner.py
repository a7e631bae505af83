"""Capacity planner: how many sequences fit, and how to split memory between two pools.

Pure integer arithmetic over a :class:`~hybridserve.config.ModelConfig` (no torch, so
``hybridserve plan`` runs anywhere a config.json does). The engine sizes its pools
with :func:`size_pools`; the CLI renders :func:`capacity_report`.

The model is hybrid, so a sequence costs two kinds of memory:

* **KV cache** of the full-attention layers only, growing with the sequence. It is
  paged in blocks of ``block_size`` tokens; one block holds K and V of every
  attention layer for those tokens (the "1 MiB block" of the seed).
* **DeltaNet state** of the linear-attention layers, fixed-size per sequence: a
  float32 matrix state (value heads x key_head_dim x value_head_dim per layer) and a
  causal-conv state (conv channels x (kernel - 1) per layer, in the model's dtype).
  One *state slot* holds both.

All byte counts are exact integers; nothing here rounds except where it says so
(KV rounded up to whole blocks, counts of sessions rounded down).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import CheckpointError, ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: The DeltaNet matrix state is kept in float32 whatever the model dtype: the
#: recurrence accumulates over the whole sequence, where bf16 rounding would drift.
MATRIX_STATE_DTYPE = "float32"

DEFAULT_BLOCK_SIZE = 16

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": KiB,
    "MIB": MiB,
    "GIB": GiB,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
_SIZE_HINT = (
    "write a number with a unit: decimal KB/MB/GB/TB (80GB = 80,000,000,000 bytes), "
    "binary KiB/MiB/GiB/TiB (80GiB, 23859MiB) or B for bytes"
)


def parse_size(text: str) -> int:
    """Bytes in a human size: ``"80GB"`` (decimal), ``"80GiB"``, ``"23859MiB"``, ``"512B"``.

    Units are case-insensitive; a fractional value (``"23.3GiB"``) is rounded down to
    whole bytes. A bare number or a bare ``G``/``M`` is refused because it is ambiguous
    (decimal or binary?). Raises :class:`ConfigError` whose message says what to write.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read size {text!r}: {_SIZE_HINT}")
    value, unit = m.group(1), m.group(2).upper()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown unit {m.group(2)!r} in size {text!r}: {_SIZE_HINT}")
    # Exact for integers; fractional values go through the decimal digits so that
    # "1.5GiB" is exactly 1.5 * 2**30 rather than a float approximation.
    whole, _, frac = value.partition(".")
    scale = _SIZE_UNITS[unit]
    nbytes = int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    if nbytes <= 0:
        raise ConfigError(f"size {text!r} must be positive: {_SIZE_HINT}")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1: ``2.8125 MiB``, ``16 GiB``.

    Up to 4 decimals, trailing zeros dropped, thousands separated. For a fixed unit
    (pools are quoted in MiB) use :func:`format_mib`.
    """
    n = float(nbytes)
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{_num(n / scale)} {unit}"
    return f"{_num(n)} B"


def format_mib(nbytes: int | float) -> str:
    """A byte count in MiB (``23,859 MiB``), the unit the seed uses for pools."""
    return f"{_num(nbytes / MiB)} MiB"


def _num(x: float) -> str:
    s = f"{x:,.4f}".rstrip("0").rstrip(".")
    return s if s != "-0" else "0"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _kv_dtype(config: ModelConfig, kv_dtype: str | None) -> str:
    return config.torch_dtype if kv_dtype is None else kv_dtype


# ---- per-token, per-block and per-sequence sizes ---------------------------------


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
        * dtype_bytes(_kv_dtype(config, kv_dtype))
    )


def block_bytes(
    config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str | None = None
) -> int:
    """Bytes of one KV block: ``block_size`` tokens of K and V across all attention layers."""
    _positive_int("block_size", block_size)
    return block_size * kv_bytes_per_token(config, kv_dtype)


def blocks_for_tokens(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a sequence of ``num_tokens`` occupies: rounded up (one partly-filled tail)."""
    if num_tokens < 0:
        raise ConfigError(f"a token count cannot be negative, got {num_tokens}")
    return _ceil_div(num_tokens, _positive_int("block_size", block_size))


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


def conv_state_bytes(config: ModelConfig) -> int:
    """DeltaNet causal-conv state of one sequence: linear layers x conv channels x (kernel-1).

    Kept in the model dtype (it holds the last ``kernel - 1`` projected inputs). The
    seed's arithmetic leaves it out; it is 2% of the matrix state at the 27B shape.
    """
    return (
        config.num_linear_attention_layers
        * config.linear_conv_dim
        * (config.linear_conv_kernel_dim - 1)
        * dtype_bytes(config.torch_dtype)
    )


def state_slot_bytes(config: ModelConfig, include_conv: bool = True) -> int:
    """Bytes of one DeltaNet state slot: the matrix state, plus the conv state unless excluded."""
    return matrix_state_bytes(config) + (conv_state_bytes(config) if include_conv else 0)


# ---- weights --------------------------------------------------------------------


def param_breakdown(config: ModelConfig) -> dict[str, int]:
    """Parameter count of the language model, by part, for the HF Qwen3.5 layout.

    Counts what ``Qwen3_5ForCausalLM`` holds (for a ``qwen3_5`` VL config: its
    language model only, not the vision tower, which hybridserve does not load):
    ``embed_tokens``; ``lm_head`` unless ``tie_word_embeddings``; per full-attention
    layer q_proj (doubled for the sigmoid output gate), k/v/o_proj, q/k RMSNorm (and
    biases when ``attention_bias``); per DeltaNet layer in_proj_qkv/z/b/a, depthwise
    conv1d (no bias), dt_bias, A_log, gated RMSNorm over one head, out_proj; per layer
    the SwiGLU MLP and two RMSNorms; the final norm.
    """
    c = config
    h = c.hidden_size
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    attn = h * 2 * q_out + 2 * h * kv_out + q_out * h + 2 * c.head_dim
    if c.raw.get("attention_bias", False):
        attn += 2 * q_out + 2 * kv_out + h
    conv_dim = c.linear_conv_dim
    value_dim = c.linear_value_dim
    heads = c.linear_num_value_heads
    delta = (
        h * conv_dim  # in_proj_qkv
        + h * value_dim  # in_proj_z
        + 2 * h * heads  # in_proj_b, in_proj_a
        + conv_dim * c.linear_conv_kernel_dim  # conv1d, depthwise, no bias
        + 2 * heads  # dt_bias, A_log
        + c.linear_value_head_dim  # gated norm, shared across heads
        + value_dim * h  # out_proj
    )
    mlp = 3 * h * c.intermediate_size
    return {
        "embed_tokens": c.vocab_size * h,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * h,
        "full_attention": c.num_full_attention_layers * attn,
        "linear_attention": c.num_linear_attention_layers * delta,
        "mlp": c.num_hidden_layers * mlp,
        "norms": c.num_hidden_layers * 2 * h + h,
    }


def param_count(config: ModelConfig) -> int:
    """Total parameters of the language model (see :func:`param_breakdown`)."""
    return sum(param_breakdown(config).values())


#: Tensors of a checkpoint that a text-only engine never loads.
_NOT_LOADED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


def checkpoint_weight_bytes(path: str | os.PathLike[str], *, text_only: bool = True) -> int:
    """Bytes of tensor data in a checkpoint's ``*.safetensors`` files (headers excluded).

    Reads only each file's JSON header (no tensor data, no torch). With ``text_only``,
    tensors the text engine does not load (vision tower, multi-token-prediction head)
    are left out. Raises :class:`CheckpointError` if there are no safetensors files or
    a header is malformed.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; pass a checkpoint directory")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {path!r}; pass a config.json to count weights "
            "from the parameter count instead"
        )
    total = 0
    for name in files:
        fpath = os.path.join(path, name)
        try:
            with open(fpath, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > 100 * MiB:
                    raise ValueError(f"header length {hlen} is implausible")
                header = json.loads(f.read(hlen))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if text_only and key.startswith(_NOT_LOADED_PREFIXES):
                    continue
                begin, end = info["data_offsets"]
                total += int(end) - int(begin)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise CheckpointError(f"cannot read safetensors header of {fpath!r}: {e}") from None
    return total


def weight_bytes(config: ModelConfig, checkpoint_dir: str | os.PathLike[str] | None = None) -> int:
    """Device bytes of the weights: the checkpoint's tensor bytes if a directory is
    given, else :func:`param_count` x the model dtype's size."""
    if checkpoint_dir is not None:
        return checkpoint_weight_bytes(checkpoint_dir)
    return param_count(config) * dtype_bytes(config.torch_dtype)


def pool_from_device(
    device_memory: int, weights: int, *, utilization: float = 0.9, reserve: int = 2 * GiB
) -> int:
    """Bytes left for the two pools: ``floor(device_memory x utilization) - weights - reserve``.

    ``reserve`` covers the runtime (activations, CUDA context, allocator slack).
    Raises :class:`ConfigError` saying what to change if nothing is left.
    """
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(
            f"gpu memory utilization must be in (0, 1], got {utilization}; e.g. 0.9"
        )
    if reserve < 0:
        raise ConfigError(f"runtime reserve cannot be negative, got {reserve}")
    usable = int(device_memory * utilization)
    pool = usable - weights - reserve
    if pool <= 0:
        raise ConfigError(
            f"no memory left for the KV and state pools: {format_bytes(usable)} usable "
            f"({format_bytes(device_memory)} x {utilization}) - weights {format_bytes(weights)} "
            f"- reserve {format_bytes(reserve)} = {format_bytes(pool)}; use a larger device, "
            "a higher utilization, a smaller reserve, or give the pool size explicitly"
        )
    return pool


# ---- sessions that fit ----------------------------------------------------------


def _check_context(config: ModelConfig, context_len: int) -> int:
    _positive_int("context length", context_len)
    if context_len > config.max_position_embeddings:
        raise ConfigError(
            f"context length {context_len:,} exceeds the model's native maximum "
            f"{config.max_position_embeddings:,} (max_position_embeddings); ask for less"
        )
    return context_len


def paged_sequence_bytes(
    config: ModelConfig,
    context_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
) -> int:
    """Bytes one sequence of ``context_len`` tokens holds under paging: whole blocks + one slot."""
    _check_context(config, context_len)
    return blocks_for_tokens(context_len, block_size) * block_bytes(
        config, block_size, kv_dtype
    ) + state_slot_bytes(config, include_conv)


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
    front (the pre-paging baseline), whatever its actual length, plus one state slot.

    The reservation is in whole blocks, as the engine's reserve-maximum policy takes
    it; for the usual power-of-two maxima that is exactly max x per-token bytes.
    """
    return reserved_blocks_per_sequence(config, block_size) * block_bytes(
        config, block_size, kv_dtype
    ) + state_slot_bytes(config, include_conv)


def _fit(pool: int, per_unit: int) -> int:
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
    return _fit(
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
    return _fit(pool_bytes, reserved_sequence_bytes(config, block_size, kv_dtype, include_conv))


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
    """Memory of ``count`` sequences sharing a ``shared_len``-token prefix (see
    :class:`SharingPlan`). O(1)."""
    _check_context(config, context_len)
    _positive_int("number of sequences", count)
    if not 0 <= shared_len <= context_len:
        raise ConfigError(
            f"shared prefix of {shared_len:,} tokens must be between 0 and the context "
            f"length {context_len:,}"
        )
    bb = block_bytes(config, block_size, kv_dtype)
    slot = state_slot_bytes(config, include_conv)
    shared = shared_len // block_size
    private = blocks_for_tokens(context_len, block_size) - shared
    per_seq_private = private * bb + slot
    total_blocks = shared + count * private
    shared_bytes = shared * bb
    checkpoints = 1 if shared > 0 else 0
    return SharingPlan(
        count=count,
        context_len=context_len,
        shared_len=shared_len,
        block_size=block_size,
        shared_blocks=shared,
        private_blocks=private,
        total_blocks=total_blocks,
        total_bytes=total_blocks * bb + count * slot,
        bytes_without_sharing=count * paged_sequence_bytes(
            config, context_len, block_size, kv_dtype, include_conv
        ),
        max_count=_fit(pool_bytes - shared_bytes - checkpoints * slot, per_seq_private),
        max_count_without_sharing=sessions_paged(
            config, pool_bytes, context_len, block_size, kv_dtype, include_conv
        ),
        checkpoint_slots=checkpoints,
        checkpoint_bytes=checkpoints * slot,
        max_count_evicting_checkpoint=_fit(pool_bytes - shared_bytes, per_seq_private),
    )


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
    """How many ``n``-sample requests fit, each sample at ``context_len`` tokens.

    ``prompt_len`` defaults to ``context_len - 1``: the step after prefill, when every
    sample has written its first token, so each holds one (copied, partly-filled)
    tail block and one state slot of its own beyond the shared full prompt blocks.
    ``prompt_len`` must be < ``context_len`` (samples diverge at their first token).
    """
    _positive_int("n (samples per request)", n)
    _check_context(config, context_len)
    prompt = context_len - 1 if prompt_len is None else prompt_len
    if not 0 <= prompt < context_len:
        raise ConfigError(
            f"prompt length {prompt:,} must be below the per-sample context length "
            f"{context_len:,}: each sample holds the prompt plus at least one token of its own"
        )
    req = sharing_plan(config, pool_bytes, context_len, prompt, n, block_size, kv_dtype, include_conv)
    return ParallelSamplingPlan(
        n=n,
        per_request=req,
        bytes_per_request=req.total_bytes,
        requests_that_fit=_fit(pool_bytes, req.total_bytes),
        requests_that_fit_without_sharing=_fit(pool_bytes, req.bytes_without_sharing),
    )


# ---- splitting one budget between the two pools (what the engine allocates) ------


@dataclass(frozen=True)
class PoolPlan:
    """How the engine lays out its memory: ``num_blocks`` KV blocks and
    ``num_state_slots`` DeltaNet slots, from ``pool_bytes``.

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

    Each slot holds the matrix state (float32) and the conv state (model dtype).
    Raises :class:`ConfigError` if none of the three is given, or if the pool cannot
    hold the slots plus one block (or one sequence of ``expected_context_len``).
    O(1).
    """
    _positive_int("pool size in bytes", pool_bytes)
    kv_dtype = _kv_dtype(config, kv_dtype)
    bb = block_bytes(config, block_size, kv_dtype)
    slot = state_slot_bytes(config, include_conv=True)
    if max_num_seqs is not None:
        _positive_int("max_num_seqs", max_num_seqs)
    if num_state_slots is not None:
        slots = _positive_int("num_state_slots", num_state_slots)
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
        conv_dtype=config.torch_dtype,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        block_bytes=bb,
        matrix_state_bytes=matrix_state_bytes(config),
        conv_state_bytes=conv_state_bytes(config),
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
    _positive_int("context length", context_len)
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


# ---- the whole report (what `hybridserve plan` prints) -------------------------------


@dataclass(frozen=True)
class CapacityReport:
    """Everything ``hybridserve plan`` reports; :meth:`to_dict` is its ``--json`` object."""

    model_type: str
    num_layers: int
    num_full_attention_layers: int
    num_linear_attention_layers: int
    max_position_embeddings: int
    context_len: int
    block_size: int
    kv_dtype: str
    model_dtype: str
    kv_bytes_per_token: int
    block_bytes: int
    kv_bytes_per_sequence: int
    kv_bytes_at_native_max: int
    state_bytes_per_sequence: int
    conv_state_bytes_per_sequence: int
    conv_state_counted: bool
    param_count: int
    weight_bytes: int
    weight_source: str
    pool_bytes: int
    pool_source: str
    session_bytes_paged: int
    session_bytes_paged_without_conv: int
    session_bytes_reserved_max: int
    sessions_paged: int
    sessions_paged_without_conv: int
    sessions_reserved_max: int
    shared_prefix: SharingPlan | None = None
    parallel_sampling: ParallelSamplingPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("shared_prefix", "parallel_sampling")}
        d["pool_mib"] = self.pool_bytes / MiB
        d["shared_prefix"] = self.shared_prefix.to_dict() if self.shared_prefix else None
        d["parallel_sampling"] = (
            self.parallel_sampling.to_dict() if self.parallel_sampling else None
        )
        return d


def capacity_report(
    config: ModelConfig,
    *,
    context_len: int,
    pool_bytes: int | None = None,
    device_memory: int | None = None,
    utilization: float = 0.9,
    reserve: int = 2 * GiB,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
    shared_prefix_len: int | None = None,
    sessions: int | None = None,
    n: int = 1,
    prompt_len: int | None = None,
) -> CapacityReport:
    """The full capacity picture at ``context_len``.

    The pool is ``pool_bytes`` if given, else derived from ``device_memory`` (see
    :func:`pool_from_device`). ``include_conv`` decides whether the session counts
    charge the conv state (the engine does; the seed does not, hence
    ``sessions_paged_without_conv``). The shared-prefix scenario needs
    ``shared_prefix_len`` and ``sessions``; the sampling scenario runs when ``n > 1``.
    """
    kv_dtype = _kv_dtype(config, kv_dtype)
    _check_context(config, context_len)
    params = param_count(config)
    weights = weight_bytes(config, checkpoint_dir)
    weight_source = (
        f"safetensors tensors in {os.fspath(checkpoint_dir)}"
        if checkpoint_dir is not None
        else f"{params:,} parameters x {dtype_bytes(config.torch_dtype)} B ({config.torch_dtype})"
    )
    if pool_bytes is not None:
        _positive_int("pool size in bytes", pool_bytes)
        pool, pool_source = pool_bytes, "given explicitly"
    else:
        if device_memory is None:
            raise ConfigError("give either the pool size or the device memory")
        pool = pool_from_device(device_memory, weights, utilization=utilization, reserve=reserve)
        pool_source = (
            f"{_num(device_memory / 1e9)} GB x {utilization} - weights "
            f"{_num(weights / 1e9)} GB - reserve {format_bytes(reserve)}"
        )
    bb = block_bytes(config, block_size, kv_dtype)
    shared = None
    if shared_prefix_len is not None or sessions is not None:
        if shared_prefix_len is None or sessions is None:
            raise ConfigError("the shared-prefix scenario needs both a prefix length and a session count")
        shared = sharing_plan(
            config, pool, context_len, shared_prefix_len, sessions, block_size, kv_dtype, include_conv
        )
    sampling = None
    if n != 1:
        sampling = parallel_sampling_plan(
            config, pool, context_len, n, prompt_len, block_size, kv_dtype, include_conv
        )
    elif prompt_len is not None:
        raise ConfigError("a prompt length only matters with n > 1 samples per request")
    return CapacityReport(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_full_attention_layers=config.num_full_attention_layers,
        num_linear_attention_layers=config.num_linear_attention_layers,
        max_position_embeddings=config.max_position_embeddings,
        context_len=context_len,
        block_size=block_size,
        kv_dtype=kv_dtype,
        model_dtype=config.torch_dtype,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        block_bytes=bb,
        kv_bytes_per_sequence=blocks_for_tokens(context_len, block_size) * bb,
        kv_bytes_at_native_max=config.max_position_embeddings * kv_bytes_per_token(config, kv_dtype),
        state_bytes_per_sequence=matrix_state_bytes(config),
        conv_state_bytes_per_sequence=conv_state_bytes(config),
        conv_state_counted=include_conv,
        param_count=params,
        weight_bytes=weights,
        weight_source=weight_source,
        pool_bytes=pool,
        pool_source=pool_source,
        session_bytes_paged=paged_sequence_bytes(config, context_len, block_size, kv_dtype, include_conv),
        session_bytes_paged_without_conv=paged_sequence_bytes(
            config, context_len, block_size, kv_dtype, include_conv=False
        ),
        session_bytes_reserved_max=reserved_sequence_bytes(
            config, block_size, kv_dtype, include_conv
        ),
        sessions_paged=sessions_paged(config, pool, context_len, block_size, kv_dtype, include_conv),
        sessions_paged_without_conv=sessions_paged(
            config, pool, context_len, block_size, kv_dtype, include_conv=False
        ),
        sessions_reserved_max=sessions_reserved_max(
            config, pool, block_size, kv_dtype, include_conv
        ),
        shared_prefix=shared,
        parallel_sampling=sampling,
    )


__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "DEFAULT_BLOCK_SIZE",
    "MATRIX_STATE_DTYPE",
    "parse_size",
    "format_bytes",
    "format_mib",
    "kv_bytes_per_token",
    "block_bytes",
    "blocks_for_tokens",
    "matrix_state_bytes",
    "conv_state_bytes",
    "state_slot_bytes",
    "param_breakdown",
    "param_count",
    "checkpoint_weight_bytes",
    "weight_bytes",
    "pool_from_device",
    "paged_sequence_bytes",
    "reserved_blocks_per_sequence",
    "reserved_sequence_bytes",
    "sessions_paged",
    "sessions_reserved_max",
    "SharingPlan",
    "sharing_plan",
    "ParallelSamplingPlan",
    "parallel_sampling_plan",
    "PoolPlan",
    "size_pools",
    "max_concurrency",
    "max_concurrency_reserved",
    "format_pool_log",
    "format_max_concurrency",
    "CapacityReport",
    "capacity_report",
]
