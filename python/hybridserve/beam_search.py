"""Beam search inside the engine: parameters and results in vLLM's names, and the
per-step selection that the engine runs on each beam request's logits.

One request holds W beams (W sequences of the Rust scheduler). The prompt is
prefilled once; its last row's log-softmax gives the first W tokens (the fork:
W beams sharing the prompt's blocks, the DeltaNet state copied to each). Then
every step decodes the W beams together, :meth:`BeamSearch.step` scores every
beam's top candidates and keeps the best W, and the scheduler re-parents the
survivors (``Scheduler.reorder_beams``: block tables forked, copy-on-write of
the shared tail, dropped beams' blocks released, state slots copied parent ->
child in the next plan).

The selection follows HF transformers' ``_beam_search`` (``early_stopping=False``):
the top ``max(2, 1 + #eos) * W`` candidates by cumulative logprob; those among the
first W that end in EOS (or reach ``max_tokens``) go to a finished list scored
``cum_logprob / generated_len ** length_penalty`` that keeps the best W; the best
W candidates that did not finish continue. The search stops when every kept
candidate finished (``max_tokens``) or, once W sequences are finished, when the
best running beam's score at the current length cannot beat the worst of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridserve.errors import InvalidRequest


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens.

    Beam search is deterministic: ``temperature`` must be 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequest(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise InvalidRequest(
                f"temperature must be 0 with beam search (got {self.temperature}): beams are scored "
                "by log-probability, not sampled"
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidRequest(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam, vLLM's naming: ``tokens`` is prompt + generated (an EOS
    that ended it included); ``text`` is the generated text only."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Generated tokens (``tokens`` past the prompt) and the score the ranking used.
    output_token_ids: list[int] = field(default_factory=list)
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The selection state of one beam request (engine side; no KV, no slots).

    ``first_step`` takes the prompt's last log-softmax row and returns W tokens
    (sample i starts with token i); ``step`` takes the W beams' rows (row i is
    sample i) and returns ``(parents, tokens)``: new beam i continues old beam
    ``parents[i]`` with ``tokens[i]``. ``done`` turns true when the search is over.
    """

    def __init__(self, width: int, max_tokens: int, eos_token_ids: list[int], length_penalty: float,
                 ignore_eos: bool) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.eos = [] if ignore_eos else list(eos_token_ids)
        self.length_penalty = length_penalty
        self.keep = max(2, 1 + len(self.eos)) * width
        self.generated = 0
        self.tokens: list[list[int]] = [[] for _ in range(width)]
        self.cum = torch.zeros(width, dtype=torch.float32)
        # (score, cum_logprob, generated tokens, finish_reason), best first.
        self.finished: list[tuple[float, float, list[int], str]] = []
        self.improvable = True
        self.done = False

    def first_step(self, logprobs: torch.Tensor) -> list[int]:
        start = torch.full((self.width,), -1.0e9, dtype=torch.float32)
        start[0] = 0.0
        parents, tokens = self._select(logprobs[None, :].float().expand(self.width, -1), start)
        assert all(p == 0 for p in parents)
        return tokens

    def step(self, logprobs: torch.Tensor) -> tuple[list[int], list[int]]:
        return self._select(logprobs.float(), self.cum)

    def _select(self, logprobs: torch.Tensor, cum: torch.Tensor) -> tuple[list[int], list[int]]:
        vocab = logprobs.shape[-1]
        # Scored and cut to 2W candidates where the logits are; only those cross to the host.
        scores = (logprobs + cum.to(logprobs.device)[:, None]).reshape(-1)
        top_s, top_i = torch.topk(scores, min(self.keep, scores.numel()))
        top_s, top_i = top_s.cpu(), top_i.cpu()
        beam = (top_i // vocab).tolist()
        tok = (top_i % vocab).tolist()
        gen = self.generated + 1
        eos = set(self.eos)
        hit = [t in eos or gen >= self.max_tokens for t in tok]
        # Candidates among the first W that finished enter the finished list.
        lp_len = float(gen) ** self.length_penalty
        for j in range(min(self.width, len(tok))):
            if hit[j]:
                s = float(top_s[j])
                reason = "stop" if tok[j] in eos else "length"
                self.finished.append((s / lp_len, s, self.tokens[beam[j]] + [tok[j]], reason))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.width:]
        masked = top_s + torch.tensor(hit, dtype=torch.float32) * -1.0e9
        sel = torch.topk(masked, self.width).indices.tolist()
        parents = [beam[j] for j in sel]
        tokens = [tok[j] for j in sel]
        self.tokens = [self.tokens[p] + [t] for p, t in zip(parents, tokens)]
        self.cum = masked[sel].clone()
        self.generated = gen
        if len(self.finished) == self.width:
            best_running = float(self.cum[0]) / lp_len
            if not best_running > self.finished[-1][0]:
                self.improvable = False
        self.done = all(hit) or not self.improvable
        return parents, tokens

    def results(self) -> list[tuple[float, float, list[int], str]]:
        """The W best finished sequences, best first: (score, cum_logprob, tokens, reason)."""
        return list(self.finished)
