"""The synchronous engine: the three parts of vLLM v1's engine, composed.

::

    add_request -> InputProcessor   tokenize, check, the request's state   (processor.py)
                -> EngineCore       schedule, run, sample, update, faults  (core.py)
    step        -> OutputProcessor  text, stop strings, outputs            (output_processor.py)

Start-up is :func:`hybridserve.engine.builder.build_engine_parts` (args -> config ->
weights -> memory plan -> arena -> runner -> graphs). :class:`LLMEngine` keeps the
attributes the rest of the code reads (``engine.scheduler``, ``engine.runner``,
``engine.model``, ...), each the part's own. It is single-threaded;
:class:`hybridserve.engine.async_engine.AsyncEngine` runs it on a thread for the server.
"""

from __future__ import annotations

import weakref

from collections.abc import Sequence
from typing import Any

from hybridserve.beam_search import BeamSearchParams
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.builder import build_engine_parts
from hybridserve.engine.core import STEP_PHASES, EngineCore
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.processor import InputProcessor
from hybridserve.errors import InvalidRequest
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

__all__ = ["LLMEngine", "STEP_PHASES"]


def _delegate(part: str, name: str) -> property:
    """``engine.<name>``: the attribute of one of the engine's parts, read and set there."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def set_(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, set_, doc=f"``{part}.{name}``")


class LLMEngine:
    """Continuous-batching engine over the Rust scheduler and the PyTorch runner."""

    def __init__(self, args: EngineArgs) -> None:
        parts = build_engine_parts(args)
        self.parts = parts
        # What start-up resolved and built (read by the server, benches and tests).
        self.args = parts.args
        self.device = parts.device
        self.parallel = parts.parallel
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.model_config = parts.model_config
        self.layout_config = parts.layout_config
        self.cpu_threads = parts.cpu_threads
        self.model = parts.model
        self.tokenizer = parts.tokenizer
        self.arena_plan = parts.arena_plan
        self.use_cuda_graphs = parts.use_cuda_graphs
        self.cache = parts.cache
        self.block_size = parts.args.block_size
        self.num_pages = self.arena_plan.num_pages
        self.state_pages = self.arena_plan.state_pages
        # The KV view of the same pages (every page can be a KV block).
        self.num_blocks = self.num_pages
        # Sequences of max_model_len tokens that fit at once (shorter ones: more).
        self.max_concurrency = self.arena_plan.sessions(self.max_model_len).sessions
        self._counter = 0
        try:
            self.core = EngineCore.from_parts(parts)
            # A weak reference: the processor must not keep the engine alive (the engine's
            # end is what closes tensor-parallel ranks, through weakref.finalize).
            structured = weakref.WeakMethod(self.structured_decoding)
            self.processor = InputProcessor(
                parts.tokenizer, parts.model_config.vocab_size, parts.max_model_len, parts.args.max_num_seqs,
                parts.eos_token_ids, parts.device, lambda: structured()(),
            )
            self.output_processor = self.core.output_processor = OutputProcessor(self.core, parts.tokenizer)
        except BaseException:
            if self.parallel is not None and self.parallel.is_driver:
                self.parallel.close()  # as the builder does: the workers would wait for a step
            raise
        self.max_blocks_per_seq = parts.max_blocks_per_seq
        if self.parallel is not None:
            # A worker rank serves the driver's steps here and never returns.
            self.parallel.attach(self)

    # The core's parts and state, read and set there (tests and benches wrap them).
    scheduler = _delegate("core", "scheduler")
    runner = _delegate("core", "runner")
    sampler = _delegate("core", "sampler")
    requests = _delegate("core", "requests")
    structured = _delegate("core", "structured")
    before_forward = _delegate("core", "before_forward")
    last_step_stats = _delegate("core", "last_step_stats")
    step_count = _delegate("core", "step_count")
    preemptions_by = _delegate("core", "preemptions_by")
    fault_injector = _delegate("core", "fault_injector")
    max_consecutive_step_failures = _delegate("core", "max_consecutive_step_failures")
    failed_steps = _delegate("core", "failed_steps")
    retried_requests = _delegate("core", "retried_requests")
    errored_requests = _delegate("core", "errored_requests")
    # Streaming consumers want every changed request each step; an offline loop only
    # the finished ones (see OutputProcessor).
    emit_unfinished = _delegate("output_processor", "emit_unfinished")

    @property
    def eos_token_ids(self) -> list[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        # Requests' stop conditions (the processor) and the sampler's rows (the core).
        self.processor.eos_token_ids = self.core.eos_token_ids = ids

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        return self.processor.tokenize(prompt)

    def _claim_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if self.core.has_request(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use; pick a unique id")
        return request_id

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
        request_id = self._claim_id(request_id)
        self.processor.check_params(params)
        self.core.check_waiting_room()
        text, ids = self.tokenize(prompt)
        return self.core.add_request(self.processor.process(
            request_id, text, ids, params, priority=priority, request_class=request_class,
            arrival_time=arrival_time, prompt_logprobs=prompt_logprobs,
        ))

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
        self.processor.check_beam_params(params)
        request_id = self._claim_id(request_id)
        self.core.check_waiting_room()
        text, ids = self.tokenize(prompt)
        return self.core.add_request(self.processor.process_beam(
            request_id, text, ids, params, priority=priority, request_class=request_class,
        ))

    def abort_request(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks and slot return to the pools."""
        self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step; return the outputs that changed
        (only the finished ones when ``emit_unfinished`` is False).

        A step that raises is rolled back and its requests retried once or ended with
        ``finish_reason == "error"`` (hybridserve.engine.faults); a fatal or repeating
        fault fails every open request and raises FatalEngineError, then and after."""
        return self.core.step()

    def add_phase_time(self, phase: str, seconds: float) -> None:
        """Adds host work done for the engine outside ``step()`` (the async engine's
        hand-off of outputs to the clients' queues) to a phase's total."""
        self.core.add_phase_time(phase, seconds)

    # ------------------------------------------------------- structured outputs
    def structured_decoding(self) -> Any:
        """The engine's :class:`~hybridserve.structured.engine_hook.StructuredDecoding`
        (built on first use: it reads the whole vocabulary once)."""
        core = self.core
        if core.structured is None:
            from hybridserve.structured.engine_hook import BUILD_LOCK, StructuredDecoding

            with BUILD_LOCK:  # the server builds it off the engine thread, maybe twice at once
                if core.structured is None:
                    core.structured = StructuredDecoding(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids, core=core)
        return core.structured

    def stats(self) -> dict[str, Any]:
        return self.core.stats()
