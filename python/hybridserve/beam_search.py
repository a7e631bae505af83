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
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.errors import InvalidRequest

# |length_penalty| beyond this ranks beams by length alone (the power swamps any score
# difference); refused so a typo is not silently a different search.
MAX_LENGTH_PENALTY = 100.0


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
        if not math.isfinite(self.length_penalty) or abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise InvalidRequest(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty!r}"
            )


def length_normalised(score: float, gen: int, length_penalty: float) -> float:
    """``score / gen ** length_penalty`` that never raises: a power that overflows
    divides by infinity, one that underflows by the smallest positive float."""
    try:
        d = float(gen) ** length_penalty
    except OverflowError:
        return score * 0.0
    return score / max(d, sys.float_info.min)


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

    The engine splits a step in two so that every beam request of a batch costs one
    device->host transfer together: :meth:`candidates` (on the device: each beam's
    ``keep`` best tokens) and :meth:`advance` (on the host, from those candidates).
    The global best ``keep`` of (beam's cumulative logprob + token logprob) are among
    each beam's own best ``keep``, so the choice is the same as over the whole rows.
    Beams are kept as linked (token, parent) nodes: a step costs O(W), not
    O(W x generated); a sequence's tokens are materialised once, in :meth:`results`.
    """

    def __init__(self, width: int, max_tokens: int, eos_token_ids: list[int], length_penalty: float,
                 ignore_eos: bool) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.eos = [] if ignore_eos else list(eos_token_ids)
        self.length_penalty = length_penalty
        self.keep = max(2, 1 + len(self.eos)) * width
        self.generated = 0
        # Beam i's last node: (token, parent node) or None before the first token.
        self._nodes: list[tuple[int, Any] | None] = [None] * width
        self.cum = torch.zeros(width, dtype=torch.float32)
        # (score, cum_logprob, last node, finish_reason), best first.
        self.finished: list[tuple[float, float, tuple[int, Any], str]] = []
        self.improvable = True
        self.done = False

    @property
    def tokens(self) -> list[list[int]]:
        """The running beams' generated tokens (materialised: O(W x generated))."""
        return [_materialise(n) for n in self._nodes]

    def candidates(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``keep`` best (logprob, token id), on the logits' device."""
        k = min(self.keep, logprobs.shape[-1])
        return torch.topk(logprobs.float(), k, dim=-1)

    def first_step(self, logprobs: torch.Tensor) -> list[int]:
        (vals, idx), = candidates_to_host([self.candidates(logprobs[None, :])])
        parents, tokens = self.advance(vals, idx)
        assert all(p == 0 for p in parents)
        return tokens

    def step(self, logprobs: torch.Tensor) -> tuple[list[int], list[int]]:
        (vals, idx), = candidates_to_host([self.candidates(logprobs)])
        return self.advance(vals, idx)

    def advance(self, vals: list[list[float]], idx: list[list[int]]) -> tuple[list[int], list[int]]:
        """One selection from the candidates of :meth:`candidates` (one row: the
        prompt's, the fork; W rows: the beams'). Returns ``(parents, tokens)``."""
        rows, k = len(vals), len(vals[0])
        # float32 on the host, as the device would add them: the same scores.
        scores = (torch.tensor(vals, dtype=torch.float32) + self.cum[:rows, None]).reshape(-1)
        top_s, top_j = torch.topk(scores, min(self.keep, scores.numel()))
        js = top_j.tolist()
        beam = [j // k for j in js]
        tok = [idx[j // k][j % k] for j in js]
        gen = self.generated + 1
        eos = set(self.eos)
        hit = [t in eos or gen >= self.max_tokens for t in tok]
        # Candidates among the first W that finished enter the finished list.
        for j in range(min(self.width, len(tok))):
            if hit[j]:
                s = float(top_s[j])
                reason = "stop" if tok[j] in eos else "length"
                self.finished.append((length_normalised(s, gen, self.length_penalty), s, (tok[j], self._nodes[beam[j]]), reason))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.width:]
        masked = top_s + torch.tensor(hit, dtype=torch.float32) * -1.0e9
        sel = torch.topk(masked, self.width).indices.tolist()
        parents = [beam[j] for j in sel]
        tokens = [tok[j] for j in sel]
        self._nodes = [(t, self._nodes[p]) for p, t in zip(parents, tokens)]
        self.cum = masked[sel].clone()
        self.generated = gen
        if len(self.finished) == self.width:
            best_running = length_normalised(float(self.cum[0]), gen, self.length_penalty)
            if not best_running > self.finished[-1][0]:
                self.improvable = False
        self.done = all(hit) or not self.improvable
        return parents, tokens

    def results(self) -> list[tuple[float, float, list[int], str]]:
        """The W best finished sequences, best first: (score, cum_logprob, tokens, reason)."""
        return [(score, cum, _materialise(node), reason) for score, cum, node, reason in self.finished]


def _materialise(node: tuple[int, Any] | None) -> list[int]:
    out = []
    while node is not None:
        out.append(node[0])
        node = node[1]
    out.reverse()
    return out


def candidates_to_host(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list[list[float]],
                                                                                       list[list[int]]]]:
    """The candidates of several beam requests in one device->host transfer."""
    if not parts:
        return []
    flat = torch.cat([t.double().flatten() for v, i in parts for t in (v, i)]).tolist()
    out, at = [], 0
    for v, i in parts:
        rows, k = v.shape
        n = rows * k
        vals = [flat[at + r * k: at + (r + 1) * k] for r in range(rows)]
        idx = [[int(x) for x in flat[at + n + r * k: at + n + (r + 1) * k]] for r in range(rows)]
        out.append((vals, idx))
        at += 2 * n
    return out
