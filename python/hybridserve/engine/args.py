"""Engine settings, with vLLM's names where vLLM has one, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridserve.errors import ConfigError

ADMISSION_POLICIES = ("paged", "reserve_max")
# The CPU arena's default share of the host memory available at start-up (after the
# weights): half, leaving the rest to the process's runtime and to the machine.
CPU_MEMORY_FRACTION = 0.5
# max_num_seqs derived from the memory plan is at most this (vLLM's default max_num_seqs).
MAX_NUM_SEQS_CAP = 256


@dataclass
class EngineArgs:
    """How to build an engine.

    Cache sizing: ONE arena of equal pages holds KV blocks, running sequences'
    DeltaNet state, state checkpoints and cached prefix blocks (one free count, see
    :mod:`hybridserve.memory.layout`); there is no split to choose. Its size (first
    that applies):

    * ``num_pages``: exactly that many pages for the scheduler (tests);
    * else a byte budget: ``kv_cache_memory_bytes`` if given, else on CUDA
      ``total memory x gpu_memory_utilization - weights - runtime_reserve_bytes``, else
      (CPU) ``cpu_pool_bytes`` if given, else ``cpu_memory_fraction`` of the host memory
      available once the weights are loaded (bounded by what ``MAX_NUM_SEQS_CAP``
      sequences of ``max_model_len`` tokens can use), cut into pages by
      :func:`hybridserve.planner.size_arena`.

    ``max_num_seqs`` None (the default): from the memory plan, the sequences of one KV
    block each that the arena holds at once, at most ``MAX_NUM_SEQS_CAP``.

    ``num_gpu_blocks`` + ``num_state_slots`` (the old split) are still read, as the
    same bytes in pages (``num_gpu_blocks + num_state_slots * state_pages``), with a
    warning to use ``num_pages``; ``expected_context_len`` is refused (it decided the
    split and decides nothing now).

    ``admission_policy="reserve_max"`` is the pre-paging baseline: each sequence
    reserves blocks for ``max_model_len`` tokens at admission (for side-by-side
    comparison with the default ``"paged"`` policy on the same pool).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    num_pages: int | None = None
    # Deprecated (the pre-arena split): both together are converted to num_pages.
    num_gpu_blocks: int | None = None
    num_state_slots: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    runtime_reserve_bytes: int = 2 << 30
    cpu_pool_bytes: int | None = None
    cpu_memory_fraction: float = CPU_MEMORY_FRACTION
    expected_context_len: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Extra DeltaNet state checkpoints every this many prompt tokens (a multiple of
    # block_size; 0 = off). Each kept one holds a state's pages (reclaimable).
    prefix_checkpoint_interval: int = 0
    long_prefill_token_threshold: int = 0
    # Priority preemption (see the scheduler's docs): a waiting request preempts
    # running ones of a priority worse by more than this many levels (after aging),
    # at most max_priority_preemptions_per_step per step (0 turns it off).
    priority_preemption_threshold: int = 1
    max_priority_preemptions_per_step: int = 4
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 1 << 24
    admission_policy: str = "paged"
    use_triton: bool | None = None  # None: Triton kernels on CUDA when importable
    # vLLM's name: True runs decode steps eagerly instead of from captured CUDA graphs
    # (graphs are only ever used on CUDA).
    enforce_eager: bool = False
    # Intra-op threads of torch (the CPU path's GEMMs and ops); None: the physical
    # cores this process may run on.
    cpu_threads: int | None = None
    # Ranks one model is split over (hybridserve.parallel): the engine starts N-1
    # workers on this host, or joins the ranks torchrun started (RANK/WORLD_SIZE...).
    tensor_parallel_size: int = 1
    # Failed steps in a row after which the engine gives up (fails every open request,
    # raises FatalEngineError; serve exits non-zero). 0: never for this reason.
    max_consecutive_step_failures: int = 3
    # vLLM's speculative_config: {"method": "mtp", "num_speculative_tokens": k} (a dict,
    # a JSON string or a SpeculativeConfig); None = no speculation (hybridserve.spec).
    speculative_config: Any = None

    def __post_init__(self) -> None:
        from hybridserve.spec.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for name in ("block_size", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        if (not isinstance(self.prefix_checkpoint_interval, int) or self.prefix_checkpoint_interval < 0
                or self.prefix_checkpoint_interval % self.block_size):
            raise ConfigError(
                f"prefix_checkpoint_interval must be 0 (off) or a multiple of block_size ({self.block_size}), "
                f"got {self.prefix_checkpoint_interval!r}"
            )
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission_policy must be one of {ADMISSION_POLICIES}, got {self.admission_policy!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("priority_preemption_threshold", "max_priority_preemptions_per_step",
                     "max_consecutive_step_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.expected_context_len is not None:
            raise ConfigError(
                "expected_context_len no longer exists: KV blocks and DeltaNet state share one "
                "arena whose pages follow the load, so there is no split to size from a context-length "
                "guess; drop it (cap concurrency with max_num_seqs if you want a cap)"
            )
        if (self.num_gpu_blocks is None) != (self.num_state_slots is None):
            given = "num_gpu_blocks" if self.num_gpu_blocks is not None else "num_state_slots"
            raise ConfigError(
                f"{given} alone no longer sizes anything: KV blocks and DeltaNet state share one arena; "
                "give num_pages (exact pages) or a byte budget (kv_cache_memory_bytes / "
                "gpu_memory_utilization) instead"
            )
        if self.num_pages is not None and self.num_gpu_blocks is not None:
            raise ConfigError("give num_pages or the deprecated num_gpu_blocks + num_state_slots, not both")
        if not 0.0 < self.cpu_memory_fraction <= 1.0:
            raise ConfigError(f"cpu_memory_fraction must be in (0, 1], got {self.cpu_memory_fraction}")
        for name in ("num_pages", "num_gpu_blocks", "num_state_slots", "max_model_len", "cpu_threads",
                     "max_num_seqs", "cpu_pool_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {unknown}; known options: {sorted(cls.field_names())}"
            )
        return cls(model=model, **kwargs)
