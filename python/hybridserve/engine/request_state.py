"""What the Python side remembers of a request: its tokens as text, RNGs and logprobs.

The Rust scheduler owns the request's scheduling state (tokens, blocks, slot, stop
conditions). This module keeps only what needs tensors or a tokenizer: one
:class:`SampleState` per sample (its generator, detokenizer, text and logprobs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

import torch

from hybridserve.detokenizer import CompletionText
from hybridserve.outputs import CompletionOutput, Logprob, RequestOutput
from hybridserve.sampler import make_generator
from hybridserve.sampling import SamplingParams


# Slots: the engine reads and writes these once per running sample per step; a slotted
# instance keeps its fields in the object (fewer cache lines to touch after a forward
# has evicted them).
@dataclass(slots=True)
class SampleState:
    index: int
    generator: torch.Generator | None
    completion: CompletionText | None  # text, stop strings, streaming holdback
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Tokens already handed out in incremental outputs.
    streamed_tokens: int = 0
    # The sampler's row for this sample, made at its first decode and reused.
    sampling_row: Any = None

    @property
    def text(self) -> str:
        return self.completion.text if self.completion is not None else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta_output(self) -> CompletionOutput:
        """What is new since the last output: the tokens (and their logprobs) past
        ``streamed_tokens`` and the text that is safe to stream (a possible stop-string
        prefix held back until it is decided). O(new), not O(generated)."""
        n0 = self.streamed_tokens
        token_ids = self.token_ids
        self.streamed_tokens = len(token_ids)
        finished = self.finish_reason is not None
        # Positional: this runs once per running sample per step, and keyword
        # arguments cost a dataclass __init__ about twice as much.
        return CompletionOutput(
            self.index,
            self.completion.take_delta(finished) if self.completion is not None else "",
            token_ids[n0:],
            self.cumulative_logprob,
            self.logprobs[n0:] if self.logprobs is not None else None,
            self.finish_reason,
            self.stop_reason,
        )

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    request_class: str = "default"
    first_scheduled_time: float | None = None
    # Arrival to first schedule, measured by the Rust scheduler.
    queue_delay: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    # A tuple: CPython stops tracking a tuple of ints in the garbage collector, so a
    # long prompt costs full collections nothing (a list's every element is visited
    # by each one: O(context) host time per collection).
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    priority: int = 0
    user_data: Any = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        device: torch.device,
        *,
        priority: int = 0,
        request_class: str = "default",
        arrival_time: float | None = None,
    ) -> "RequestState":
        samples = []
        for i in range(params.n):
            completion = (
                CompletionText(tokenizer, prompt_token_ids, params) if tokenizer is not None else None
            )
            samples.append(
                SampleState(
                    index=i,
                    generator=make_generator(params.seed, i, device),
                    completion=completion,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        return cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            samples=samples,
            metrics=RequestMetrics(
                arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                request_class=request_class,
            ),
            priority=priority,
        )

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:  # the common case, asked several times per step
            return samples[0].finish_reason is not None
        return all(s.finish_reason is not None for s in samples)

    def delta_output(self, sample_indices: Iterable[int]) -> RequestOutput:
        """An incremental output (``delta=True``) holding only the samples in
        ``sample_indices`` (those that changed this step), each with only what is new.
        The prompt is the request's own tuple, shared, not copied."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.samples[i].delta_output()
                     for i in (sample_indices if len(sample_indices) == 1 else sorted(sample_indices))],
            finished=False,
            metrics=self.metrics,
            delta=True,
        )

    def single_delta_output(self) -> RequestOutput:
        """:meth:`delta_output` of a running one-sample request (the common row of a
        decode step), arguments positional."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [self.samples[0].delta_output()],
                             False, self.metrics, None, True)

    def to_output(self) -> RequestOutput:
        """The whole result (``delta=False``): every sample's text, tokens and logprobs."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[s.to_output() for s in self.samples],
            finished=self.finished,
            metrics=self.metrics,
        )
