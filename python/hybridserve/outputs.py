"""Result types of a generation, with vLLM's names so that vLLM users' code reads them.

``LLM.generate`` returns one ``RequestOutput`` per prompt, in prompt order; each holds
``n`` ``CompletionOutput``s ordered by sample index.

The streaming engine yields *incremental* outputs (``delta=True``) while a request
runs: each holds only the samples that changed in that step, and each of those only
its new tokens, their logprobs and the new text that is safe to stream (text that could
still become part of a stop string is held back). The last output of a request
(``finished=True``, ``delta=False``) carries the whole result once: every sample's full
text, tokens and logprobs. :class:`DeltaCursor` turns that sequence into "what is new"
for a consumer that streams, so a step's host work grows with what is new, never with
what has been generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any


@dataclass(slots=True)
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


class PromptLogprobList(Sequence):
    """A request's prompt logprobs, read as vLLM's ``list[dict[int, Logprob] | None]``.

    Held compactly: one plain tuple per prompt position, ``(token, logprob, rank,
    top ids, top logprobs)`` (None for the first token), and each position's
    ``{token: Logprob}`` made when it is read. A long prompt with k alternatives would
    otherwise keep one ``Logprob`` per (position, candidate) alive, hundreds of
    thousands of objects the cyclic collector walks on every full collection, each a
    pause that holds the GIL (the server's event loop included); a tuple of numbers is
    untracked by the collector at its first look.
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: list[tuple | None]) -> None:
        self._rows = rows

    @staticmethod
    def _entry(row: tuple | None) -> dict[int, Logprob] | None:
        if row is None:
            return None
        tok, lp, rank, top_ids, top_lps = row
        entry = {tok: Logprob(lp, rank=rank)}
        for r, (alt, v) in enumerate(zip(top_ids, top_lps), start=1):
            entry.setdefault(alt, Logprob(v, rank=r))
        return entry

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._entry(r) for r in self._rows[i]]
        return self._entry(self._rows[i])

    def __iter__(self):
        return map(self._entry, self._rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PromptLogprobList, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"PromptLogprobList({list(self)!r})"


@dataclass(slots=True)
class CompletionOutput:
    """One completion (sample) of a request.

    (The engine's per-step path builds it with positional arguments: keep the field
    order. Slots, no ``__dict__``: one is made per running sample per step, and a
    slotted instance is made and filled without a dictionary.)

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


@dataclass(slots=True)
class RequestOutput:
    """All completions of one request, plus its prompt.

    ``finished`` is true when every completion has finished. (The engine's per-step
    path builds it with positional arguments: keep the field order.)
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    prompt_logprobs: Any = None
    # True: the completions hold only what is new since this request's previous output
    # (and only the samples that changed); False: the whole result.
    delta: bool = False


class DeltaCursor:
    """What a consumer has received of one request's completions, so that each output
    (incremental or the final whole one) yields only its new part."""

    def __init__(self) -> None:
        self._chars: dict[int, int] = {}
        self._tokens: dict[int, int] = {}

    def new_part(self, c: CompletionOutput, delta: bool) -> tuple[str, list[int], SampleLogprobs | None]:
        """(new text, new token ids, their logprobs or None) of completion ``c``."""
        chars, toks = self._chars.get(c.index, 0), self._tokens.get(c.index, 0)
        if delta:
            self._chars[c.index] = chars + len(c.text)
            self._tokens[c.index] = toks + len(c.token_ids)
            return c.text, c.token_ids, c.logprobs
        self._chars[c.index], self._tokens[c.index] = len(c.text), len(c.token_ids)
        return c.text[chars:], c.token_ids[toks:], c.logprobs[toks:] if c.logprobs is not None else None


__all__ = ["Logprob", "SampleLogprobs", "PromptLogprobList", "CompletionOutput", "RequestOutput", "DeltaCursor"]
