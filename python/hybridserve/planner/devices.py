"""How many devices a model needs: N devices in tensor parallelism, each holding one
rank's shard of the weights, a full copy of the replicated ones and its own arena.

**The rule** (what the tensor-parallel engine does, vLLM's way; the shapes are
:func:`~hybridserve.planner.rank.rank_config`'s):

* Weights: per device the parameters of the rank's shapes (1/N of every split tensor,
  one KV head's projections when N exceeds the KV heads, every replicated tensor
  whole) x the model dtype (from the parameter count, also when a checkpoint directory
  gave the one-device weights).
* Memory for sequences: each device's arena holds its share of every sequence: its
  query and KV heads' K/V (a page is one 16-token KV block of the rank's KV heads over
  all attention layers) and its DeltaNet heads' state (1/N of it), so the device's page
  layout is the layout of the rank's shape. With more devices than KV heads each
  device keeps one KV head (replicated, ``N / kv_heads`` copies each), as vLLM does.
* A degree N is valid when it divides every split dimension (attention heads, DeltaNet
  key heads, the intermediate widths, the vocabulary) and either divides the KV heads
  or is a multiple of them (:func:`~hybridserve.planner.rank.valid_degrees`).
* Every sequence lives on all N devices, so the group runs as many sessions as one
  device's arena holds. A model *needs* the smallest valid N whose per-device weights
  leave a budget that holds ``min_sessions`` sessions of the context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.planner.arena import ArenaPlan, size_arena
from hybridserve.planner.budget import usable_after_weights
from hybridserve.planner.rank import (
    MAX_TENSOR_PARALLEL,
    degree_error,
    kv_head_replicas,
    rank_config,
    rank_mtp_param_count,
    rank_param_split,
    rank_weight_bytes,
    valid_degrees,
)
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    cache_dtype,
    conv_state_bytes,
    kv_bytes_per_token,
    matrix_state_bytes,
)
from hybridserve.planner.units import GiB, positive_int


def shard_config(config: ModelConfig, n: int) -> ModelConfig | None:
    """The shapes one of ``n`` devices holds (:func:`~hybridserve.planner.rank.rank_config`),
    or None when ``n`` is not a valid degree for this model."""
    return None if degree_error(config, n) else rank_config(config, n)


def weight_bytes_per_device(config: ModelConfig, n: int) -> int:
    """Weight bytes on each of ``n`` devices (see the module's rule); ConfigError naming
    the dimension when ``n`` does not shard the model."""
    return rank_weight_bytes(config, n)


@dataclass(frozen=True)
class DeviceShare:
    """One tensor-parallel degree: what each device holds and what the group runs."""

    tensor_parallel: int
    #: Parameters on each device, and those of them every device holds whole.
    params_per_device: int
    replicated_params_per_device: int
    weight_bytes_per_device: int
    #: Budget left for each device's arena (negative: the weights alone do not fit).
    budget_bytes_per_device: int
    #: Copies of each KV head across the group (1 unless N > KV heads).
    kv_head_replicas: int
    #: Each device's share of one token's KV, and of one sequence's DeltaNet state
    #: (matrix state float32 + conv state in the cache dtype), before page rounding.
    kv_bytes_per_token_per_device: int
    state_bytes_per_sequence_per_device: int
    #: Each device's arena, or None when its budget cannot hold one sequence.
    arena: ArenaPlan | None
    context_len: int
    sessions: int
    #: Of ``weight_bytes_per_device``: the device's shard of the MTP layer (speculative
    #: decoding; 0 without).
    mtp_weight_bytes_per_device: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor_parallel": self.tensor_parallel,
            "mtp_weight_bytes_per_device": self.mtp_weight_bytes_per_device,
            "params_per_device": self.params_per_device,
            "replicated_params_per_device": self.replicated_params_per_device,
            "weight_bytes_per_device": self.weight_bytes_per_device,
            "budget_bytes_per_device": self.budget_bytes_per_device,
            "kv_head_replicas": self.kv_head_replicas,
            "kv_bytes_per_token_per_device": self.kv_bytes_per_token_per_device,
            "state_bytes_per_sequence_per_device": self.state_bytes_per_sequence_per_device,
            "pages_per_device": None if self.arena is None else self.arena.num_pages,
            "page_bytes": None if self.arena is None else self.arena.page_bytes,
            "state_pages": None if self.arena is None else self.arena.state_pages,
            "pages_per_session": None if self.arena is None else self.arena.pages_for_sequence(self.context_len),
            "context_len": self.context_len,
            "sessions": self.sessions,
            "arena": None if self.arena is None else self.arena.to_dict(),
        }


def device_share(
    config: ModelConfig,
    n: int,
    *,
    device_memory: int | None = None,
    context_len: int,
    utilization: float = 0.9,
    reserve: int = 2 * GiB,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    cuda_graphs: bool = True,
    budget_bytes: int | None = None,
    max_num_seqs: int | None = None,
    speculative_tokens: int = 0,
) -> DeviceShare:
    """What ``n`` devices hold and run: each device's budget is ``budget_bytes`` when
    given (an explicit per-device arena budget), else what ``device_memory`` leaves after
    the device's weights (see the rule). ConfigError naming the dimension when ``n`` is
    not a valid degree for this model. ``speculative_tokens`` k > 0: speculative decoding
    with the MTP layer (the device's shard of its weights, its KV in every page: the layer
    is sharded like a decoder layer)."""
    shard = rank_config(config, n)
    split = rank_param_split(config, n).values()
    weights = rank_weight_bytes(config, n)
    mtp_weights = rank_mtp_param_count(config, n) * dtype_bytes(config.torch_dtype) if speculative_tokens else 0
    weights += mtp_weights
    if budget_bytes is not None:
        budget = positive_int("per-device arena budget in bytes", budget_bytes)
    elif device_memory is None:
        raise ConfigError("give either the device memory or each device's arena budget")
    else:
        budget = usable_after_weights(device_memory, weights, utilization=utilization, reserve=reserve)
    kv_dtype = cache_dtype(config, kv_dtype)
    arena = None
    sessions = 0
    if budget > 0:
        try:
            arena = size_arena(shard, block_size=block_size, kv_dtype=kv_dtype, budget_bytes=budget,
                               cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs,
                               speculative_tokens=speculative_tokens)
        except ConfigError:
            arena = None  # the budget holds not even one sequence: sessions stay 0
        if arena is not None:
            sessions = arena.sessions(context_len).sessions
    return DeviceShare(
        tensor_parallel=n,
        params_per_device=sum(p.total for p in split),
        replicated_params_per_device=sum(p.replicated for p in split),
        weight_bytes_per_device=weights,
        budget_bytes_per_device=budget,
        kv_head_replicas=kv_head_replicas(config, n),
        kv_bytes_per_token_per_device=kv_bytes_per_token(shard, kv_dtype),
        state_bytes_per_sequence_per_device=matrix_state_bytes(shard) + conv_state_bytes(shard, kv_dtype),
        arena=arena, context_len=context_len, sessions=sessions, mtp_weight_bytes_per_device=mtp_weights,
    )


@dataclass(frozen=True)
class DevicePlan:
    """The smallest tensor-parallel degree that runs ``min_sessions`` sessions of
    ``context_len`` tokens (``devices_needed``; None if no valid degree up to
    :data:`~hybridserve.planner.rank.MAX_TENSOR_PARALLEL` does) and every valid degree
    up to it (``shares``)."""

    device_memory: int
    context_len: int
    min_sessions: int
    devices_needed: int | None
    shares: tuple[DeviceShare, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_memory": self.device_memory, "context_len": self.context_len,
            "min_sessions": self.min_sessions, "devices_needed": self.devices_needed,
            "shares": [s.to_dict() for s in self.shares],
        }


def devices_needed(
    config: ModelConfig,
    *,
    device_memory: int,
    context_len: int,
    min_sessions: int = 1,
    utilization: float = 0.9,
    reserve: int = 2 * GiB,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    cuda_graphs: bool = True,
    speculative_tokens: int = 0,
) -> DevicePlan:
    """Walk the valid degrees from 1 (:func:`~hybridserve.planner.rank.valid_degrees`)
    until one runs ``min_sessions`` sessions of ``context_len`` tokens. O(64)."""
    positive_int("minimum sessions", min_sessions)
    shares: list[DeviceShare] = []
    needed = None
    degrees = valid_degrees(config, MAX_TENSOR_PARALLEL)
    for n in degrees:
        share = device_share(
            config, n, device_memory=device_memory, context_len=context_len,
            utilization=utilization, reserve=reserve, block_size=block_size,
            kv_dtype=kv_dtype, cuda_graphs=cuda_graphs, speculative_tokens=speculative_tokens,
        )
        shares.append(share)
        if share.sessions >= min_sessions:
            needed = n
            break
    return DevicePlan(device_memory, context_len, min_sessions, needed, tuple(shares))
