"""Result types of a generation, with vLLM's names so that vLLM users' code reads them.

``LLM.generate`` returns one ``RequestOutput`` per prompt, in prompt order; each holds
``n`` ``CompletionOutput``s ordered by sample index. The streaming engine yields
``RequestOutput``s whose completions grow; ``finished`` turns true exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability as reported to the user.

    ``rank`` is 1 for the most likely token of the distribution (vLLM's convention);
    ``decoded_token`` is the token's text when the engine detokenizes it.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob} holding the chosen token and the top-k
# alternatives (vLLM's SampleLogprobs).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One completion (sample) of a request.

    finish_reason: None while running; "stop" (EOS, a stop token or a stop string) or
      "length" (max_tokens reached) once finished; "abort" when cancelled.
    stop_reason: the stop token id or stop string that ended it; None for EOS, length
      or while running.
    cumulative_logprob: the sum of the chosen tokens' logprobs; None unless the
      request asked for logprobs (as vLLM).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one request, plus its prompt.

    ``finished`` is true when every completion has finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    prompt_logprobs: Any = None


__all__ = ["Logprob", "SampleLogprobs", "CompletionOutput", "RequestOutput"]
