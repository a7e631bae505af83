"""Input processing: from a prompt and its parameters to the request the engine core runs.

Tokenization, the checks a request must pass before it touches the scheduler (token
ids in the vocabulary, a non-empty prompt that leaves room for output, prompt logprobs,
beam width, structured-output grammars) and the request's Python state (its samples'
generators and detokenizers). What it builds, :class:`EngineRequest`, is handed to
:meth:`hybridserve.engine.core.EngineCore.add_request`. Chat templates are rendered by
the server before a prompt gets here (``hybridserve.tokenizer.apply_chat_template``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridserve.beam_search import BeamSearch, BeamSearchParams
from hybridserve.engine.request_state import RequestState
from hybridserve.errors import InvalidRequest
from hybridserve.sampling import MAX_LOGPROBS, SamplingParams


@dataclass
class EngineRequest:
    """A checked request, ready for the core: its state and the scheduler's arguments."""

    request_id: str
    state: RequestState
    prompt_token_ids: np.ndarray  # uint32, as the scheduler takes them
    # Keyword arguments of the Rust scheduler's add_request.
    schedule: dict[str, Any] = field(default_factory=dict)
    # k alternatives per prompt token wanted, or None.
    prompt_logprobs: int | None = None
    # The search state of a beam request, None otherwise.
    beam: BeamSearch | None = None
    # Whether a grammar was compiled for it (the core gives it back if refused).
    structured: bool = False


class InputProcessor:
    """Turns prompts and parameters into :class:`EngineRequest` s; knows no scheduler."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 eos_token_ids: list[int], device: torch.device,
                 structured_decoding: Callable[[], Any]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = eos_token_ids
        self.device = device
        # Builds (once) and returns the engine's StructuredDecoding.
        self.structured_decoding = structured_decoding

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            # As vLLM and the tokenizer's default: the special tokens its post-processor
            # adds (a BOS) are part of a text prompt (Qwen's tokenizers add none).
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        ids = [int(t) for t in prompt]
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt token ids must be in [0, {vocab}); got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        return None, ids

    def check_params(self, params: SamplingParams) -> None:
        """The checks that need the model (before the queue's room is asked for)."""
        params.check_vocab(self.vocab_size)

    def check_beam_params(self, params: Any) -> None:
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequest("add_beam_request takes BeamSearchParams")
        width, cap = params.beam_width, self.max_num_seqs
        if width > cap:
            raise InvalidRequest(
                f"beam_width = {width} exceeds what the engine can run at once (max_num_seqs = {cap}); "
                "lower beam_width"
            )

    def process(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams, *,
                priority: int = 0, request_class: str = "default", arrival_time: float | None = None,
                prompt_logprobs: int | None = None) -> EngineRequest:
        """A sampling request over the tokenized prompt ``ids`` (``text`` when it was text)."""
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
        # Checked before a grammar is compiled: a refusal after it would keep the grammar.
        if prompt_logprobs is not None and (
                not isinstance(prompt_logprobs, int) or not 0 <= prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}]")
        structured = params.structured_outputs is not None
        if structured:
            from hybridserve.structured.engine_hook import check_params

            check_params(params)
            self.structured_decoding().add(request_id, params.structured_outputs)
        state = RequestState.create(
            request_id, text, ids, params, self.tokenizer, self.device,
            priority=priority, request_class=request_class, arrival_time=arrival_time,
        )
        schedule: dict[str, Any] = dict(
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=list(params.stop_token_ids or []),
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            n=params.n,
            priority=priority,
            request_class=request_class,
        )
        if prompt_logprobs is not None:
            # Every prompt position must run through the model: a private prefix-cache
            # key keeps a cached prefix from skipping positions whose logits we need.
            schedule["extra_key"] = int.from_bytes(os.urandom(8), "little")
        return EngineRequest(request_id, state, np.asarray(ids, dtype=np.uint32), schedule,
                             prompt_logprobs=prompt_logprobs, structured=structured)

    def process_beam(self, request_id: str, text: str | None, ids: list[int], params: BeamSearchParams, *,
                     priority: int = 0, request_class: str = "default") -> EngineRequest:
        """One beam-search request: W beams held by one scheduler request (admission
        reserves W states and the blocks W beams can need)."""
        if not ids:
            raise InvalidRequest("the prompt is empty; send at least one token")
        width = params.beam_width
        sp = SamplingParams(n=width, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        state = RequestState.create(
            request_id, text, ids, sp, None, self.device, priority=priority, request_class=request_class,
        )
        # EOS is the search's business (finished list); the scheduler stops beams only at max_tokens.
        schedule = dict(max_tokens=params.max_tokens, ignore_eos=True, eos_token_ids=self.eos_token_ids, n=width,
                        priority=priority, request_class=request_class, beam_search=True)
        beam = BeamSearch(width, params.max_tokens, list(self.eos_token_ids), params.length_penalty,
                          params.ignore_eos)
        return EngineRequest(request_id, state, np.asarray(ids, dtype=np.uint32), schedule, beam=beam)
