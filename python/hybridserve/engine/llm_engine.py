"""The synchronous engine: one ``step()`` = schedule, copy, run, sample, update.

::

    plan   = scheduler.schedule()             Rust, GIL released
    logits = runner.execute(plan)             block-table updates, CoW/fork copies, model
    tokens = sampler(logits, rows)            per-sequence RNGs, penalties, logprobs
    events = scheduler.update(tokens)         Rust: append, fork n>1, stop, free
    -> detokenize, stop strings (which finish sequences in the scheduler), outputs

The engine never edits block tables or slots: the Rust scheduler owns them. It is
single-threaded; :class:`hybridserve.engine.async_engine.AsyncEngine` runs it on a
thread for the server.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hybridserve import _core
from hybridserve import planner
from hybridserve.beam_search import BeamSearch, BeamSearchParams, candidates_to_host
from hybridserve.config import ModelConfig
from hybridserve.engine import logprobs
from hybridserve.engine.args import MAX_NUM_SEQS_CAP, EngineArgs
from hybridserve.engine.common_rows import common_row_output, steady_row_outputs
from hybridserve.engine.faults import FaultInjector, recover_step
from hybridserve.engine.device import (
    HOST_PARALLEL_MIN_ELEMENTS,
    _resolve_device,
    _resolve_model_dtype,
    set_cpu_threads,
)
from hybridserve.engine.request_state import RequestState
from hybridserve.memory.layout import arena_layout
from hybridserve.errors import ConfigError, InvalidRequest, QueueFull, UnknownRequest
from hybridserve.model.cache import HybridCache, resolve_dtype
from hybridserve.model.loader import load_model
from hybridserve.outputs import CompletionOutput, PromptLogprobList, RequestOutput
from hybridserve.runner.model_runner import ModelRunner
from hybridserve.sampler import Sampler, SamplingRow
from hybridserve.sampling import MAX_LOGPROBS, SamplingParams
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger("hybridserve.engine")


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``: a view when the rows are consecutive (no index tensor to copy to
    the device), else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)]
    return t.index_select(0, torch.tensor(rows, device=t.device))


# The phases of one step, in order: the scheduler's plan; the runner's staging copy,
# table updates and batch; the model; sampling (rows, sampler, beams, logprobs); and
# the scheduler's update, detokenization, stop strings and the outputs handed back.
STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "process_outputs")



class LLMEngine:
    """Continuous-batching engine over the Rust scheduler and the PyTorch runner."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = _resolve_device(args.device)
        if os.path.isfile(args.model):
            raise ConfigError(
                f"{args.model!r} is a file, not a directory: give the checkpoint directory that "
                "holds config.json, the *.safetensors files and the tokenizer"
            )
        config = ModelConfig.from_json(args.model)
        # Tensor parallelism (hybridserve.parallel): this rank's shard of the model; the
        # arena's pages are laid out for the shard's shape (layout_config).
        self.parallel = None
        self.layout_config = None
        cpu_threads = args.cpu_threads
        if args.tensor_parallel_size > 1:
            from hybridserve.parallel.tensor_parallel import TensorParallel

            self.parallel = TensorParallel.start(args, config, self.device)
            self.device = self.parallel.device
            cpu_threads = self.parallel.cpu_threads(cpu_threads)
        try:
            self._build(args, config, cpu_threads)
        except BaseException:
            # A driver that fails between starting its workers and serving (a broken
            # tokenizer, an arena too small for the memory given, ...) stops them now:
            # they would otherwise sit in a start-up collective until its timeout.
            if self.parallel is not None and self.parallel.is_driver:
                self.parallel.close()
            raise

    def _build(self, args: EngineArgs, config: ModelConfig, cpu_threads: int | None) -> None:
        """Everything after the ranks are up: model, tokenizer, arena, scheduler, runner."""
        self.dtype = _resolve_model_dtype(args.dtype, config, self.device)
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.max_model_len = min(
            args.max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        # The planner reads the serving dtype and the serving length limit from here
        # (the reserve-max policy reserves max_model_len, as the scheduler does).
        self.model_config = dataclasses.replace(
            config, torch_dtype=dtype_name, max_position_embeddings=self.max_model_len
        )
        self.layout_config = (dataclasses.replace(self.parallel.local_config, torch_dtype=dtype_name,
                                                  max_position_embeddings=self.max_model_len)
                              if self.parallel is not None else self.model_config)

        # torch's thread count is process-wide: set it only where it is the engine's
        # business (the CPU path, or asked for), not under a CUDA engine's host.
        if self.device.type == "cpu" or cpu_threads:
            self.cpu_threads = set_cpu_threads(cpu_threads)
            why = "--cpu-threads" if args.cpu_threads else (
                "physical cores shared by the ranks" if cpu_threads else "physical cores available")
        else:
            self.cpu_threads, why = torch.get_num_threads(), "left as found"
        from hybridserve.kernels import native

        logger.info("torch intra-op threads: %d (%s); native CPU kernels: %s", self.cpu_threads, why,
                    f"{native.threads()} threads on the {native.pool()} pool" if native.available() else "off")
        torch.manual_seed(args.seed)
        if self.parallel is not None:
            self.model = self.parallel.load_model(args.model, self.dtype, self.device)
        else:
            self.model, _ = load_model(args.model, dtype=self.dtype, device=self.device)
        self.model.eval()
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.eos_token_ids = list(config.eos_token_ids)
        if not self.eos_token_ids and getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids = [int(self.tokenizer.eos_token_id)]

        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype)
        # Decode steps replay CUDA graphs on CUDA unless enforce_eager; their padding
        # rows need one DeltaNet state that no sequence owns: the arena's scratch
        # pages, past the scheduler's page ids (counted in the budget).
        self.use_cuda_graphs = self.device.type == "cuda" and not args.enforce_eager
        self.arena_plan = self._plan_arena(str(kv_dtype).removeprefix("torch."))
        if args.max_num_seqs is None:
            derived = self._derive_max_num_seqs()
            args = self.args = dataclasses.replace(args, max_num_seqs=derived)
            self.arena_plan = dataclasses.replace(self.arena_plan, max_num_seqs=derived)
            logger.info("max_num_seqs: %d (from the memory plan: the sequences of one KV block the arena "
                        "holds, at most %d; set it with --max-num-seqs)", derived, MAX_NUM_SEQS_CAP)
        self.block_size = args.block_size
        self.num_pages = self.arena_plan.num_pages
        self.state_pages = self.arena_plan.state_pages
        # The KV view of the same pages (every page can be a KV block).
        self.num_blocks = self.num_pages
        for line in planner.format_arena_log(self.arena_plan):
            logger.info(line)
        # Sequences of max_model_len tokens that fit at once (shorter ones: more).
        self.max_concurrency = self.arena_plan.sessions(self.max_model_len).sessions

        self.cache = HybridCache(
            self.layout_config, self.arena_plan.layout, self.arena_plan.total_pages,
            dtype=kv_dtype, device=self.device,
        )
        self.scheduler = _core.Scheduler(
            num_pages=self.num_pages,
            block_size=self.block_size,
            state_pages=self.state_pages,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_checkpoint_interval=args.prefix_checkpoint_interval,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            priority_preemption_threshold=args.priority_preemption_threshold,
            max_priority_preemptions_per_step=args.max_priority_preemptions_per_step,
            # The cap counts requests that wait for want of room, not those the next step
            # admits into free run slots: the core's is looser, _check_waiting_room exact.
            max_waiting_requests=args.max_waiting_requests + args.max_num_seqs,
            max_waiting_tokens=args.max_waiting_tokens,
            reserve_max_context=args.admission_policy == "reserve_max",
        )
        # The scheduler's block-table rows are the runner's buffer width.
        self.max_blocks_per_seq = self.scheduler.max_blocks_per_seq
        make_runner = self.parallel.make_runner if self.parallel is not None else ModelRunner
        self.runner = make_runner(
            self.model, self.cache,
            max_num_seqs=args.max_num_seqs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            device=self.device,
        )
        if self.use_cuda_graphs:
            from hybridserve.runner.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(
                self.model, self.cache, max_num_seqs=args.max_num_seqs,
                max_blocks_per_seq=self.max_blocks_per_seq,
                scratch_pages=list(self.arena_plan.scratch_page_ids),
            )
            self.runner.graphs.capture()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            logger.info(
                "device memory after pools%s: %.1f MiB free of %.1f MiB",
                " and graph capture" if self.use_cuda_graphs else "", free / 2**20, total / 2**20,
            )
        # On the CPU the sampler draws with its native kernel, and a steady batch (the
        # same rows list again: see _sampling_rows) reuses its plan with no per-row work.
        self.sampler = Sampler(native=self.device.type == "cpu", steady_rows=True)
        # The step's host work after the model call runs torch on one thread (see
        # HOST_PARALLEL_MIN_ELEMENTS); the thread count is given back after it.
        self._host_one_thread = (self.device.type == "cpu" and self.cpu_threads > 1
                                 and args.max_num_seqs * config.vocab_size < HOST_PARALLEL_MIN_ELEMENTS)
        self.requests: dict[str, RequestState] = {}
        # Constrained decoding (hybridserve.structured), built with the first constrained
        # request; the step's mask job runs while its forward does.
        self.structured: Any = None
        self._structured_job: Any = None
        # Counts every change to `requests` (add, abort, finish): the last step's
        # sampler rows are reused while it and the batch stay the same.
        self._requests_epoch = 0
        self._rows_cache: tuple | None = None
        # The last step's common output rows (see _after_forward): (epoch, the update's
        # request ids, per row its request's objects), reused while the batch stays.
        self._steady_rows: tuple | None = None
        # request id -> (k, per-prompt-token logprobs) for requests that asked for
        # prompt logprobs; empty in the common case, so steps pay nothing for it.
        self._prompt_logprobs: dict[str, logprobs.PromptLogprobs] = {}
        # Beam requests: id -> their selection state (see hybridserve.beam_search).
        self._beams: dict[str, BeamSearch] = {}
        # Preemptions by (cause, victim's request_class), for the metrics.
        self.preemptions_by: dict[tuple[str, str], int] = {}
        self._counter = 0
        # Faults stay local (hybridserve.engine.faults): failed steps rolled back, their
        # requests retried once (request id -> the state retried), the engine's end when
        # faults repeat or are fatal. The injector is None unless asked for.
        self.fault_injector = FaultInjector.from_env()
        self.max_consecutive_step_failures = args.max_consecutive_step_failures
        self.failed_steps = self.retried_requests = self.errored_requests = 0
        self._consecutive_failures = 0
        self._fault_retried: dict[str, RequestState] = {}
        self._fatal: BaseException | None = None
        self.step_count = 0
        self.last_step_stats: dict[str, Any] = {}
        # Cumulative wall seconds of each phase of step() (see STEP_PHASES).
        self._phase_seconds: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        # Streaming consumers want every changed request each step; an offline loop
        # only wants finished ones, and skipping the rest keeps a step from copying
        # every running request's tokens (O(generated) per request per step).
        self.emit_unfinished = True
        # Work for the previous step's outputs that the caller wants done between this
        # step's input preparation and its model call (the async engine hands them to
        # its event loop there, so the loop's work overlaps the forward, which on a GPU
        # waits without the GIL). Its time counts in this step's process_outputs.
        self.before_forward: Callable[[], None] | None = None
        self._before_forward_seconds = 0.0
        if self.parallel is not None:
            # A worker rank serves the driver's steps here and never returns.
            self.parallel.attach(self)

    # ------------------------------------------------------------------ sizing
    def _pool_bytes(self, kv_dtype: str) -> int:
        a = self.args
        if a.kv_cache_memory_bytes is not None:
            return a.kv_cache_memory_bytes
        if self.device.type == "cuda":
            # Measured, not computed: what is in use once the weights are loaded (weights,
            # CUDA context, other processes) comes off the top; `reserve` covers the
            # activations of a step and the decode graphs captured after the pools.
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
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
        return self._cpu_pool_from_memory(kv_dtype)

    def _cpu_pool_from_memory(self, kv_dtype: str) -> int:
        """The CPU arena's default budget: a fraction of the host memory available now
        (the weights are loaded), at most what MAX_NUM_SEQS_CAP sequences of
        max_model_len tokens can use (more pages would never be written)."""
        from hybridserve.engine.device import available_memory_bytes

        a = self.args
        avail, source = available_memory_bytes()
        share = int(avail * a.cpu_memory_fraction)
        layout = arena_layout(self.layout_config, a.block_size, kv_dtype)
        useful = (MAX_NUM_SEQS_CAP * layout.pages_for_sequence(self.max_model_len)
                  + (layout.state_pages if self.use_cuda_graphs else 0)) * layout.page_bytes
        budget = min(share, useful)
        logger.info(
            "CPU arena budget: %s = %s of the %s available (%s)%s; set it with kv_cache_memory_bytes "
            "(--kv-cache-memory-bytes) or cpu_memory_fraction",
            planner.format_mib(budget), a.cpu_memory_fraction, planner.format_mib(avail), source,
            f", capped at what {MAX_NUM_SEQS_CAP} sequences of {self.max_model_len} tokens use"
            if useful < share else "",
        )
        return budget

    def _derive_max_num_seqs(self) -> int:
        """max_num_seqs from the memory plan: the sequences (each its state and one KV
        block) the arena holds at once, at most MAX_NUM_SEQS_CAP; a fixed number would
        either leave a large arena idle or promise a small one more than it holds."""
        plan = self.arena_plan
        fit = plan.num_pages // plan.layout.pages_for_sequence(1)
        return max(1, min(MAX_NUM_SEQS_CAP, fit))

    def _plan_arena(self, kv_dtype: str) -> planner.ArenaPlan:
        """The one arena: exact pages (``num_pages``, or the deprecated block/slot pair
        converted to the same bytes), else pages cut from the one byte budget."""
        a = self.args
        common = dict(block_size=a.block_size, kv_dtype=kv_dtype, cuda_graphs=self.use_cuda_graphs,
                      max_num_seqs=a.max_num_seqs)
        num_pages = a.num_pages
        if a.num_gpu_blocks is not None:
            state_pages = arena_layout(self.layout_config, a.block_size, kv_dtype).state_pages
            num_pages = a.num_gpu_blocks + a.num_state_slots * state_pages
            logger.warning(
                "num_gpu_blocks=%d + num_state_slots=%d are deprecated (there is one arena now): "
                "sized as the same bytes, num_pages=%d (%d state pages per sequence); pass num_pages",
                a.num_gpu_blocks, a.num_state_slots, num_pages, state_pages,
            )
        if num_pages is not None:
            return planner.size_arena(self.layout_config, num_pages=num_pages, **common)
        plan = planner.size_arena(self.layout_config, budget_bytes=self._pool_bytes(kv_dtype), **common)
        if self.parallel is not None:
            # Each rank sized its own pool; the one scheduler's page ids must exist on all.
            agreed = self.parallel.agree_num_pages(plan.num_pages)
            if agreed != plan.num_pages:
                plan = planner.size_arena(self.layout_config, num_pages=agreed, **common)
        return plan

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            # As vLLM and the tokenizer's default: the special tokens its post-processor
            # adds (a BOS) are part of a text prompt (Qwen's tokenizers add none).
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {vocab}); got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        return None, ids

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        request_class: str = "default",
        arrival_time: float | None = None,
        prompt_logprobs: int | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequest / QueueFull at once if it cannot be admitted.

        ``prompt_logprobs=k`` also reports each prompt token's logprob and the k most
        likely alternatives (``RequestOutput.prompt_logprobs``; the first token's is None).
        ``BeamSearchParams`` make it a beam request (:meth:`add_beam_request`)."""
        if isinstance(params, BeamSearchParams):
            if prompt_logprobs is not None:
                raise InvalidRequest("prompt_logprobs is not supported with beam search")
            return self.add_beam_request(request_id, prompt, params, priority=priority, request_class=request_class)
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use; pick a unique id")
        params.check_vocab(self.model_config.vocab_size)
        self._check_waiting_room()
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty; send at least one token")
        if params.max_tokens is None:  # vLLM's meaning: the rest of the context
            rest = self.max_model_len - len(ids)
            if rest < 1:
                raise InvalidRequest(
                    f"the prompt has {len(ids)} tokens, which leaves no room for output within "
                    f"max_model_len ({self.max_model_len}); shorten the prompt")
            # A copy (one SamplingParams may serve many prompts) that keeps what was
            # built on it already (the stop-string automaton).
            params = copy.copy(params)
            params.max_tokens = rest
        if params.structured_outputs is not None:
            self._add_structured(request_id, params)
        state = RequestState.create(
            request_id, text, ids, params, self.tokenizer, self.device,
            priority=priority, request_class=request_class, arrival_time=arrival_time,
        )
        stop_ids = list(params.stop_token_ids or [])
        extra = {}
        if prompt_logprobs is not None:
            if not isinstance(prompt_logprobs, int) or not 0 <= prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequest(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}]")
            # Every prompt position must run through the model: a private prefix-cache
            # key keeps a cached prefix from skipping positions whose logits we need.
            extra["extra_key"] = int.from_bytes(os.urandom(8), "little")
        try:
            self.scheduler.add_request(
                request_id,
                np.asarray(ids, dtype=np.uint32),
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,
                stop_token_ids=stop_ids,
                ignore_eos=params.ignore_eos,
                eos_token_ids=self.eos_token_ids,
                n=params.n,
                priority=priority,
                request_class=request_class,
                **extra,
            )
        except BaseException:
            if params.structured_outputs is not None:  # compiled above: a refusal gives it back
                self.structured.release(request_id)
            raise
        self.requests[request_id] = state
        self._requests_epoch += 1
        if prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = (prompt_logprobs, [None] * len(ids))
        return request_id

    def _check_waiting_room(self) -> None:
        """QueueFull when max_waiting_requests requests already wait beyond what the free
        run slots will admit at the next step (requests added between two steps all
        wait until it, though the free slots will take them)."""
        cap = self.args.max_waiting_requests
        waiting = self.scheduler.num_waiting()
        if waiting >= cap:
            free = max(self.args.max_num_seqs - self.scheduler.num_running(), 0)
            if waiting - free >= cap:
                raise QueueFull(f"the waiting queue holds {waiting - free} requests beyond the {free} free run "
                                f"slot(s) (max_waiting_requests = {cap}); retry later")

    def add_beam_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: BeamSearchParams,
        *,
        priority: int = 0,
        request_class: str = "default",
    ) -> str:
        """Queue one beam-search request: W beams held by one scheduler request
        (admission reserves W states and the blocks W beams can need)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequest("add_beam_request takes BeamSearchParams")
        width = params.beam_width
        cap = self.args.max_num_seqs
        if width > cap:
            raise InvalidRequest(
                f"beam_width = {width} exceeds what the engine can run at once (max_num_seqs = {cap}); "
                "lower beam_width"
            )
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use; pick a unique id")
        self._check_waiting_room()
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty; send at least one token")
        sp = SamplingParams(n=width, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        state = RequestState.create(
            request_id, text, ids, sp, None, self.device, priority=priority, request_class=request_class,
        )
        # EOS is the search's business (finished list); the scheduler stops beams only at max_tokens.
        self.scheduler.add_request(
            request_id, np.asarray(ids, dtype=np.uint32), max_tokens=params.max_tokens,
            ignore_eos=True, eos_token_ids=self.eos_token_ids, n=width, priority=priority,
            request_class=request_class, beam_search=True,
        )
        self.requests[request_id] = state
        self._requests_epoch += 1
        self._beams[request_id] = BeamSearch(
            width, params.max_tokens, list(self.eos_token_ids), params.length_penalty, params.ignore_eos
        )
        return request_id

    def _beam_select(self, plan: Any, step: Any, sampled: np.ndarray) -> list[str]:
        """Replaces the sampled tokens of beam requests by the search's choice and
        re-parents their beams in the scheduler; returns the requests whose search ended.

        Every beam request's candidates come to the host in one transfer; the engine
        keeps no per-beam token lists (the search holds the beams), so a step moves
        only what changed."""
        req_ids = plan.request_ids
        rows: dict[str, dict[int, tuple[int, int]]] = {}
        off = 0
        for row, (b, k) in enumerate(zip(step.batch_index.tolist(), step.num_samples.tolist())):
            rid = req_ids[b]
            if rid in self._beams:
                rows.setdefault(rid, {})[int(plan.sample_indices[b]) if k == 1 else -1] = (row, off)
            off += k
        work, parts = [], []
        for rid, got in rows.items():
            bs = self._beams[rid]
            # The prompt's last row (the fork), or the W beams' rows in sample order.
            fork = -1 in got
            order = [got[-1]] if fork else [got[i] for i in range(bs.width)]
            lps = torch.log_softmax(_rows(step.logits, [r for r, _ in order]).float(), dim=-1)
            parts.append(bs.candidates(lps))
            work.append((rid, bs, order, fork))
        ended = []
        for (rid, bs, order, fork), (vals, idx) in zip(work, candidates_to_host(parts)):
            parents, toks = bs.advance(vals, idx)
            if fork:
                o = order[0][1]
                sampled[o:o + bs.width] = toks
            else:
                if parents != list(range(bs.width)):
                    self.scheduler.reorder_beams(rid, parents)
                for i, (_, o) in enumerate(order):
                    sampled[o] = toks[i]
            if bs.done:
                ended.append(rid)
        return ended

    def _beam_output(self, rid: str, state: RequestState) -> RequestOutput:
        bs = self._beams[rid]
        outs = []
        for i, (score, cum, toks, reason) in enumerate(bs.results()):
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else ""
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(toks), cumulative_logprob=cum,
                                         logprobs=None, finish_reason=reason))
        return RequestOutput(request_id=rid, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
                             outputs=outs, finished=True, metrics=state.metrics)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks and slot return to the pools."""
        state = self.requests.pop(request_id, None)
        if state is None:
            raise UnknownRequest(f"no request with id {request_id!r}")
        self._end_request(request_id, state, "abort")

    def _end_request(self, request_id: str, state: RequestState, reason: str) -> None:
        """The request (already out of ``self.requests``) leaves the scheduler, every page
        back, and the engine's per-request tables; unfinished samples end with ``reason``.
        One path for aborts and for requests a fault ends (engine.faults)."""
        self._requests_epoch += 1
        self._beams.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._fault_retried.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._release_sampler_rows(request_id, state)
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = reason

    def _release_sampler_rows(self, request_id: str, state: RequestState) -> None:
        # The sampler keeps device state per (request, sample) across steps.
        if self.structured is not None:
            self.structured.release(request_id)
        for i in range(len(state.samples)):
            self.sampler.release((request_id, i))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -------------------------------------------------------------------- step
    def _sampling_rows(self, plan: Any, batch_index: np.ndarray, num_samples: np.ndarray) -> list[SamplingRow]:
        """The sampler's rows of a step. A sample's row is made once and kept on its
        SampleState (its fields are the same objects every step: the params, the
        growing token list, the stream), so a decode step costs a lookup per row."""
        req_ids = plan.request_ids
        # A steady decode batch: the same requests (none added, aborted or finished
        # since), the same samples, one row each, in the same order: the same rows.
        steady = len(batch_index) == len(req_ids) and not self._beams and bool((num_samples == 1).all())
        if steady:
            cache = self._rows_cache
            if (cache is not None and cache[0] == self._requests_epoch and cache[1] == req_ids
                    and np.array_equal(cache[2], plan.sample_indices)):
                return cache[3]
        self._rows_cache = None
        rows = []
        sample_indices = np.asarray(plan.sample_indices).tolist()  # a list: numpy item reads are slow
        requests = self.requests
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        for b, k in zip(batch_index.tolist(), num_samples.tolist()):
            rid = req_ids[b]
            state = requests[rid]
            if k > 1:
                rows.append(SamplingRow(
                    params=state.params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.samples[0].token_ids,
                    num_samples=k,
                    generators=[state.samples[i].generator for i in range(k)],
                    keys=[(rid, i) for i in range(k)],
                    eos_token_id=eos,
                ))
                continue
            sample = state.samples[sample_indices[b]]
            row = sample.sampling_row
            if row is None:
                row = sample.sampling_row = SamplingRow(
                    params=state.params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=sample.token_ids,
                    generator=sample.generator,
                    key=(rid, sample.index),
                    eos_token_id=eos,
                )
            rows.append(row)
        if steady:
            self._rows_cache = (self._requests_epoch, list(req_ids), np.array(plan.sample_indices), rows)
        return rows

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step; return the outputs that changed
        (only the finished ones when ``emit_unfinished`` is False).

        A step that raises is rolled back and its requests retried once or ended with
        ``finish_reason == "error"`` (hybridserve.engine.faults); a fatal or repeating
        fault fails every open request and raises FatalEngineError, then and after."""
        if self._fatal is not None:
            raise self._fatal  # the engine stays stopped: the same error at once
        self._fault_plan = self._fault_update = None
        self._fault_phase = "schedule"
        try:
            outputs = self._step()
        except BaseException as e:  # noqa: BLE001 - rolled back, or re-raised as fatal
            return recover_step(self, self._fault_plan, e, self._fault_phase, self._fault_update)
        self._consecutive_failures = 0
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step (see :meth:`step`).

        Each phase's wall time is added to ``stats()["step_phase_seconds"]`` and given
        for this step in ``last_step_stats["phase_seconds"]``: consecutive clock reads,
        so the five add up to the step's time."""
        t0 = time.perf_counter()
        self._before_forward_seconds = 0.0
        if self.parallel is not None:
            # A failed rank fails every step at once, before anything is scheduled.
            self.parallel.check_healthy()
        plan = self.scheduler.schedule()
        self._fault_plan, self._fault_phase = plan, "forward"
        if self.fault_injector is not None:
            self.fault_injector.begin_step()
        now = time.monotonic()
        # Requests that changed this step -> the indices of their samples that did.
        changed: dict[str, set[int]] = {}
        for rid, cause in zip(plan.preempted, plan.preempted_causes):
            st = self.requests.get(rid)
            if st is not None:
                st.metrics.num_preemptions += 1
                key = (cause, st.metrics.request_class)
                self.preemptions_by[key] = self.preemptions_by.get(key, 0) + 1
        # The core records each request's first schedule (its queue delay on the
        # core's clock); draining the events every step keeps that list short.
        for rid, _klass, _t, queue_delay in self.scheduler.take_events():
            st = self.requests.get(rid)
            if st is not None and st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now
                st.metrics.queue_delay = queue_delay

        want = logprobs.prompt_logprob_rows(self._prompt_logprobs, plan) if self._prompt_logprobs else ()
        t_sched = time.perf_counter()
        runner = self.runner
        runner.inputs_ready_at = None
        runner.before_forward = self._run_before_forward if self.before_forward is not None else None
        # The sampler's rows are known from the plan: its index lists travel in the
        # runner's staging copy (one host->device copy per step). A sampler that is
        # not ours (a test's, a bench's wrapper) is simply called with the logits.
        prep = None
        if isinstance(self.sampler, Sampler):
            num_samples = np.asarray(plan.num_samples)
            batch_index = np.nonzero(num_samples > 0)[0]
            if len(batch_index):
                prep = self.sampler.plan(self._sampling_rows(plan, batch_index, num_samples[batch_index]),
                                         self.model_config.vocab_size, self.device)
                runner.extra_segments = prep.segments
        runner.extra_views = None
        if self.structured is not None and self.structured.active:
            self._structured_job = self.structured.begin_step(plan, self.requests)
        try:
            # The one-argument call in the common case keeps runner wrappers (tests,
            # benches) that take only the plan working.
            step = runner.execute(plan, want) if want else runner.execute(plan)
        except BaseException:
            self._structured_job = None  # the step is rolled back; its masks are dropped
            if prep is not None:
                self.sampler.discard(prep)
            raise
        finally:
            runner.extra_segments = None
            runner.before_forward = None
        t_fwd = time.perf_counter()
        # The model call is over: the rest of the step (sampling, outputs) runs its
        # torch ops on one thread (not with prompt logprobs: [tokens, vocab] ops).
        threads = torch.get_num_threads() if self._host_one_thread and not want else None
        if threads is not None:
            torch.set_num_threads(1)
        try:
            return self._after_forward(plan, step, prep, want, t0, t_sched, t_fwd, changed, now)
        finally:
            if threads is not None:
                torch.set_num_threads(threads)

    def _after_forward(self, plan: Any, step: Any, prep: Any, want: Any, t0: float, t_sched: float,
                       t_fwd: float, changed: dict[str, set[int]], now: float) -> list[RequestOutput]:
        """The rest of :meth:`step` after the model call: sampling, the scheduler's
        update, detokenization, stop strings and the outputs."""
        runner = self.runner
        # The runner stamps the end of its input preparation; a wrapper that did not
        # run the real runner leaves no stamp and the whole call counts as forward.
        t_prep = getattr(self.runner, "inputs_ready_at", None)
        if t_prep is None or not t_sched <= t_prep <= t_fwd:
            t_prep = t_sched
        # The hand-off run before the model call (inside prepare's clock reads) moves
        # to process_outputs, the phase it belongs to.
        handoff = min(self._before_forward_seconds, t_prep - t_sched)
        if self.fault_injector is not None:
            self.fault_injector.point("forward")
        self._fault_phase = "sample"
        if step is not None and step.prompt_spans:
            logprobs.record_prompt_logprobs(self.requests, self._prompt_logprobs, plan, step)
        job, self._structured_job = self._structured_job, None
        if job is not None and step is not None and len(step.batch_index):
            self.structured.apply(job, step.logits)
        if step is not None and len(step.batch_index):
            if prep is not None:
                views, runner.extra_views = runner.extra_views, None
                out = self.sampler.sample_planned(step.logits, prep, views)
                prep = None
            else:
                out = self.sampler(step.logits, self._sampling_rows(plan, step.batch_index, step.num_samples))
            sampled = np.asarray(out.token_ids, dtype=np.int32)
            beams_ended = self._beam_select(plan, step, sampled) if self._beams else ()
            logprobs.record_logprobs(self.requests, plan, step, out)
        else:
            out = None
            sampled = np.zeros(0, dtype=np.int32)
            beams_ended = ()
        if prep is not None:  # planned rows the step did not sample
            self.sampler.discard(prep)
        t_sample = time.perf_counter()
        if self.fault_injector is not None:
            self.fault_injector.point("sample")
        update = self.scheduler.update(sampled)
        self._fault_update, self._fault_phase = update, "output"
        if self.fault_injector is not None:
            self.fault_injector.point("output")
        now = time.monotonic()

        requests = self.requests
        # Outputs of this step. A running single-sample request that is not a beam,
        # wants no prompt logprobs and does not finish now gets its delta output in
        # this one pass over the new tokens (the common row); every other changed
        # request is collected in `changed` and handled below.
        outputs: list[RequestOutput] = []
        fast = self.emit_unfinished
        finishing = set(update.finished_request_ids) if len(update.finished_request_ids) else ()
        beams, plp = self._beams, self._prompt_logprobs
        ids = update.request_ids
        tokens = np.asarray(update.token_ids).tolist()
        steady, self._steady_rows = self._steady_rows, None
        rows: list[tuple] | None = None
        if (steady is not None and fast and not finishing and steady[0] == self._requests_epoch
                and steady[1] == ids):
            # The same common rows as the last step (no request added, aborted or
            # finished since, the same batch in the same order): their objects are
            # known, so the rows need no lookups and no checks of what kind they are.
            if steady_row_outputs(self.scheduler, steady[2], tokens, now, outputs, changed):
                rows = steady[2]
            general: Any = ()
        else:
            # This step's common rows, kept for the next step if every row is one.
            rows = [] if fast and not finishing and not beams and not plp else None
            general = zip(ids, np.asarray(update.sample_indices).tolist(), tokens)
        for rid, si, tok in general:
            state = requests.get(rid)
            if state is None:
                continue
            samples = state.samples
            sample = samples[si]
            token_ids = sample.token_ids
            token_ids.append(tok)
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            completion = sample.completion
            if sample.finish_reason is None:
                if (fast and len(samples) == 1 and rid not in finishing and not (beams and rid in beams)
                        and not (plp and rid in plp)):
                    # The common row: the text to stream and the delta output in one
                    # pass (SampleState.delta_output's fields, built here).
                    text = completion.append_streaming(tok) if completion is not None else ""
                    if text is not None:
                        outputs.append(common_row_output(rid, state.prompt, state.prompt_token_ids, sample,
                                                         token_ids, tok, text, m))
                        if rows is not None:
                            rows.append((rid, sample, token_ids, m, completion, state.prompt,
                                         state.prompt_token_ids))
                        continue
                    hit = completion.stop_string
                elif completion is not None:
                    hit = completion.append(tok)
                else:
                    hit = None
                if hit is not None:
                    sample.finish_reason, sample.stop_reason = "stop", hit
                    self.scheduler.finish(rid, si, "stop")
            got = changed.get(rid)
            if got is None:
                changed[rid] = {si}
            else:
                got.add(si)
        for rid, si, reason in zip(
            update.finished_request_ids, update.finished_sample_indices, update.finished_reasons
        ):
            state = self.requests.get(rid)
            if state is None:
                continue
            sample = state.samples[int(si)]
            if sample.finish_reason is None:
                sample.finish_reason = reason
                # A stop token (not EOS) is reported as the stop reason, as vLLM does.
                last = sample.token_ids[-1] if sample.token_ids else None
                if reason == "stop" and last in state.params.stop_token_ids:
                    sample.stop_reason = last
                if sample.completion is not None:
                    sample.completion.finish()
            changed.setdefault(rid, set()).add(int(si))

        for rid in beams_ended:
            # The search is over before max_tokens: no running beam can beat the
            # finished ones. Every block and slot of the W beams goes back.
            state = self.requests.get(rid)
            if state is not None and not state.finished:
                # Finished, not aborted: /metrics counts client aborts separately.
                for i in range(len(state.samples)):
                    self.scheduler.finish(rid, i, "stop")
                for sample in state.samples:
                    sample.finish_reason = sample.finish_reason or "stop"
                changed.setdefault(rid, set())

        # Running requests report only what is new (delta outputs); a finished one
        # reports its whole result once.
        requests, beams, emit = self.requests, self._beams, self.emit_unfinished
        for rid, changed_samples in changed.items():
            state = requests.get(rid)
            if state is None:
                continue
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del requests[rid]
                self._requests_epoch += 1
                self._release_sampler_rows(rid, state)
            elif not emit or rid in beams:
                continue  # beams are reported once, finished (their order changes every step)
            if beams and rid in beams:
                outputs.append(self._beam_output(rid, state))
                del beams[rid]
                continue
            out_ = state.to_output() if finished else state.delta_output(changed_samples)
            if self._prompt_logprobs and rid in self._prompt_logprobs:
                out_.prompt_logprobs = PromptLogprobList(self._prompt_logprobs[rid][1])
                if finished:
                    del self._prompt_logprobs[rid]
            outputs.append(out_)
        if rows and len(rows) == len(ids):
            self._steady_rows = (self._requests_epoch, ids, rows)
        self.step_count += 1
        t_end = time.perf_counter()
        phases = (t_sched - t0, t_prep - t_sched - handoff, t_fwd - t_prep, t_sample - t_fwd,
                  t_end - t_sample + handoff)
        acc = self._phase_seconds
        for name, dt in zip(STEP_PHASES, phases):
            acc[name] += dt
        self.last_step_stats = {
            "num_scheduled_seqs": len(plan.request_ids),
            "num_batched_tokens": len(plan.input_ids),
            "step_seconds": t_end - t0,
            "phase_seconds": dict(zip(STEP_PHASES, phases)),
        }
        return outputs

    def _run_before_forward(self) -> None:
        t0 = time.perf_counter()
        try:
            self.before_forward()  # type: ignore[misc]
        finally:
            self._before_forward_seconds += time.perf_counter() - t0

    def add_phase_time(self, phase: str, seconds: float) -> None:
        """Adds host work done for the engine outside ``step()`` (the async engine's
        hand-off of outputs to the clients' queues) to a phase's total."""
        self._phase_seconds[phase] += seconds

    # ------------------------------------------------------- structured outputs
    def structured_decoding(self) -> Any:
        """The engine's :class:`~hybridserve.structured.engine_hook.StructuredDecoding`
        (built on first use: it reads the whole vocabulary once)."""
        if self.structured is None:
            from hybridserve.structured.engine_hook import BUILD_LOCK, StructuredDecoding

            with BUILD_LOCK:  # the server builds it off the engine thread, maybe twice at once
                if self.structured is None:
                    self.structured = StructuredDecoding(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids)
        return self.structured

    def _add_structured(self, request_id: str, params: SamplingParams) -> None:
        from hybridserve.structured.engine_hook import check_params

        check_params(params)
        self.structured_decoding().add(request_id, params.structured_outputs)

    # ----------------------------------------------------------------- helpers
    def stats(self) -> dict[str, Any]:
        d = dict(self.scheduler.stats())
        # Layout padding of the pages in use: every KV page wastes kv_padding_bytes,
        # every state (running or checkpoint) state_padding_bytes.
        lay = self.arena_plan.layout
        states = (d["running_state_pages"] + d["checkpoint_pages"]) // max(lay.state_pages, 1)
        d["page_bytes"] = lay.page_bytes
        d["padding_bytes"] = d["kv_pages"] * lay.kv_padding_bytes + states * lay.state_padding_bytes
        # [(cause, victim request_class, count)]: JSON-friendly.
        d["preemptions_by"] = [(c, k, n) for (c, k), n in sorted(self.preemptions_by.items())]
        d["step_phase_seconds"] = dict(self._phase_seconds)
        d["failed_steps"] = self.failed_steps
        d["retried_requests"] = self.retried_requests
        d["errored_requests"] = self.errored_requests
        if self.structured is not None:
            d["structured"] = self.structured.stats()
        return d

