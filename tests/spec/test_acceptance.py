"""Draft acceptance against its oracle: non-speculative sampling of the same rows.

Each verify row's logits are fixed here, so the oracle is the ordinary sampler drawing
one token per step from row 0, 1, 2, ... of the same sequence, with the same seeded
stream and penalty history. Speculation must give exactly that sequence's prefix up to
(and including) the first token that differs from the drafts.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve.sampler import Sampler, make_generator
from hybridserve.sampler.rows import SamplingRow
from hybridserve.sampling import SamplingParams
from hybridserve.spec.acceptance import VerifyEntry, accept, plain_greedy

V = 37


def _params(kind: str, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=64)
    if kind == "greedy_pen":
        return SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.3, presence_penalty=0.5)
    if kind == "seeded":
        return SamplingParams(temperature=0.9, top_k=6, top_p=0.9, seed=seed, max_tokens=64)
    if kind == "seeded_pen":
        return SamplingParams(temperature=1.1, min_p=0.02, frequency_penalty=0.7, seed=seed, max_tokens=64,
                              logit_bias={3: 2.0, 5: -1.0}, logprobs=2)
    raise AssertionError(kind)


def _sequential(kind: str, seed: int, logits: torch.Tensor, history: list[int], n: int) -> list[int]:
    """The oracle: n ordinary decode steps, row j's token drawn from logits[j]."""
    sampler = Sampler()
    params = _params(kind, seed)
    out_ids = list(history)
    gen = make_generator(params.seed, 0)
    row = SamplingRow(params=params, prompt_token_ids=[1, 2, 3], output_token_ids=out_ids, generator=gen,
                      key=("oracle", 0))
    got = []
    for j in range(n):
        t = sampler(logits[j:j + 1], [row]).token_ids[0]
        got.append(t)
        out_ids.append(t)
    return got


@pytest.mark.parametrize("kind", ["greedy", "greedy_pen", "seeded", "seeded_pen"])
def test_accepts_the_prefix_the_target_would_have_drawn(kind):
    rnd = random.Random(hash(kind) & 0xFFFF)
    for trial in range(40):
        d = rnd.randint(1, 4)
        seed = rnd.randint(0, 10_000)
        g = torch.Generator().manual_seed(trial)
        # Peaked rows so that drafts equal to the oracle are common, and rows that differ.
        logits = torch.randn(d + 1, V, generator=g) * 4.0
        history = [rnd.randrange(V) for _ in range(rnd.randint(0, 5))]
        oracle = _sequential(kind, seed, logits, history, d + 1)
        # Drafts: the oracle's tokens with a random break point (or none).
        brk = rnd.randint(0, d)
        drafts = oracle[:d]
        if brk < d:
            drafts = drafts[:brk] + [(drafts[brk] + 1 + rnd.randrange(V - 1)) % V] + drafts[brk + 1:]
        expect = oracle[: brk + 1] if brk < d else oracle

        sampler = Sampler()
        params = _params(kind, seed)
        out_ids = list(history)
        row = SamplingRow(params=params, prompt_token_ids=[1, 2, 3], output_token_ids=out_ids,
                          generator=make_generator(params.seed, 0), key=("r", 0))
        first = sampler(logits[0:1], [row])
        e = VerifyEntry(drafts=drafts, rows=list(range(d)), row=row, history=out_ids)
        flp = None
        if first.logprobs is not None:
            flp = [(first.logprobs[0], first.ranks[0], first.top_logprobs[0])]
        accept(sampler, logits[1:], [e], first.token_ids, flp)
        assert e.tokens == expect, (trial, drafts, oracle)
        if params.logprobs is not None:
            assert len(e.logprobs) == len(e.tokens)


def test_plain_greedy_batch_takes_one_argmax_and_stops_at_the_first_mismatch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, V, generator=g)
    top = logits.argmax(-1).tolist()
    sampler = Sampler()
    p = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[], key=(i, 0)) for i in range(2)]
    assert plain_greedy(rows[0], 3)
    # entry 0: rows 0..3 (3 drafts, all accepted -> 4 tokens); entry 1: rows 4..6, mismatch at draft 2.
    e0 = VerifyEntry(drafts=[top[0], top[1], top[2]], rows=[1, 2, 3], row=rows[0], history=[])
    e1 = VerifyEntry(drafts=[top[4], (top[5] + 1) % V], rows=[5, 6], row=rows[1], history=[])
    accept(sampler, logits, [e0, e1], [top[0], top[4]])
    assert e0.tokens == [top[0], top[1], top[2], top[3]]
    assert e1.tokens == [top[4], top[5]]


def test_min_tokens_rows_are_not_plain_greedy():
    p = SamplingParams(temperature=0.0, min_tokens=5)
    row = SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[1, 2], key=(0, 0))
    assert not plain_greedy(row, 2)
