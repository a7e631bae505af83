"""The batched sampler against a brute-force, per-row, loop-based reference.

The reference below is written from the definitions (vLLM's semantics), one token at
a time in float64; the sampler under test is vectorised float32 torch.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridserve.errors import InvalidRequest
from hybridserve.sampler import (
    Sampler,
    SamplingRow,
    SeedStream,
    counter_uniform,
    counter_uniform_reference,
    make_generator,
)
from hybridserve.sampling import SamplingParams

NEG_INF = float("-inf")


# ---------------------------------------------------------------- reference
def ref_process(logits, params, prompt, output, eos=None):
    """Processed logits of one row as a list of float64 (-inf = dropped)."""
    x = [float(v) for v in logits]
    vocab = len(x)
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    if len(output) < params.min_tokens:
        banned = set(params.stop_token_ids)
        if eos is not None and not params.ignore_eos:
            banned.add(eos)
        for t in banned:
            if t < vocab:
                x[t] = NEG_INF
    counts = [0] * vocab
    for t in output:
        counts[t] += 1
    for t in range(vocab):
        if t in prompt or counts[t] > 0:
            if x[t] > 0:
                x[t] = x[t] / params.repetition_penalty
            else:
                x[t] = x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * counts[t]
        if counts[t] > 0:
            x[t] -= params.presence_penalty
    if params.temperature < 1e-5:
        return x
    x = [v / params.temperature for v in x]
    if params.min_p > 0:
        probs = ref_softmax(x)
        top = max(probs)
        x = [NEG_INF if probs[t] < params.min_p * top else x[t] for t in range(vocab)]
    if params.top_k > 0 and params.top_k < vocab:
        kth = sorted(x, reverse=True)[params.top_k - 1]
        x = [v if v >= kth else NEG_INF for v in x]
    if params.top_p < 1.0:
        probs = ref_softmax(x)
        order = sorted(range(vocab), key=lambda t: -probs[t])
        mass = 0.0
        keep = set()
        for t in order:
            if mass < params.top_p:
                keep.add(t)
            mass += probs[t]
        # Ties with the least likely kept token are kept (order-independent).
        last = min(x[t] for t in keep)
        x = [v if v >= last else NEG_INF for v in x]
    return x


def ref_softmax(x):
    m = max(x)
    e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_log_softmax(x):
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x if v != NEG_INF))
    return [v - lse for v in x]


def random_params(rng: random.Random, **overrides) -> SamplingParams:
    kw = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, -1, 1, 3, 10, 100]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.2]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
    )
    kw.update(overrides)
    return SamplingParams(**kw)


def random_rows(rng: random.Random, num: int, vocab: int, **overrides) -> list[SamplingRow]:
    rows = []
    for _ in range(num):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        rows.append(SamplingRow(random_params(rng, **overrides), prompt, output, None))
    return rows


def assert_same_distribution(got: torch.Tensor, ref: list[float], greedy: bool) -> None:
    """Compare processed logits: same dropped set, same probabilities."""
    got_l = got.double().tolist()
    assert [v == NEG_INF for v in got_l] == [v == NEG_INF for v in ref]
    if greedy:
        finite = [(a, b) for a, b in zip(got_l, ref) if b != NEG_INF]
        for a, b in finite:
            assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    else:
        torch.testing.assert_close(
            torch.softmax(got.double(), -1), torch.tensor(ref_softmax(ref), dtype=torch.float64),
            rtol=1e-5, atol=1e-6,
        )


# ---------------------------------------------------------------- processing
@pytest.mark.parametrize(
    "vocab,overrides",
    [
        (7, {}),
        (50, {}),
        # Every row truncated to few tokens first: top_p runs on a top-k of the
        # survivors instead of a full sort.
        (50, {"top_k": 5, "top_p": 0.6, "temperature": 0.9}),
        (50, {"min_p": 0.2, "top_p": 0.8, "temperature": 1.0}),
    ],
)
def test_processed_logits_match_reference(vocab, overrides):
    rng = random.Random(vocab)
    torch.manual_seed(vocab)
    sampler = Sampler()
    for _ in range(40):
        rows = random_rows(rng, 6, vocab, **overrides)
        logits = torch.randn(6, vocab) * 3
        before = logits.clone()
        got = sampler.process(logits, rows)
        assert torch.equal(logits, before), "the sampler must not modify the caller's logits"
        for i, row in enumerate(rows):
            ref = ref_process(logits[i].tolist(), row.params, row.prompt_token_ids, row.output_token_ids)
            assert_same_distribution(got[i], ref, row.params.greedy)


def test_greedy_is_argmax_of_penalised_logits():
    rng = random.Random(1)
    vocab = 40
    rows = random_rows(rng, 16, vocab, temperature=0.0)
    logits = torch.randn(16, vocab)
    out = Sampler()(logits, rows)
    for i, row in enumerate(rows):
        ref = ref_process(logits[i].tolist(), row.params, row.prompt_token_ids, row.output_token_ids)
        assert out.token_ids[i] == max(range(vocab), key=lambda t: ref[t])


def test_top_k_1_equals_greedy():
    rng = random.Random(2)
    vocab = 30
    rows = random_rows(rng, 12, vocab, temperature=0.8, top_k=1, top_p=1.0, min_p=0.0)
    for r in rows:
        r.generator = make_generator(rng.randrange(1000), 0)
    greedy_rows = [
        SamplingRow(SamplingParams(**{**r.params.to_dict(), "temperature": 0.0}),
                    r.prompt_token_ids, r.output_token_ids)
        for r in rows
    ]
    logits = torch.randn(12, vocab)
    assert Sampler()(logits, rows).token_ids == Sampler()(logits, greedy_rows).token_ids


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 2] = 10.0  # EOS would win
    logits[:, 5] = 9.0   # then the stop token
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    p_ign = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    rows = [
        SamplingRow(p, [1], [0], eos_token_id=2),        # 1 < 2 tokens: 2 and 5 banned
        SamplingRow(p, [1], [0, 0], eos_token_id=2),     # reached: EOS allowed
        SamplingRow(p_ign, [1], [0], eos_token_id=2),    # ignore_eos: EOS not banned
    ]
    out = Sampler()(logits, rows).token_ids
    got = Sampler().process(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_process(logits[i].tolist(), r.params, r.prompt_token_ids, r.output_token_ids, eos=2)
        assert out[i] == max(range(vocab), key=lambda t: ref[t])
        assert_same_distribution(got[i], ref, True)
    assert out == [0, 2, 2]


# ---------------------------------------------------------------- distributions
def empirical(tokens: list[int], vocab: int) -> list[float]:
    counts = [0] * vocab
    for t in tokens:
        counts[t] += 1
    return [c / len(tokens) for c in counts]


def assert_frequencies(freq: list[float], probs: list[float], n: int) -> None:
    for f, p in zip(freq, probs):
        if p == 0.0:
            assert f == 0.0, "a dropped token was sampled"
        else:
            # 5 standard deviations: fails only when the distribution is wrong.
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (freq, probs)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.6, top_k=3),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=0.9, min_p=0.15, repetition_penalty=1.4, frequency_penalty=0.2),
    ],
)
def test_unseeded_empirical_frequencies_match_reference(kw):
    torch.manual_seed(7)
    vocab, n = 6, 20000
    base = torch.tensor([1.0, 0.5, 0.0, -0.3, 1.2, -2.0])
    params = SamplingParams(**kw)
    prompt, output = [0, 3], [4, 4, 1]
    rows = [SamplingRow(params, prompt, output, None)] * n
    tokens = Sampler()(base.expand(n, vocab), rows).token_ids
    probs = ref_softmax(ref_process(base.tolist(), params, prompt, output))
    assert_frequencies(empirical(tokens, vocab), probs, n)


def test_seeded_fork_samples_follow_reference_distribution():
    vocab, n = 6, 3000
    base = torch.tensor([[0.2, 1.0, -0.5, 0.7, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8, top_p=0.9, n=n)
    row = SamplingRow(params, [], [], num_samples=n,
                      generators=[make_generator(11, i) for i in range(n)])
    tokens = Sampler()(base, [row]).token_ids
    assert len(tokens) == n
    probs = ref_softmax(ref_process(base[0].tolist(), params, [], []))
    assert_frequencies(empirical(tokens, vocab), probs, n)


# ---------------------------------------------------------------- seeds
def run_steps(seed_rows_first: bool, others: int, steps: int, vocab: int = 64):
    """Decode `steps` tokens of one seeded request inside a batch of `others` other
    requests (seeded and unseeded); return the seeded request's tokens."""
    torch.manual_seed(100 + others)  # the unseeded neighbours' draws differ per run
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.3)
    gen = make_generator(params.seed, 0)
    other_params = [SamplingParams(temperature=1.0, seed=(None if k % 2 else k)) for k in range(others)]
    other_gens = [make_generator(p.seed, 0) for p in other_params]
    mine: list[int] = []
    for step in range(steps):
        # The seeded request's logits depend only on its step, the others' on the run.
        g = torch.Generator().manual_seed(step)
        my_logits = torch.randn(1, vocab, generator=g)
        other_logits = torch.randn(others, vocab)
        rows = [SamplingRow(p, [1, 2], [], gg) for p, gg in zip(other_params, other_gens)]
        me = SamplingRow(params, [1, 2], list(mine), gen)
        if seed_rows_first:
            rows.insert(0, me)
            logits = torch.cat([my_logits, other_logits])
            pos = 0
        else:
            rows.append(me)
            logits = torch.cat([other_logits, my_logits])
            pos = others
        mine.append(Sampler()(logits, rows).token_ids[pos])
    return mine


def test_seeded_tokens_independent_of_batch_composition():
    alone = run_steps(True, 0, 12)
    assert run_steps(True, 3, 12) == alone
    assert run_steps(False, 5, 12) == alone
    assert run_steps(False, 1, 12) == alone
    # Same seed, same logits again from scratch: reproducible.
    assert run_steps(True, 0, 12) == alone


def test_fork_equals_separate_rows_with_same_generators():
    vocab = 50
    logits = torch.randn(1, vocab)
    params = SamplingParams(temperature=1.0, n=4, seed=5)
    fork = SamplingRow(params, [3], [], num_samples=4,
                       generators=[make_generator(5, i) for i in range(4)])
    separate = [SamplingRow(params, [3], [], make_generator(5, i)) for i in range(4)]
    a = Sampler()(logits, [fork]).token_ids
    b = Sampler()(logits.expand(4, vocab), separate).token_ids
    assert a == b
    # The samples are different streams: over 8 steps they do not all coincide.
    gens = [make_generator(5, i) for i in range(4)]
    seqs = [[] for _ in range(4)]
    for _ in range(8):
        lg = torch.zeros(4, vocab)
        toks = Sampler()(lg, [SamplingRow(params, [], [], g) for g in gens]).token_ids
        for s, t in zip(seqs, toks):
            s.append(t)
    assert len({tuple(s) for s in seqs}) == 4


def test_make_generator():
    assert make_generator(None, 0) is None
    # Sample 0's stream is the seed itself; others are hashed apart, reproducibly.
    assert make_generator(42, 0) == SeedStream(42, 0)
    assert make_generator(-1, 0).key == (1 << 64) - 1  # any Python int is a valid seed
    keys = {make_generator(42, 1).key, make_generator(42, 2).key, make_generator(43, 1).key, 42}
    assert len(keys) == 4
    assert make_generator(42, 1) == make_generator(42, 1)
    with pytest.raises(ValueError, match="sample_index"):
        make_generator(1, -1)


def test_counter_uniform_matches_python_reference_and_is_uniform():
    rng = random.Random(9)
    keys = [0, 1, (1 << 64) - 1, 1 << 63] + [rng.getrandbits(64) for _ in range(4)]
    offsets = [0, 5, 1 << 40, 3, 0, 1, 2, 7]
    signed = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]
    u = counter_uniform(torch.tensor(signed), torch.tensor(offsets), 300)
    for r in range(len(keys)):
        for j in (0, 1, 17, 299):
            assert u[r, j].item() == counter_uniform_reference(keys[r], offsets[r], j)
    assert bool(((u > 0) & (u <= 1)).all())
    # Uniform in aggregate (16 bins over 2400 draws: chi-square far below the 0.1% tail).
    counts = torch.bincount((u.flatten() * 16).long().clamp(max=15), minlength=16).double()
    expected = u.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 37.7
    # Rows of different offsets of one key are different draws.
    again = counter_uniform(torch.tensor([7, 7]), torch.tensor([0, 1]), 50)
    assert not torch.equal(again[0], again[1])


# ---------------------------------------------------------------- state across steps
def _step_rows(params, prompts, outputs, streams, keys):
    return [SamplingRow(p, pr, list(o), g, key=k) for p, pr, o, g, k in zip(params, prompts, outputs, streams, keys)]


def test_running_state_matches_a_fresh_sampler_every_step():
    """A long-lived sampler with keyed rows (running penalty counts, parameters and
    stream offsets on the device) against a fresh, stateless sampler per step that
    recounts everything from the rows: the same processed logits and tokens, while
    rows join, leave, change order, and one row's history is rewritten."""
    rng = random.Random(21)
    vocab = 40
    live = Sampler()
    pool = []
    for i in range(8):
        p = random_params(rng, seed=(None if i == 3 else 100 + i), logprobs=(2 if i == 5 else None),
                          logit_bias=({1: 3.0, 7: -2.5} if i % 3 == 0 else None))
        if i == 3:
            p = random_params(rng, temperature=0.0, presence_penalty=0.4)
        pool.append(dict(params=p, prompt=[rng.randrange(vocab) for _ in range(3)], out=[],
                         a=make_generator(p.seed, 0), b=make_generator(p.seed, 0), key=("r", i)))
    active = [0, 1, 2, 3]
    for step in range(14):
        if step == 4:
            active += [4, 5]
        if step == 6:
            live.release(pool[1]["key"])
            active.remove(1)
            active += [6, 7]
        if step == 9:
            pool[2]["out"] = pool[2]["out"][:2]  # a rewritten history must be recounted
        rng.shuffle(active)
        reqs = [pool[i] for i in active]
        logits = torch.randn(len(reqs), vocab) * 2
        live_rows = [SamplingRow(r["params"], r["prompt"], list(r["out"]), r["a"], key=r["key"]) for r in reqs]
        fresh_rows = [SamplingRow(r["params"], r["prompt"], list(r["out"]), r["b"]) for r in reqs]
        # Processed logits first (no draw, no advance), then the draw.
        processed = Sampler().process(logits, fresh_rows)
        assert torch.equal(live.process(logits, live_rows), processed)
        a = live(logits, live_rows)
        b = Sampler()(logits, fresh_rows)
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        for i, r in enumerate(reqs):
            ref = ref_process(logits[i].tolist(), r["params"], r["prompt"], r["out"])
            assert_same_distribution(processed[i], ref, r["params"].greedy)
            r["out"].append(a.token_ids[i])
    # Penalty rows were counted from history once when they joined (and once more for
    # the rewritten one); every other step ran on the device counts.
    pen_rows = [i for i, r in enumerate(pool) if r["params"].has_penalties]
    assert len(pen_rows) >= 3
    assert live.num_recounts == len(pen_rows) + (1 if 2 in pen_rows else 0)
    assert live.num_tracked_rows == 7
    for r in pool:
        live.release(r["key"])
    assert live.num_tracked_rows == 0


def test_seeded_tokens_independent_of_batch_composition_with_a_live_sampler():
    vocab = 64
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.2)

    def run(others_per_step):
        live = Sampler()
        torch.manual_seed(len(others_per_step))
        gen = make_generator(params.seed, 0)
        mine = []
        for step, others in enumerate(others_per_step):
            my_logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(step))
            rows = [SamplingRow(SamplingParams(temperature=1.0, seed=(k if k % 2 else None)), [1], [],
                                make_generator(k if k % 2 else None, 0), key=("o", step, k))
                    for k in range(others)]
            pos = step % (others + 1)
            rows.insert(pos, SamplingRow(params, [1, 2], list(mine), gen, key="me"))
            logits = torch.cat([torch.randn(pos, vocab), my_logits, torch.randn(others - pos, vocab)])
            mine.append(live(logits, rows).token_ids[pos])
            for k in range(others):
                live.release(("o", step, k))
        return mine

    alone = run([0] * 12)
    assert run([3, 0, 5, 1, 2, 7, 0, 0, 4, 1, 1, 2]) == alone
    assert run([1] * 12) == alone


def test_logit_bias_matches_reference_and_is_validated():
    rng = random.Random(13)
    vocab = 30
    rows = random_rows(rng, 6, vocab)
    for i, r in enumerate(rows):
        r.params = SamplingParams(**{**r.params.to_dict(), "logit_bias": {str(i): 5.0, 29: -200, 3: 0.5}})
    assert rows[0].params.logit_bias == {0: 5.0, 29: -100.0, 3: 0.5}  # clamped to +-100
    logits = torch.randn(6, vocab)
    got = Sampler().process(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_process(logits[i].tolist(), r.params, r.prompt_token_ids, r.output_token_ids)
        assert_same_distribution(got[i], ref, r.params.greedy)
    # A large bias makes a greedy row pick the token.
    greedy = SamplingRow(SamplingParams(temperature=0.0, logit_bias={17: 100}), [], [])
    assert Sampler()(torch.randn(1, vocab), [greedy]).token_ids == [17]
    with pytest.raises(ValueError, match="logit_bias token ids contain a token id outside"):
        Sampler()(torch.randn(1, 10), [SamplingRow(SamplingParams(logit_bias={12: 1.0}), [], [])])
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary"):
        SamplingParams(logit_bias={12: 1.0}).check_vocab(10)


def test_one_staging_copy_per_call(monkeypatch):
    from hybridserve import staging

    calls = []
    real = staging.h2d_copy
    monkeypatch.setattr(staging, "h2d_copy", lambda d, s: (calls.append(s.numel()), real(d, s)))
    live = Sampler()
    params = SamplingParams(temperature=0.7, seed=3, frequency_penalty=0.5, logit_bias={2: 1.0}, min_tokens=2)
    outs = [[], []]
    gens = [make_generator(3, 0), make_generator(3, 1)]
    for step in range(4):
        rows = [SamplingRow(params, [1], list(outs[i]), gens[i], key=i, eos_token_id=0) for i in range(2)]
        toks = live(torch.randn(2, 20), rows).token_ids
        for o, t in zip(outs, toks):
            o.append(t)
        assert len(calls) == step + 1
    # After the first step nothing but the per-step row data travels.
    assert calls[-1] < calls[0]


# ---------------------------------------------------------------- logprobs
def test_raw_logprobs_and_top_alternatives():
    rng = random.Random(3)
    vocab = 25
    rows = random_rows(rng, 8, vocab)
    for i, r in enumerate(rows):
        r.params.logprobs = [None, 0, 1, 5, 20, 3, None, 2][i]
    logits = torch.randn(8, vocab) * 2
    out = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_log_softmax(logits[i].double().tolist())
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[tok], abs=1e-5)
        assert out.ranks[i] == 1 + sum(1 for v in ref if v > ref[tok])
        k = r.params.logprobs or 0
        want = sorted(range(vocab), key=lambda t: -ref[t])[:k]
        assert [t for t, _ in out.top_logprobs[i]] == want
        for t, v in out.top_logprobs[i]:
            assert v == pytest.approx(ref[t], abs=1e-5)


def test_processed_logprobs_mode():
    rng = random.Random(4)
    vocab = 20
    rows = random_rows(rng, 6, vocab, logprobs=3)
    logits = torch.randn(6, vocab)
    out = Sampler(logprobs_mode="processed")(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_log_softmax(ref_process(logits[i].tolist(), r.params, r.prompt_token_ids, r.output_token_ids))
        tok = out.token_ids[i]
        assert ref[tok] != NEG_INF, "a dropped token was sampled"
        assert out.logprobs[i] == pytest.approx(ref[tok], abs=1e-5)


def test_no_logprobs_requested_returns_none():
    out = Sampler()(torch.randn(2, 9), [SamplingRow(SamplingParams(), [], [])] * 2)
    assert out.logprobs is None and out.top_logprobs is None and len(out.token_ids) == 2


# ---------------------------------------------------------------- errors
def test_bad_inputs_raise_clear_errors():
    p = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.randn(3, 9), [SamplingRow(p, [], [])])
    with pytest.raises(ValueError, match="prompt_token_ids contain a token id outside"):
        Sampler()(torch.randn(1, 9), [SamplingRow(p, [9], [])])
    with pytest.raises(ValueError, match="one generator \\(or None\\) per sample"):
        Sampler()(torch.randn(1, 9), [SamplingRow(p, [], [], num_samples=2, generators=[None])])
    with pytest.raises(ValueError, match="generators="):
        Sampler()(torch.randn(1, 9), [SamplingRow(p, [], [], make_generator(1, 0), num_samples=2)])
    assert Sampler()(torch.randn(0, 9), []).token_ids == []


def test_exact_boundaries_and_ties_of_min_p_and_top_p():
    # Uniform logits make the boundaries exact in float32: min_p=1 keeps every token
    # tied with the top one. top_p=0.5 over four equal tokens reaches the mass after
    # two tokens, and the other two, tied with the last kept one, are kept as well;
    # with distinct values [2, 2, 1, 1] (bf16-style ties) top_p=0.5 keeps the top pair.
    logits = torch.tensor([[0.0] * 4, [0.0] * 4, [2.0, 2.0, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0]])
    rows = [
        SamplingRow(SamplingParams(min_p=1.0), [], []),
        SamplingRow(SamplingParams(top_p=0.5), [], []),
        SamplingRow(SamplingParams(top_p=0.5), [], []),
        SamplingRow(SamplingParams(top_p=0.9), [], []),
    ]
    got = Sampler().process(logits, rows)
    for i, r in enumerate(rows):
        ref = ref_process(logits[i].tolist(), r.params, [], [])
        assert [v != NEG_INF for v in got[i].tolist()] == [v != NEG_INF for v in ref]
    assert [int(torch.isfinite(g).sum()) for g in got] == [4, 4, 2, 4]


def test_fork_rows_expand_in_order_and_match_reference():
    rng = random.Random(5)
    vocab = 16
    logits = torch.randn(3, vocab, dtype=torch.bfloat16)  # any float dtype is accepted
    rows = [
        SamplingRow(random_params(rng, temperature=0.7), [1, 2], [3], make_generator(1, 0)),
        SamplingRow(random_params(rng, temperature=1.1, n=3), [4], [], num_samples=3,
                    generators=[make_generator(2, i) for i in range(3)]),
        SamplingRow(random_params(rng, temperature=0.0), [], [5, 5], None),
    ]
    got = Sampler().process(logits, rows)
    assert got.shape == (5, vocab) and got.dtype == torch.float32
    for s, i in enumerate([0, 1, 1, 1, 2]):
        r = rows[i]
        ref = ref_process(logits[i].float().tolist(), r.params, r.prompt_token_ids, r.output_token_ids)
        assert_same_distribution(got[s], ref, r.params.greedy)
    out = Sampler()(logits, rows)
    assert len(out.token_ids) == 5
    for s, i in enumerate([0, 1, 1, 1, 2]):
        assert torch.isfinite(got[s, out.token_ids[s]]), "a dropped token was sampled"


def test_truncation_depends_on_values_not_on_order_or_neighbours():
    # bf16-rounded logits have many ties; permuting the vocabulary must permute the
    # kept set, and a row must be cut the same whether its neighbours make the batch
    # take the top-k route or the full-sort route of the nucleus filter.
    torch.manual_seed(3)
    vocab = 64
    logits = (torch.randn(4, vocab) * 2).to(torch.bfloat16).float()
    params = [
        SamplingParams(top_p=0.7),
        SamplingParams(top_p=0.5, top_k=9),
        SamplingParams(top_p=0.9, min_p=0.1),
        SamplingParams(top_p=0.3, top_k=3, temperature=0.5),
    ]
    rows = [SamplingRow(p, [], []) for p in params]
    got = Sampler().process(logits, rows)
    perm = torch.randperm(vocab)
    got_perm = Sampler().process(logits[:, perm], rows)
    assert torch.equal(got_perm, got[:, perm])
    for i, r in enumerate(rows):
        alone = Sampler().process(logits[i : i + 1], [r])
        assert torch.equal(alone[0], got[i])
        ref = ref_process(logits[i].tolist(), r.params, [], [])
        assert [v != NEG_INF for v in got[i].tolist()] == [v != NEG_INF for v in ref]
