"""Capacity planner: how many sequences fit, how big the arena is, how many devices a
model needs. Pure integer arithmetic over a :class:`~hybridserve.config.ModelConfig`
(no torch, so ``hybridserve plan`` runs anywhere a config.json does).

One module per concern, arithmetic apart from reports:

* :mod:`.units` -- byte sizes people write and read (``80GB``, ``23,859 MiB``);
* :mod:`.sizes` -- bytes of a token's KV, a KV block, a sequence's DeltaNet state;
* :mod:`.weights` -- exact parameter counts (dense and MoE), sharded vs replicated,
  checkpoint bytes;
* :mod:`.budget` -- the one byte budget a device leaves for the arena;
* :mod:`.arena` -- pages the budget holds and sessions that fit (what the engine calls
  at start-up: :func:`size_arena`, :func:`format_arena_log`);
* :mod:`.sessions` -- the seed's raw-byte session counts (paged vs reserve-max);
* :mod:`.sharing` -- shared prefixes and parallel samples;
* :mod:`.rank` -- the shapes one tensor-parallel rank holds (the split rule, valid
  degrees, a clear error naming the dimension a degree does not divide);
* :mod:`.devices` -- per-device weights and arenas, devices needed under tensor parallelism;
* :mod:`.split` -- the pre-arena KV/state split, kept as the benchmarks' baseline;
* :mod:`.report` -- :func:`capacity_report` and the ``hybridserve plan`` table.
"""

from hybridserve.planner.arena import (
    DEFAULT_CONTEXT_LENS,
    ArenaPlan,
    SessionFit,
    context_lens_for,
    format_arena_log,
    size_arena,
)
from hybridserve.planner.budget import (
    DEVICE_MEMORY,
    device_memory_bytes,
    pool_from_device,
    usable_after_weights,
)
from hybridserve.planner.devices import (
    DevicePlan,
    DeviceShare,
    device_share,
    devices_needed,
    shard_config,
    weight_bytes_per_device,
)
from hybridserve.planner.rank import (
    MAX_TENSOR_PARALLEL,
    check_degree,
    degree_error,
    kv_head_replicas,
    rank_config,
    rank_mtp_param_count,
    rank_param_count,
    rank_param_split,
    rank_weight_bytes,
    valid_degrees,
)
from hybridserve.planner.report import CapacityReport, capacity_report, render_plan
from hybridserve.planner.sessions import (
    paged_sequence_bytes,
    reserved_blocks_per_sequence,
    reserved_sequence_bytes,
    sessions_paged,
    sessions_reserved_max,
)
from hybridserve.planner.sharing import (
    ParallelSamplingPlan,
    SharingPlan,
    arena_parallel_sampling_plan,
    arena_sharing_plan,
    parallel_sampling_plan,
    sharing_plan,
)
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    MATRIX_STATE_DTYPE,
    block_bytes,
    blocks_for_tokens,
    conv_state_bytes,
    kv_bytes_per_token,
    matrix_state_bytes,
    state_slot_bytes,
)
from hybridserve.planner.split import (
    PoolPlan,
    format_max_concurrency,
    format_pool_log,
    max_concurrency,
    max_concurrency_reserved,
    size_pools,
)
from hybridserve.planner.units import GiB, KiB, MiB, format_bytes, format_mib, parse_size
from hybridserve.planner.weights import (
    ParamSplit,
    active_param_count,
    checkpoint_weight_bytes,
    param_breakdown,
    param_count,
    param_split,
    weight_bytes,
)

__all__ = [
    "KiB", "MiB", "GiB", "DEFAULT_BLOCK_SIZE", "MATRIX_STATE_DTYPE",
    "parse_size", "format_bytes", "format_mib",
    "kv_bytes_per_token", "block_bytes", "blocks_for_tokens", "matrix_state_bytes",
    "conv_state_bytes", "state_slot_bytes",
    "ParamSplit", "param_split", "param_breakdown", "param_count", "active_param_count",
    "checkpoint_weight_bytes", "weight_bytes",
    "DEVICE_MEMORY", "device_memory_bytes", "pool_from_device", "usable_after_weights",
    "DEFAULT_CONTEXT_LENS", "ArenaPlan", "SessionFit", "size_arena", "context_lens_for",
    "format_arena_log",
    "paged_sequence_bytes", "reserved_blocks_per_sequence", "reserved_sequence_bytes",
    "sessions_paged", "sessions_reserved_max",
    "SharingPlan", "sharing_plan", "ParallelSamplingPlan", "parallel_sampling_plan",
    "arena_sharing_plan", "arena_parallel_sampling_plan",
    "DevicePlan", "DeviceShare", "device_share", "devices_needed",
    "shard_config", "weight_bytes_per_device",
    "MAX_TENSOR_PARALLEL", "check_degree", "degree_error", "kv_head_replicas", "rank_config",
    "rank_mtp_param_count", "rank_param_count", "rank_param_split", "rank_weight_bytes", "valid_degrees",
    "PoolPlan", "size_pools", "max_concurrency", "max_concurrency_reserved",
    "format_pool_log", "format_max_concurrency",
    "CapacityReport", "capacity_report", "render_plan",
]
