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


TOP_K_CASES = ["top_k", "top_p small k", "everything"]


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("with_greedy", [False, True])
def test_top_k_batches_race_only_their_candidates_and_draw_the_same_tokens(monkeypatch, with_greedy, sliced):
    """Every sampled row has a small top_k: the draw works on the candidates only
    (draw.race_top_k; ``sliced``: one row block at a time), and still gives the old
    sampler's seeded tokens."""
    import hybridserve.sampler.batch_sampler as bs

    if sliced:
        monkeypatch.setattr(processors, "SLICE_BYTES", 1)

    decided = []
    real = bs.race_top_k

    def spy(*a, **k):
        out = real(*a, **k)
        decided.append(out is not None)
        return out

    monkeypatch.setattr(bs, "race_top_k", spy)
    specs = []
    for c, name in enumerate(TOP_K_CASES):
        specs.append((SamplingParams(seed=300 + c, max_tokens=64, **CASES[name]), 1))
        specs.append((SamplingParams(seed=400 + c, max_tokens=64, n=3, **CASES[name]), 3))
    specs.append((SamplingParams(seed=500, max_tokens=64, temperature=0.7, top_k=60, top_p=0.5, logprobs=2), 1))
    if with_greedy:
        specs.append((SamplingParams(max_tokens=64, temperature=0.0, repetition_penalty=1.2), 1))
    new_out = _run(new, Sampler(), specs, 300, 8, 11)
    old_out = _run(old, old.Sampler(), specs, 300, 8, 11)
    assert decided and all(decided)
    for a, b in zip(new_out, old_out):
        assert a.token_ids == b.token_ids
        assert a.ranks == b.ranks
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_tie_with_the_kth_logit_past_the_list_falls_back_to_the_whole_row():
    """Logits with long runs of equal values: the k-th value's ties reach past the
    top_k + 1 list, so the candidates cannot decide and the whole-row stages run;
    the tokens are still the old sampler's."""
    vocab, rows = 200, 6
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(seed=900 + i, top_k=5 + i, top_p=0.95, temperature=1.0) for i in range(rows)]
    for step in range(6):
        # Values on a coarse grid: many exact ties everywhere.
        logits = torch.randint(0, 6, (rows, vocab), generator=g).float()
        got, want = [], []
        for mod, sampler, out in ((new, Sampler(), got), (old, old.Sampler(), want)):
            rs = [mod.SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[],
                                  generator=mod.make_generator(p.seed, 0), key=i) for i, p in enumerate(params)]
            for _ in range(step):
                for r in rs:
                    r.generator.offset += 1
            out.extend(sampler(logits, rs).token_ids)
        assert got == want


@pytest.mark.parametrize("scale", [0.05, 0.5, 4.0])
def test_top_p_without_a_small_top_k_needs_no_full_sort(monkeypatch, scale):
    """Top-p rows without a small top_k over a 5,000-token vocabulary: the nucleus
    comes from a partial top-K (grown while some row's K tokens hold less than its
    p; the flat rows at scale 0.05 need most of the vocabulary), never a sort,
    and the processed logits (the kept sets) and the seeded tokens are exactly those
    of the old sampler, which sorts every row."""
    vocab, n = 5000, 8
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(n, vocab, generator=g) * scale
    logits[0] *= 40  # one peaked row among flat ones
    params = [SamplingParams(seed=700 + i, top_p=0.5 + 0.06 * i, temperature=0.9) for i in range(n)]

    def rows(mod):
        return [mod.SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[],
                                generator=mod.make_generator(p.seed, 0), key=i) for i, p in enumerate(params)]

    want = old.Sampler().process(logits, rows(old))
    want_tokens = old.Sampler()(logits, rows(old)).token_ids
    ks = []
    real_topk, real_sort = torch.topk, torch.Tensor.sort

    def topk(x, k, *a, **kw):
        ks.append(k)
        return real_topk(x, k, *a, **kw)

    def no_sort(self, *a, **kw):
        raise AssertionError("a full sort of the rows")

    monkeypatch.setattr(torch, "topk", topk)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    got = Sampler().process(logits, rows(new))
    ks_process = list(ks)
    got_tokens = Sampler()(logits, rows(new)).token_ids
    monkeypatch.undo()
    ks = ks_process
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert got_tokens == want_tokens
    # The list grows (8x) only as far as the longest nucleus needs: never to the
    # whole row unless some nucleus is longer than the last K below it.
    longest = int(torch.isfinite(want).sum(dim=-1).max())
    assert ks[0] == 256 and ks == sorted(ks)
    assert max(ks) == min(vocab, 256 * 8 ** (len(ks) - 1))
    assert len(ks) == 1 or ks[-2] < longest
    if longest < 2048:
        assert max(ks) < vocab, (ks, longest)


def test_fork_row_raw_logprobs_make_no_samples_by_vocab_copy(monkeypatch):
    """A greedy fork row (n = 3 samples of one logits row) asking for raw logprobs:
    the logprobs read the logits row itself (no [samples, vocab] gather of the
    logits), and equal the old sampler's."""
    logits = torch.randn(2, 400, generator=torch.Generator().manual_seed(5)) * 3
    p = SamplingParams(temperature=0.0, n=3, logprobs=4)

    def rows(mod):
        return [mod.SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[], num_samples=3,
                                keys=[(0, j) for j in range(3)]),
                mod.SamplingRow(params=SamplingParams(temperature=0.0, logprobs=2), prompt_token_ids=[1],
                                output_token_ids=[], key=1)]

    gathers = []
    real = torch.Tensor.index_select

    def spy(self, dim, index, *a, **k):
        if self is logits:
            gathers.append(tuple(index.shape))
        return real(self, dim, index, *a, **k)

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    got = Sampler()(logits, rows(new))
    monkeypatch.undo()
    want = old.Sampler()(logits, rows(old))
    assert gathers == []
    assert got.token_ids == want.token_ids and got.ranks == want.ranks
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert [[t for t, _ in x] for x in got.top_logprobs] == [[t for t, _ in x] for x in want.top_logprobs]


def test_penalty_rows_in_any_order_read_their_own_counts(monkeypatch):
    """Penalty rows whose count-table rows are consecutive read a slice of the tables,
    others a gather (``Prepared.pen_span``); the rows here come in a new order every
    other step (the engine's batch order changes as requests come and go), so both
    routes run, and every step's seeded tokens are the old sampler's."""
    import hybridserve.sampler.processors as procs

    routes = []
    real = procs.apply_penalties

    def spy(x, prep, t, fp):
        routes.append(prep.pen_span is not None)
        return real(x, prep, t, fp)

    monkeypatch.setattr(procs, "apply_penalties", spy)
    vocab, n = 300, 12
    params = [SamplingParams(seed=40 + i, temperature=0.9, top_k=30, top_p=0.9, repetition_penalty=1.3,
                             frequency_penalty=0.25, presence_penalty=-0.2) for i in range(n)]
    g = torch.Generator().manual_seed(4)
    prompts = [[random.Random(i).randrange(vocab) for _ in range(10)] for i in range(n)]
    got_state = {"new": ([[] for _ in range(n)], [make_generator(p.seed, 0) for p in params], Sampler()),
                 "old": ([[] for _ in range(n)], [old.make_generator(p.seed, 0) for p in params], old.Sampler())}
    for step in range(8):
        order = list(range(n)) if step % 2 == 0 else list(random.Random(step).sample(range(n), n))
        logits = torch.randn(n, vocab, generator=g) * 3
        tokens = {}
        for name, mod in (("new", new), ("old", old)):
            outs, streams, sampler = got_state[name]
            rows = [mod.SamplingRow(params=params[i], prompt_token_ids=prompts[i], output_token_ids=outs[i],
                                    generator=streams[i], key=i) for i in order]
            tokens[name] = sampler(logits, rows).token_ids
            for i, tok in zip(order, tokens[name]):
                outs[i].append(tok)
        assert tokens["new"] == tokens["old"], step
    assert True in routes and False in routes


def test_a_steady_batch_reuses_its_plan_and_any_change_is_seen(monkeypatch):
    """The same row objects step after step reuse the last call's row lists
    (``RowTables._plan_steady``); a stream moved by the caller, a rewritten history,
    new parameters, a released row or a new order must each be noticed. Every step's
    tokens are the old sampler's (which prepares every row from scratch)."""
    import hybridserve.sampler.rows as rows_mod

    reused = []
    real = rows_mod.RowTables._plan_steady

    def spy(self, rows):
        out = real(self, rows)
        reused.append(out is not None)
        return out

    monkeypatch.setattr(rows_mod.RowTables, "_plan_steady", spy)
    vocab, n = 300, 10
    kinds = [dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.2,
                  presence_penalty=0.1), dict(temperature=0.0), dict(temperature=1.0, min_tokens=2, stop_token_ids=[7]),
             dict(temperature=0.7, logit_bias={5: 2.0})]
    params = [SamplingParams(seed=60 + i, **kinds[i % len(kinds)]) for i in range(n)]
    g = torch.Generator().manual_seed(9)
    prompts = [[random.Random(i).randrange(vocab) for _ in range(6)] for i in range(n)]
    sides = {}
    for name, mod in (("new", new), ("old", old)):
        outs = [[] for _ in range(n)]
        streams = [mod.make_generator(p.seed, 0) for p in params]
        rows = [mod.SamplingRow(params=params[i], prompt_token_ids=prompts[i], output_token_ids=outs[i],
                                generator=streams[i], key=("r", i), eos_token_id=2) for i in range(n)]
        sides[name] = (mod, rows, outs, streams, Sampler() if name == "new" else old.Sampler())
    for step in range(12):
        logits = torch.randn(n, vocab, generator=g) * 3
        tokens = {}
        for name, (mod, rows, outs, streams, sampler) in sides.items():
            if step == 4:
                streams[0].offset += 3  # the caller moved a stream
            if step == 6:
                outs[0][-1] = (outs[0][-1] + 1) % vocab  # a rewritten history, same length
            if step == 7:
                rows[1].params = SamplingParams(seed=99, temperature=0.9, top_k=20, presence_penalty=0.5)
            if step == 8:
                sampler.release(("r", 2))
            if step == 9:
                rows.reverse()
            tokens[name] = sampler(logits, rows).token_ids
            for r, tok in zip(rows, tokens[name]):
                r.output_token_ids.append(tok)
        assert tokens["new"] == tokens["old"], step
    # Reused on a quiet step that follows a step which rebuilt nothing (min_tokens'
    # bans are over after step 1; steps 4-9 each change something), never on a step
    # with a change.
    assert all(reused[s] for s in (3, 10, 11)), reused
    assert not any(reused[s] for s in (0, 1, 2, 4, 5, 6, 7, 8, 9)), reused
