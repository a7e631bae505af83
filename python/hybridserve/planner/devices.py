"""How many devices a model needs: N devices in tensor parallelism, each holding 1/N of
the sharded weights, a full copy of the replicated ones and its own arena.

**The rule** (what the future tensor-parallel engine will do, vLLM's way):

* Weights: per device ``ceil(sharded / N) + replicated`` parameters x the model dtype
  (from the parameter count, also when a checkpoint directory gave the one-device weights),
  with sharded / replicated as :func:`~hybridserve.planner.weights.param_split` classes
  them (norms, the MoE router and ``shared_expert_gate`` replicated; projections,
  experts, conv1d, embeddings and lm_head split).
* Memory for sequences: each device's arena holds 1/N of every sequence: the attention
  heads, KV heads and DeltaNet heads are split N ways, so the device's page layout is
  the layout of the **shard's shape** (:func:`shard_config`). With more devices than KV
  heads each device keeps one KV head (the heads are replicated, ``N / kv_heads``
  copies each), as vLLM does.
* A degree N is valid when N divides the attention heads, the DeltaNet key and value
  heads, and either divides the KV heads or is a multiple of them; the degrees tried are
  powers of two.
* Every sequence lives on all N devices, so the group runs as many sessions as one
  device's arena holds. A model *needs* the smallest valid N whose per-device weights
  leave a budget that holds ``min_sessions`` sessions of the context length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.planner.arena import ArenaPlan, size_arena
from hybridserve.planner.budget import usable_after_weights
from hybridserve.planner.sizes import DEFAULT_BLOCK_SIZE
from hybridserve.planner.units import GiB, ceil_div, positive_int
from hybridserve.planner.weights import param_split

#: Tensor-parallel degrees tried, smallest first.
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)


def shard_config(config: ModelConfig, n: int) -> ModelConfig | None:
    """The shape one of ``n`` tensor-parallel devices holds (heads split ``n`` ways, KV
    heads replicated when ``n`` exceeds them), or None when ``n`` does not divide the
    model's heads (not a valid degree)."""
    positive_int("tensor-parallel degree", n)
    kv = config.num_key_value_heads
    if (config.num_attention_heads % n or config.linear_num_key_heads % n
            or config.linear_num_value_heads % n or (kv % n and n % kv)):
        return None
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=max(1, kv // n),
        linear_num_key_heads=config.linear_num_key_heads // n,
        linear_num_value_heads=config.linear_num_value_heads // n,
    )


def weight_bytes_per_device(config: ModelConfig, n: int) -> int:
    """Weight bytes on each of ``n`` devices: ``ceil(sharded / n) + replicated``
    parameters x the model dtype (see the module's rule)."""
    positive_int("tensor-parallel degree", n)
    parts = param_split(config).values()
    sharded = sum(p.sharded for p in parts)
    replicated = sum(p.replicated for p in parts)
    return (ceil_div(sharded, n) + replicated) * dtype_bytes(config.torch_dtype)


@dataclass(frozen=True)
class DeviceShare:
    """One tensor-parallel degree: what each device holds and what the group runs."""

    tensor_parallel: int
    weight_bytes_per_device: int
    #: Budget left for each device's arena (negative: the weights alone do not fit).
    budget_bytes_per_device: int
    #: Copies of each KV head across the group (1 unless N > KV heads).
    kv_head_replicas: int
    #: Each device's arena, or None when its budget cannot hold one sequence.
    arena: ArenaPlan | None
    context_len: int
    sessions: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor_parallel": self.tensor_parallel,
            "weight_bytes_per_device": self.weight_bytes_per_device,
            "budget_bytes_per_device": self.budget_bytes_per_device,
            "kv_head_replicas": self.kv_head_replicas,
            "pages_per_device": None if self.arena is None else self.arena.num_pages,
            "page_bytes": None if self.arena is None else self.arena.page_bytes,
            "context_len": self.context_len,
            "sessions": self.sessions,
        }


def device_share(
    config: ModelConfig,
    n: int,
    *,
    device_memory: int,
    context_len: int,
    utilization: float = 0.9,
    reserve: int = 2 * GiB,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    cuda_graphs: bool = True,
) -> DeviceShare:
    """What ``n`` devices of ``device_memory`` bytes each hold and run (see the rule).
    ConfigError when ``n`` is not a valid degree for this model."""
    shard = shard_config(config, n)
    if shard is None:
        raise ConfigError(
            f"{n} devices cannot split this model's heads evenly ({config.num_attention_heads} "
            f"attention, {config.num_key_value_heads} KV, {config.linear_num_key_heads}/"
            f"{config.linear_num_value_heads} DeltaNet key/value); use a divisor"
        )
    weights = weight_bytes_per_device(config, n)
    budget = usable_after_weights(device_memory, weights, utilization=utilization, reserve=reserve)
    arena = None
    sessions = 0
    if budget > 0:
        try:
            arena = size_arena(shard, block_size=block_size, kv_dtype=kv_dtype,
                               budget_bytes=budget, cuda_graphs=cuda_graphs)
        except ConfigError:
            arena = None  # the budget holds not even one sequence: sessions stay 0
        if arena is not None:
            sessions = arena.sessions(context_len).sessions
    kv = config.num_key_value_heads
    return DeviceShare(
        tensor_parallel=n, weight_bytes_per_device=weights, budget_bytes_per_device=budget,
        kv_head_replicas=max(1, n // kv), arena=arena, context_len=context_len, sessions=sessions,
    )


@dataclass(frozen=True)
class DevicePlan:
    """The smallest tensor-parallel degree that runs ``min_sessions`` sessions of
    ``context_len`` tokens (``devices_needed``; None if no degree in
    :data:`TP_DEGREES` does) and every valid degree up to it (``shares``)."""

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
) -> DevicePlan:
    """Walk the valid degrees of :data:`TP_DEGREES` from 1 until one runs
    ``min_sessions`` sessions of ``context_len`` tokens. O(len(TP_DEGREES))."""
    positive_int("minimum sessions", min_sessions)
    shares: list[DeviceShare] = []
    needed = None
    for n in TP_DEGREES:
        if shard_config(config, n) is None:
            continue
        share = device_share(
            config, n, device_memory=device_memory, context_len=context_len,
            utilization=utilization, reserve=reserve, block_size=block_size,
            kv_dtype=kv_dtype, cuda_graphs=cuda_graphs,
        )
        shares.append(share)
        if share.sessions >= min_sessions:
            needed = n
            break
    return DevicePlan(device_memory, context_len, min_sessions, needed, tuple(shares))
