"""The reworked sampler (the hybridserve.sampler package) against the sampler it
replaced, kept frozen in tests/oracle/sampler_before_issue20.py (a copy of
python/hybridserve/sampler.py as of commit 6c663d6): same rows, same seeds, several
steps with running state, and the same tokens, logprobs and ranks.

A frozen copy rather than the old code from git: the test then runs in any checkout
(a shallow CI clone, an sdist) and the oracle cannot drift with later edits.
Column slicing is forced on (a small SLICE_BYTES) for some cases, so the sliced paths
of the processors and of the draw are held to the whole-row old implementation.
"""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys

import pytest
import torch

import hybridserve.sampler as new
import hybridserve.sampler.processors as processors
from hybridserve.sampler import Sampler, SamplingRow, make_generator
from hybridserve.sampling import SamplingParams

_path = pathlib.Path(__file__).parent / "oracle" / "sampler_before_issue20.py"
_spec = importlib.util.spec_from_file_location("sampler_before_issue20", _path)
old = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = old  # dataclasses look their module up there
_spec.loader.exec_module(old)

CASES = {
    "greedy": dict(temperature=0.0),
    "greedy+penalties+bias": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                                  presence_penalty=0.2, logit_bias={3: 5.0, 7: -2.0}),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.1, top_k=20),
    "top_p small k": dict(temperature=0.9, top_p=0.7, top_k=40),
    "top_p full sort": dict(temperature=0.9, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "everything": dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.3, logit_bias={11: 3.0}, min_tokens=3,
                       stop_token_ids=[5]),
    "logprobs": dict(temperature=0.9, top_p=0.95, logprobs=3),
}


def _run(mod, sampler, specs, vocab, steps, seed):
    """Steps a batch of rows (a fork row at the first step) through ``sampler``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[random.Random(seed + i).randrange(vocab) for _ in range(12)] for i in range(len(specs))]
    streams = {i: [mod.make_generator(p.seed, j) for j in range(n)] for i, (p, n) in enumerate(specs)}
    outputs = {i: [[] for _ in range(n)] for i, (_, n) in enumerate(specs)}
    got = []
    forked = set()
    for _ in range(steps):
        logits = torch.randn(len(specs) + sum(n - 1 for i, (_, n) in enumerate(specs) if i in forked), vocab,
                             generator=g) * 3
        rows = []
        for i, (params, n) in enumerate(specs):
            if n > 1 and i not in forked:
                rows.append(mod.SamplingRow(params=params, prompt_token_ids=prompts[i], output_token_ids=[],
                                            num_samples=n, generators=streams[i], keys=[(i, j) for j in range(n)],
                                            eos_token_id=2))
            else:
                for j in range(n):
                    rows.append(mod.SamplingRow(params=params, prompt_token_ids=prompts[i],
                                                output_token_ids=outputs[i][j], generator=streams[i][j],
                                                key=(i, j), eos_token_id=2))
        out = sampler(logits[: len(rows)], rows)
        k = 0
        for i, (_, n) in enumerate(specs):
            for j in range(n):
                outputs[i][j].append(out.token_ids[k])
                k += 1
            forked.add(i)
        got.append(out)
    return got


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_same_tokens_and_logprobs_as_the_sampler_it_replaced(monkeypatch, sliced, mode):
    vocab = 3000 if sliced else 300
    if sliced:
        # 1024-column slices (the minimum) over a 3000-token vocabulary: 3 slices.
        monkeypatch.setattr(processors, "SLICE_BYTES", 1)
    specs = []
    for c, (name, kw) in enumerate(CASES.items()):
        specs.append((SamplingParams(seed=100 + c, max_tokens=64, **kw), 1))
        specs.append((SamplingParams(seed=200 + c, max_tokens=64, n=2, **kw), 2))
    new_out = _run(new, Sampler(mode), specs, vocab, 6, 7)
    old_out = _run(old, old.Sampler(mode), specs, vocab, 6, 7)
    for a, b in zip(new_out, old_out):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert a.ranks == b.ranks
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            for x, y in zip(a.top_logprobs, b.top_logprobs):
                assert [t for t, _ in x] == [t for t, _ in y]
                assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_takes_the_argmax_of_the_logits_without_a_copy(monkeypatch, dtype):
    logits = (torch.randn(16, 500, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    rows = [SamplingRow(params=SamplingParams(temperature=0.0), prompt_token_ids=[1], output_token_ids=[],
                        key=("r", i)) for i in range(16)]
    copies = []
    real_to = torch.Tensor.to

    def spy(self, *a, **k):
        if self is logits:
            copies.append((a, k))
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    out = Sampler()(logits, rows)
    assert not copies
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    oldrows = [old.SamplingRow(params=r.params, prompt_token_ids=[1], output_token_ids=[], key=r.key) for r in rows]
    monkeypatch.undo()
    assert out.token_ids == old.Sampler()(logits, oldrows).token_ids
