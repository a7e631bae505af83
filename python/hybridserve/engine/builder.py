"""Start-up, one chain: args -> config -> weights -> memory plan -> arena -> runner -> graphs.

Each step is a function that takes the previous step's result (a frozen record that
keeps the one before it) and returns its own; nothing reaches back into a step already
left. :func:`build_engine_parts` runs the chain and flattens the end into
:class:`EngineParts`, what :class:`~hybridserve.engine.llm_engine.LLMEngine` composes::

    resolve_config(args)    -> ResolvedConfig   device, ranks, dtype, lengths, threads
    load_weights(config)    -> LoadedWeights    the model, the tokenizer, EOS ids
    plan_memory(weights)    -> MemoryPlan       the arena's pages (measured after the weights)
    create_arena(plan)      -> Arena            the pages (HybridCache) and the Rust scheduler
    create_runner(arena)    -> RunnerReady      the model runner over the arena, the sampler
    capture_graphs(runner)  -> EngineParts      CUDA decode graphs when they are used

The memory plan comes after the weights because on CUDA it is measured (what the
weights left free); the runner after the scheduler because its block-table buffers are
the scheduler's width.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve import _core
from hybridserve import planner
from hybridserve.config import ModelConfig
from hybridserve.engine.args import MAX_NUM_SEQS_CAP, EngineArgs
from hybridserve.engine.device import (
    HOST_PARALLEL_MIN_ELEMENTS,
    _resolve_device,
    _resolve_model_dtype,
    set_cpu_threads,
)
from hybridserve.errors import ConfigError
from hybridserve.memory.layout import arena_layout
from hybridserve.model.cache import HybridCache, resolve_dtype
from hybridserve.model.loader import load_model
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.sampler import Sampler
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger("hybridserve.engine")

# The chain's steps, in order (EngineParts.build_log records the ones that ran).
BUILD_STEPS = ("config", "weights", "memory_plan", "arena", "runner", "graphs")


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings resolved from the arguments and the checkpoint's config.json."""

    args: EngineArgs
    device: torch.device
    # Tensor parallelism (hybridserve.parallel): this rank's part, None on one rank.
    parallel: Any
    dtype: torch.dtype
    max_model_len: int
    # The model's config with the serving dtype and length limit (the planner reads both).
    model_config: ModelConfig
    # The shape the arena's pages are laid out for: this rank's shard under tensor
    # parallelism, else model_config.
    layout_config: ModelConfig
    cpu_threads: int


@dataclass(frozen=True)
class LoadedWeights:
    config: ResolvedConfig
    model: Any
    tokenizer: Any
    eos_token_ids: list[int]


@dataclass(frozen=True)
class MemoryPlan:
    weights: LoadedWeights
    # The arguments with max_num_seqs resolved (derived from the plan when not given).
    args: EngineArgs
    arena_plan: planner.ArenaPlan
    kv_dtype: torch.dtype
    use_cuda_graphs: bool


@dataclass(frozen=True)
class Arena:
    plan: MemoryPlan
    cache: HybridCache
    scheduler: Any


@dataclass(frozen=True)
class RunnerReady:
    arena: Arena
    runner: Any
    sampler: Sampler


@dataclass
class EngineParts:
    """Everything an engine is made of, built once by :func:`build_engine_parts`."""

    args: EngineArgs
    device: torch.device
    parallel: Any
    dtype: torch.dtype
    max_model_len: int
    model_config: ModelConfig
    layout_config: ModelConfig
    cpu_threads: int
    model: Any
    tokenizer: Any
    eos_token_ids: list[int]
    arena_plan: planner.ArenaPlan
    use_cuda_graphs: bool
    cache: HybridCache
    scheduler: Any
    # The scheduler's block-table width (the runner's buffers are as wide).
    max_blocks_per_seq: int
    runner: Any
    sampler: Sampler
    # Whether the step's host work after the model call runs torch on one thread.
    host_one_thread: bool
    build_log: tuple[str, ...] = ()


# ---------------------------------------------------------------------- config
def resolve_config(args: EngineArgs) -> ResolvedConfig:
    """config.json and the settings resolved against it; under tensor parallelism the
    ranks start here (the workers load while the driver goes on)."""
    device = _resolve_device(args.device)
    if os.path.isfile(args.model) and not args.model.endswith(".gguf"):
        raise ConfigError(
            f"{args.model!r} is a file, not a directory: give the checkpoint directory that "
            "holds config.json, the *.safetensors files and the tokenizer"
        )
    config = ModelConfig.from_json(args.model)
    parallel, cpu_threads = None, args.cpu_threads
    if args.tensor_parallel_size > 1:
        from hybridserve.parallel.tensor_parallel import TensorParallel

        parallel = TensorParallel.start(args, config, device)
        device = parallel.device
        cpu_threads = parallel.cpu_threads(cpu_threads)
    try:
        return _resolve_settings(args, device, config, parallel, cpu_threads)
    except BaseException:
        _close_ranks(parallel)
        raise


def _resolve_settings(args: EngineArgs, device: torch.device, config: ModelConfig, parallel: Any,
                      cpu_threads: int | None) -> ResolvedConfig:
    dtype = _resolve_model_dtype(args.dtype, config, device)
    dtype_name = str(dtype).removeprefix("torch.")
    max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    # The planner reads the serving dtype and the serving length limit from here
    # (the reserve-max policy reserves max_model_len, as the scheduler does).
    model_config = dataclasses.replace(config, torch_dtype=dtype_name, max_position_embeddings=max_model_len)
    layout_config = (dataclasses.replace(parallel.local_config, torch_dtype=dtype_name,
                                         max_position_embeddings=max_model_len)
                     if parallel is not None else model_config)
    # torch's thread count is process-wide: set it only where it is the engine's
    # business (the CPU path, or asked for), not under a CUDA engine's host.
    if device.type == "cpu" or cpu_threads:
        threads = set_cpu_threads(cpu_threads)
        why = "--cpu-threads" if args.cpu_threads else (
            "physical cores shared by the ranks" if cpu_threads else "physical cores available")
    else:
        threads, why = torch.get_num_threads(), "left as found"
    from hybridserve.kernels import native

    logger.info("torch intra-op threads: %d (%s); native CPU kernels: %s", threads, why,
                f"{native.threads()} threads on the {native.pool()} pool" if native.available() else "off")
    return ResolvedConfig(args=args, device=device, parallel=parallel, dtype=dtype, max_model_len=max_model_len,
                          model_config=model_config, layout_config=layout_config, cpu_threads=threads)


def _close_ranks(parallel: Any) -> None:
    # A driver that fails between starting its workers and serving (a broken
    # tokenizer, an arena too small for the memory given, ...) stops them now:
    # they would otherwise sit in a start-up collective until its timeout.
    if parallel is not None and parallel.is_driver:
        parallel.close()


# --------------------------------------------------------------------- weights
def load_weights(config: ResolvedConfig) -> LoadedWeights:
    args = config.args
    torch.manual_seed(args.seed)
    spec = args.speculative_config
    # Speculation drafts with the checkpoint's MTP layer: loaded only then (a checkpoint
    # without one is refused here, naming what is missing). Under tensor parallelism
    # the layer is sharded like a decoder layer; rank 0 drafts and accepts.
    if config.parallel is not None:
        model = config.parallel.load_model(args.model, config.dtype, config.device, load_mtp=spec is not None)
    else:
        model, _ = load_model(args.model, dtype=config.dtype, device=config.device, load_mtp=spec is not None)
    model.eval()
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    eos_token_ids = list(config.model_config.eos_token_ids)
    if not eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_token_ids = [int(tokenizer.eos_token_id)]
    return LoadedWeights(config=config, model=model, tokenizer=tokenizer, eos_token_ids=eos_token_ids)


# ----------------------------------------------------------------- memory plan
def plan_memory(weights: LoadedWeights) -> MemoryPlan:
    config = weights.config
    args = config.args
    kv_dtype = config.dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype)
    # Decode steps replay CUDA graphs on CUDA unless enforce_eager; their padding
    # rows need one DeltaNet state that no sequence owns: the arena's scratch
    # pages, past the scheduler's page ids (counted in the budget).
    use_cuda_graphs = _use_cuda_graphs(config)
    arena_plan = _plan_arena(config, str(kv_dtype).removeprefix("torch."), use_cuda_graphs)
    if args.max_num_seqs is None:
        derived = _derive_max_num_seqs(arena_plan)
        args = dataclasses.replace(args, max_num_seqs=derived)
        arena_plan = dataclasses.replace(arena_plan, max_num_seqs=derived)
        logger.info("max_num_seqs: %d (from the memory plan: the sequences of one KV block the arena "
                    "holds, at most %d; set it with --max-num-seqs)", derived, MAX_NUM_SEQS_CAP)
    for line in planner.format_arena_log(arena_plan):
        logger.info(line)
    return MemoryPlan(weights=weights, args=args, arena_plan=arena_plan, kv_dtype=kv_dtype,
                      use_cuda_graphs=use_cuda_graphs)


def _use_cuda_graphs(config: ResolvedConfig) -> bool:
    """Whether steps replay captured graphs: on CUDA unless enforce_eager. (Tests
    turn it on for the CPU, where :func:`capture_graphs` then builds the graphs'
    eager stand-ins.)"""
    return config.device.type == "cuda" and not config.args.enforce_eager


def _plan_arena(config: ResolvedConfig, kv_dtype: str, use_cuda_graphs: bool) -> planner.ArenaPlan:
    """The one arena: exact pages (``num_pages``, or the deprecated block/slot pair
    converted to the same bytes), else pages cut from the one byte budget."""
    a = config.args
    # With speculation every KV page also holds the MTP layer's block (its own paged KV).
    common = dict(block_size=a.block_size, kv_dtype=kv_dtype, cuda_graphs=use_cuda_graphs,
                  max_num_seqs=a.max_num_seqs,
                  speculative_tokens=(a.speculative_config.num_speculative_tokens
                                      if a.speculative_config is not None else 0))
    num_pages = a.num_pages
    if a.num_gpu_blocks is not None:
        state_pages = arena_layout(config.layout_config, a.block_size, kv_dtype).state_pages
        num_pages = a.num_gpu_blocks + a.num_state_slots * state_pages
        logger.warning(
            "num_gpu_blocks=%d + num_state_slots=%d are deprecated (there is one arena now): "
            "sized as the same bytes, num_pages=%d (%d state pages per sequence); pass num_pages",
            a.num_gpu_blocks, a.num_state_slots, num_pages, state_pages,
        )
    if num_pages is not None:
        return planner.size_arena(config.layout_config, num_pages=num_pages, **common)
    plan = planner.size_arena(config.layout_config, budget_bytes=_pool_bytes(config, kv_dtype, use_cuda_graphs),
                              **common)
    if config.parallel is not None:
        # Each rank sized its own pool; the one scheduler's page ids must exist on all.
        agreed = config.parallel.agree_num_pages(plan.num_pages)
        if agreed != plan.num_pages:
            plan = planner.size_arena(config.layout_config, num_pages=agreed, **common)
    return plan


def _pool_bytes(config: ResolvedConfig, kv_dtype: str, use_cuda_graphs: bool) -> int:
    a = config.args
    if a.kv_cache_memory_bytes is not None:
        return a.kv_cache_memory_bytes
    if config.device.type == "cuda":
        # Measured, not computed: what is in use once the weights are loaded (weights,
        # CUDA context, other processes) comes off the top; `reserve` covers the
        # activations of a step and the decode graphs captured after the pools.
        torch.cuda.synchronize(config.device)
        free, total = torch.cuda.mem_get_info(config.device)
        in_use = total - free
        logger.info(
            "device memory after loading weights: %.1f MiB free of %.1f MiB (%.1f MiB in use)",
            free / 2**20, total / 2**20, in_use / 2**20,
        )
        return planner.pool_from_device(
            total, in_use, utilization=a.gpu_memory_utilization, reserve=a.runtime_reserve_bytes
        )
    if a.cpu_pool_bytes is not None:
        return a.cpu_pool_bytes
    return _cpu_pool_from_memory(config, kv_dtype, use_cuda_graphs)


def _cpu_pool_from_memory(config: ResolvedConfig, kv_dtype: str, use_cuda_graphs: bool) -> int:
    """The CPU arena's default budget: a fraction of the host memory available now
    (the weights are loaded), at most what MAX_NUM_SEQS_CAP sequences of
    max_model_len tokens can use (more pages would never be written)."""
    from hybridserve.engine.device import available_memory_bytes

    a = config.args
    avail, source = available_memory_bytes()
    share = int(avail * a.cpu_memory_fraction)
    layout = arena_layout(config.layout_config, a.block_size, kv_dtype,
                          extra_attention_layers=1 if a.speculative_config is not None else 0)
    useful = (MAX_NUM_SEQS_CAP * layout.pages_for_sequence(config.max_model_len)
              + (layout.state_pages if use_cuda_graphs else 0)) * layout.page_bytes
    budget = min(share, useful)
    logger.info(
        "CPU arena budget: %s = %s of the %s available (%s)%s; set it with kv_cache_memory_bytes "
        "(--kv-cache-memory-bytes) or cpu_memory_fraction",
        planner.format_mib(budget), a.cpu_memory_fraction, planner.format_mib(avail), source,
        f", capped at what {MAX_NUM_SEQS_CAP} sequences of {config.max_model_len} tokens use"
        if useful < share else "",
    )
    return budget


def _derive_max_num_seqs(plan: planner.ArenaPlan) -> int:
    """max_num_seqs from the memory plan: the sequences (each its state and one KV
    block) the arena holds at once, at most MAX_NUM_SEQS_CAP; a fixed number would
    either leave a large arena idle or promise a small one more than it holds."""
    fit = plan.num_pages // plan.layout.pages_for_sequence(1)
    return max(1, min(MAX_NUM_SEQS_CAP, fit))


# ----------------------------------------------------------------------- arena
def create_arena(plan: MemoryPlan) -> Arena:
    """The arena's pages and the Rust scheduler that owns their ids."""
    config = plan.weights.config
    args, arena_plan = plan.args, plan.arena_plan
    cache = HybridCache(config.layout_config, arena_plan.layout, arena_plan.total_pages,
                        dtype=plan.kv_dtype, device=config.device)
    scheduler = _core.Scheduler(
        num_pages=arena_plan.num_pages,
        block_size=args.block_size,
        state_pages=arena_plan.state_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        priority_preemption_threshold=args.priority_preemption_threshold,
        max_priority_preemptions_per_step=args.max_priority_preemptions_per_step,
        # The cap counts requests that wait for want of room, not those the next step
        # admits into free run slots: the core's is looser, the engine's check exact.
        max_waiting_requests=args.max_waiting_requests + args.max_num_seqs,
        max_waiting_tokens=args.max_waiting_tokens,
        reserve_max_context=args.admission_policy == "reserve_max",
        num_speculative_tokens=(args.speculative_config.num_speculative_tokens
                                if args.speculative_config is not None else 0),
    )
    return Arena(plan=plan, cache=cache, scheduler=scheduler)


# ---------------------------------------------------------------------- runner
def create_runner(arena: Arena) -> RunnerReady:
    plan = arena.plan
    weights = plan.weights
    config = weights.config
    # The scheduler's block-table rows are the runner's buffer width.
    make_runner = config.parallel.make_runner if config.parallel is not None else ModelRunner
    runner = make_runner(weights.model, arena.cache, max_num_seqs=plan.args.max_num_seqs,
                         max_blocks_per_seq=arena.scheduler.max_blocks_per_seq, device=config.device)
    # On the CPU the sampler draws with its native kernel, and a steady batch (the
    # same rows list again) reuses its plan with no per-row work.
    sampler = Sampler(native=config.device.type == "cpu", steady_rows=True)
    return RunnerReady(arena=arena, runner=runner, sampler=sampler)


# ---------------------------------------------------------------------- graphs
def capture_graphs(ready: RunnerReady) -> EngineParts:
    """Captures the CUDA decode graphs (when used) on the runner; the parts, complete."""
    arena = ready.arena
    plan = arena.plan
    weights = plan.weights
    config = weights.config
    args = plan.args
    if plan.use_cuda_graphs:
        _capture(ready.runner, weights.model, arena, plan)
    if config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        logger.info(
            "device memory after pools%s: %.1f MiB free of %.1f MiB",
            " and graph capture" if plan.use_cuda_graphs else "", free / 2**20, total / 2**20,
        )
    # The step's host work after the model call runs torch on one thread (see
    # HOST_PARALLEL_MIN_ELEMENTS); the thread count is given back after it.
    host_one_thread = (config.device.type == "cpu" and config.cpu_threads > 1
                       and args.max_num_seqs * config.model_config.vocab_size < HOST_PARALLEL_MIN_ELEMENTS)
    return EngineParts(
        args=args, device=config.device, parallel=config.parallel, dtype=config.dtype,
        max_model_len=config.max_model_len, model_config=config.model_config,
        layout_config=config.layout_config, cpu_threads=config.cpu_threads, model=weights.model,
        tokenizer=weights.tokenizer, eos_token_ids=weights.eos_token_ids, arena_plan=plan.arena_plan,
        use_cuda_graphs=plan.use_cuda_graphs, cache=arena.cache, scheduler=arena.scheduler,
        max_blocks_per_seq=arena.scheduler.max_blocks_per_seq,
        runner=ready.runner, sampler=ready.sampler, host_one_thread=host_one_thread,
    )


def _capture(runner: Any, model: Any, arena: Arena, plan: MemoryPlan) -> None:
    """The decode graphs and, with speculative decoding, the verify graphs (k + 1 rows
    per sequence, for the batch sizes that draft), sharing one memory pool. A
    speculating engine's decode graphs also return the hidden states (the drafter's
    input), at no extra cost: every row of a decode step is sampled anyway."""
    from hybridserve.runner.cuda_graphs import DecodeGraphs
    from hybridserve.runner.verify_graphs import VerifyGraphs

    args = plan.args
    spec = args.speculative_config
    common = dict(max_blocks_per_seq=arena.scheduler.max_blocks_per_seq,
                  scratch_pages=list(plan.arena_plan.scratch_page_ids),
                  replay_eagerly=arena.cache.device.type != "cuda")
    runner.graphs = DecodeGraphs(model, arena.cache, max_num_seqs=args.max_num_seqs,
                                 return_hidden=spec is not None, **common)
    runner.graphs.capture()
    if spec is None:
        return
    # Steps with disable_by_batch_size decoding sequences or more do not draft.
    limit = spec.disable_by_batch_size
    most = args.max_num_seqs if limit == 0 else min(args.max_num_seqs, limit - 1)
    if most >= 1:
        runner.verify_graphs = VerifyGraphs(model, arena.cache, num_speculative_tokens=spec.num_speculative_tokens,
                                            max_num_seqs=most, pool=runner.graphs.pool, **common)
        runner.verify_graphs.capture()


def build_engine_parts(args: EngineArgs) -> EngineParts:
    """Runs the start-up chain (see the module docs), each step on the last one's
    result; ``build_log`` names the steps in the order they ran."""
    config = resolve_config(args)
    result: Any = config
    log = ["config"]
    try:
        # Looked up at each call (tests and tools wrap single steps).
        for name, step in (("weights", load_weights), ("memory_plan", plan_memory), ("arena", create_arena),
                           ("runner", create_runner), ("graphs", capture_graphs)):
            result = step(result)
            log.append(name)
    except BaseException:
        _close_ranks(config.parallel)
        raise
    result.build_log = tuple(log)
    return result
