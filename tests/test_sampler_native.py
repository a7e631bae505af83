"""The native CPU draw (``Sampler(native=True)``, one kernel call per step) against the
torch sampler (``Sampler()``, the oracle): for random batches mixing greedy, seeded
and unseeded rows, every processor alone and together, ties, vocabularies that are
not a multiple of 16, temperature edges and n > 1 fork rows, with running state over
several steps, the seeded and greedy tokens are the torch path's, unseeded tokens lie
in the kept set, and the processed logits agree; the steady-batch route (the engine's
``steady_rows``) does no per-row host work and still draws the same tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve.sampler import Sampler, SamplingRow, make_generator
from hybridserve.sampling import SamplingParams

PROCESSORS = {
    "greedy": dict(temperature=0.0),
    "greedy+penalties+bias": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                                  presence_penalty=0.2, logit_bias={3: 5.0, 7: -2.0}),
    "temperature": dict(temperature=0.8),
    "hot": dict(temperature=2.5),
    "near-greedy temperature": dict(temperature=2e-5),
    "top_k": dict(temperature=1.1, top_k=20),
    "top_k 1": dict(temperature=0.9, top_k=1),
    "top_p small k": dict(temperature=0.9, top_p=0.7, top_k=40),
    "top_p alone": dict(temperature=0.9, top_p=0.8),
    "top_p tiny": dict(temperature=1.0, top_p=0.05),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "repetition": dict(temperature=0.7, repetition_penalty=1.5),
    "frequency/presence": dict(temperature=0.7, frequency_penalty=0.6, presence_penalty=-0.4),
    "bias": dict(temperature=0.7, logit_bias={1: 4.0, 9: -100.0, 12: 2.5}),
    "min_tokens": dict(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
    "everything": dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.3, logit_bias={11: 3.0}, min_tokens=3,
                       stop_token_ids=[5]),
}


def random_specs(rng: random.Random, num: int) -> list[tuple[SamplingParams, int, bool]]:
    """(params, n, seeded) per request: mostly seeded, some unseeded, some forks."""
    names = list(PROCESSORS)
    specs = []
    for i in range(num):
        kw = dict(PROCESSORS[rng.choice(names)])
        if rng.random() < 0.3:  # a second processor on top
            extra = PROCESSORS[rng.choice(names)]
            kw.update({k: v for k, v in extra.items() if k != "temperature"})
        n = 2 if rng.random() < 0.2 else 1
        seeded = rng.random() < 0.8
        specs.append((SamplingParams(seed=rng.randrange(1 << 40) if seeded else None, n=n, max_tokens=64, **kw),
                      n, seeded))
    return specs


class Side:
    """One sampler stepping a batch of requests (fork rows at the first step)."""

    def __init__(self, sampler: Sampler, specs, prompts) -> None:
        self.sampler, self.specs, self.prompts = sampler, specs, prompts
        self.streams = {i: [make_generator(p.seed, j) for j in range(n)] for i, (p, n, _) in enumerate(specs)}
        self.forked = False

    def rows(self, outputs) -> list[SamplingRow]:
        rows = []
        for i, (p, n, _) in enumerate(self.specs):
            if n > 1 and not self.forked:
                rows.append(SamplingRow(params=p, prompt_token_ids=self.prompts[i], output_token_ids=[],
                                        num_samples=n, generators=self.streams[i],
                                        keys=[(i, j) for j in range(n)], eos_token_id=2))
            else:
                for j in range(n):
                    rows.append(SamplingRow(params=p, prompt_token_ids=self.prompts[i],
                                            output_token_ids=outputs[i][j], generator=self.streams[i][j],
                                            key=(i, j), eos_token_id=2))
        return rows


def logits_for(g: torch.Generator, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    if ties:  # values on a coarse grid: many exact ties, at the k-th and in the nucleus
        return torch.randint(0, 6, (rows, vocab), generator=g).float()
    return torch.randn(rows, vocab, generator=g) * 3


@pytest.mark.parametrize("case", range(24))
def test_native_draws_the_torch_paths_tokens_for_random_batches(case):
    rng = random.Random(case)
    vocab = rng.choice([37, 272, 300, 1000, 5003])
    ties = case % 4 == 3
    specs = random_specs(rng, rng.randint(1, 12))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in specs]
    outputs = {i: [[] for _ in range(n)] for i, (_, n, _) in enumerate(specs)}
    torch_side = Side(Sampler(), specs, prompts)
    native_side = Side(Sampler(native=True), specs, prompts)
    g = torch.Generator().manual_seed(case)
    for step in range(5):
        rows_t, rows_n = torch_side.rows(outputs), native_side.rows(outputs)
        logits = logits_for(g, len(rows_t), vocab, ties)
        processed = Sampler().process(logits, torch_side.rows(outputs))
        got = native_side.sampler(logits, rows_n).token_ids
        want = torch_side.sampler(logits, rows_t).token_ids
        k = 0
        for i, (p, n, seeded) in enumerate(specs):
            for j in range(n):
                if seeded or p.temperature == 0.0:
                    assert got[k] == want[k], (case, step, i, j, p)
                else:
                    # Unseeded: its own noise, but only a token the processors keep.
                    assert torch.isfinite(processed[k, got[k]]) or not torch.isfinite(processed[k]).any(), \
                        (case, step, i, j)
                outputs[i][j].append(got[k])
                k += 1
        torch_side.forked = native_side.forked = True


@pytest.mark.parametrize("vocab", [37, 300, 5003])
@pytest.mark.parametrize("ties", [False, True])
def test_processed_logits_match_the_torch_path(vocab, ties):
    rng = random.Random(vocab)
    g = torch.Generator().manual_seed(vocab + ties)
    for name, kw in PROCESSORS.items():
        params = [SamplingParams(seed=7, **kw), SamplingParams(seed=8, **kw)]
        prompts = [[rng.randrange(vocab) for _ in range(10)] for _ in params]
        outs = [[rng.randrange(vocab) for _ in range(6)], []]
        logits = logits_for(g, 2, vocab, ties)

        def rows():
            return [SamplingRow(params=p, prompt_token_ids=pr, output_token_ids=o, key=i, eos_token_id=2,
                                generator=make_generator(p.seed, 0)) for i, (p, pr, o) in
                    enumerate(zip(params, prompts, outs))]

        want = Sampler().process(logits, rows())
        got = Sampler(native=True).process(logits, rows())
        assert torch.equal(torch.isinf(got), torch.isinf(want)), name
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6, msg=name)
        # And the probabilities they give.
        torch.testing.assert_close(torch.softmax(got, -1), torch.softmax(want, -1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_reads_every_logits_dtype_as_the_torch_path(dtype):
    vocab = 300
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    params = [SamplingParams(seed=50 + i, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2)
              for i in range(5)] + [SamplingParams(temperature=0.0, presence_penalty=0.5)]

    def rows():
        return [SamplingRow(params=p, prompt_token_ids=[1, 2, 3], output_token_ids=[4], key=i,
                            generator=make_generator(p.seed, 0)) for i, p in enumerate(params)]

    assert Sampler(native=True)(logits, rows()).token_ids == Sampler()(logits, rows()).token_ids
    # A non-contiguous (column-strided) view too.
    wide = torch.randn(6, 2 * vocab, generator=torch.Generator().manual_seed(3)).to(dtype)[:, ::2]
    assert Sampler(native=True)(wide, rows()).token_ids == Sampler()(wide, rows()).token_ids


def test_a_seed_draws_the_same_tokens_alone_and_in_a_mixed_batch():
    vocab = 272
    p = SamplingParams(seed=1234, temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.3,
                       frequency_penalty=0.2, repetition_penalty=1.1)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(seed=5, temperature=1.3, min_p=0.1)]
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, vocab, generator=g) * 2
    alone_s, mixed_s = Sampler(native=True), Sampler(native=True)
    alone_out, mixed_out = [], []
    gen_a, gen_m = make_generator(p.seed, 0), make_generator(p.seed, 0)
    other_gens = [make_generator(o.seed, 0) for o in others]
    for step in range(8):
        row = base[step : step + 1]
        a = alone_s(row, [SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=alone_out,
                                      generator=gen_a, key="x")]).token_ids[0]
        mixed_rows = [SamplingRow(params=o, prompt_token_ids=[1], output_token_ids=[], generator=gg, key=k)
                      for k, (o, gg) in enumerate(zip(others, other_gens))]
        mixed_rows.insert(step % 4, SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=mixed_out,
                                                generator=gen_m, key="x"))
        logits = torch.randn(4, vocab, generator=g) * 2
        logits[step % 4] = row[0]
        m = mixed_s(logits, mixed_rows).token_ids[step % 4]
        assert a == m, step
        alone_out.append(a)
        mixed_out.append(m)


def test_bad_parameters_give_the_torch_paths_errors():
    vocab = 50
    logits = torch.randn(1, vocab)
    bad = [
        (logits, [SamplingRow(params=SamplingParams(logit_bias={vocab + 3: 1.0}), prompt_token_ids=[1],
                              output_token_ids=[])]),
        (logits, [SamplingRow(params=SamplingParams(repetition_penalty=1.2), prompt_token_ids=[vocab],
                              output_token_ids=[])]),
        (torch.randn(2, vocab), [SamplingRow(params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[])]),
        (logits, [SamplingRow(params=SamplingParams(n=2, seed=1), prompt_token_ids=[1], output_token_ids=[],
                              num_samples=2, generator=make_generator(1, 0))]),
    ]
    for lg, rows in bad:
        with pytest.raises(ValueError) as want:
            Sampler()(lg, rows)
        with pytest.raises(ValueError) as got:
            Sampler(native=True)(lg, rows)
        assert str(got.value) == str(want.value)
    # The kernel's own checks: an index out of range is a ValueError that says which.
    from hybridserve._core import kernels

    z = np.zeros
    with pytest.raises(ValueError, match="slot 3 is outside 0..1"):
        kernels.sample_rows(z((1, vocab), np.float32), z(1, np.int64), np.array([3]), z(1, np.uint8),
                            np.array([-1]), z(1, np.uint8), z(0, np.int64), z(0, np.int64), 0,
                            z((1, 6), np.float32), z((1, 3), np.int64), z((0, vocab), np.float32),
                            z((0, vocab), np.uint8), z((1, 0), np.int64), z((1, 0), np.float32),
                            z(1, np.int64))


def test_steady_rows_reuse_the_plan_without_per_row_work_and_draw_the_same_tokens(plan_sizes):
    """The engine's contract: the same list object again = the same rows, each grown by
    its drawn token. Such steps must not plan (no per-row host work); a new list (the
    batch changed) and a released row are noticed; every step's tokens are the torch
    sampler's, which plans every row every step (fresh lists)."""
    plans = plan_sizes
    vocab, n = 272, 16
    kinds = [dict(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.3, frequency_penalty=0.2,
                  repetition_penalty=1.1), dict(temperature=0.0, repetition_penalty=1.3),
             dict(temperature=1.0, min_p=0.05), dict(temperature=0.7, logit_bias={5: 2.0}, top_p=0.6)]
    params = [SamplingParams(seed=60 + i, **kinds[i % len(kinds)]) for i in range(n)]
    prompts = [[random.Random(i).randrange(vocab) for _ in range(30)] for i in range(n)]
    outs = [[] for _ in range(n)]
    live = list(range(n))
    steady = Sampler(native=True, steady_rows=True)
    oracle = Sampler()
    streams = {"s": [make_generator(p.seed, 0) for p in params], "o": [make_generator(p.seed, 0) for p in params]}
    g = torch.Generator().manual_seed(1)
    rows_s = None
    steady_steps = 0
    for step in range(14):
        if step == 6:
            steady.release(("r", 3))  # a request finished: the engine makes a new list
            oracle.release(("r", 3))
            live.remove(3)
            rows_s = None
        if step == 10:
            live.reverse()  # a new batch order
            rows_s = None
        if rows_s is None:
            rows_s = [SamplingRow(params=params[i], prompt_token_ids=prompts[i], output_token_ids=outs[i],
                                  generator=streams["s"][i], key=("r", i)) for i in live]
        rows_o = [SamplingRow(params=params[i], prompt_token_ids=prompts[i], output_token_ids=list(outs[i]),
                              generator=streams["o"][i], key=("r", i)) for i in live]
        logits = torch.randn(len(live), vocab, generator=g) * 3
        before = len(plans)
        prep = steady.plan(rows_s, vocab, torch.device("cpu"))
        planned = len(plans) > before
        steady_steps += prep.segments is None  # nothing to stage: the reused plan
        got = steady.sample_planned(logits, prep).token_ids
        want = oracle(logits, rows_o).token_ids
        assert got == want, step
        for i, tok in zip(live, got):
            outs[i].append(tok)
        # The first step of each list plans; the next ones reuse it.
        assert planned == (step in (0, 6, 10)), (step, planned)
        if step == 0:
            built = steady.num_recounts
    # The settled records match the counts: a new list recounts no history.
    assert steady.num_recounts == built == sum(1 for p in params if p.has_penalties)
    assert steady_steps == 14 - 3
    # Settled host records: a later ordinary call sees every stream where it is.
    steady.release(("r", 0))
    assert [streams["s"][i].offset for i in live] == [streams["o"][i].offset for i in live]


def test_a_tie_of_the_race_goes_to_the_lowest_token_id():
    """A flat row whose seeded noise has its largest uniform at two columns (seed 1764
    at this vocabulary, checked here): the two scores are equal, and both paths give
    the lower column, the torch path's rule."""
    from hybridserve.sampler import counter_uniform
    from hybridserve.sampler.streams import signed64

    vocab, seed = 20000, 1764
    u = counter_uniform(torch.tensor([signed64(make_generator(seed, 0).key)]), torch.zeros(1, dtype=torch.int64),
                        vocab)[0]
    tied = torch.nonzero(u == u.max()).flatten().tolist()
    assert len(tied) == 2
    logits = torch.zeros(1, vocab)
    for kw in (dict(temperature=1.0), dict(temperature=1.0, top_k=vocab - 1), dict(temperature=0.5, top_p=0.99999)):
        p = SamplingParams(seed=seed, **kw)

        def rows():
            return [SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[], key=0,
                                generator=make_generator(seed, 0))]

        want = Sampler()(logits, rows()).token_ids
        assert want == [tied[0]], kw
        assert Sampler(native=True)(logits, rows()).token_ids == want, kw


def test_greedy_rows_follow_the_argmax_rules_nan_and_ties_included():
    """A greedy row's token is the first maximum, a NaN counting as the maximum (the
    torch path's numpy argmax), with and without processors in the batch."""
    vocab = 40
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4))
    logits[0, 7] = logits[0, 30] = float("nan")
    logits[1, :] = 2.0  # all tied
    logits[2, 3] = logits[2, 9] = 50.0
    logits[3, :] = float("-inf")
    logits[4, 11] = float("inf")
    for kw in (dict(temperature=0.0), dict(temperature=0.0, presence_penalty=0.5)):
        rows = [SamplingRow(params=SamplingParams(**kw), prompt_token_ids=[1], output_token_ids=[], key=i)
                for i in range(5)]
        want = Sampler()(logits, rows).token_ids
        assert want[:4] == [7, 0, 3, 0]
        assert Sampler(native=True)(logits, rows).token_ids == want, kw
