"""Constrained decoding's token mask fused into the native draw
(``Sampler.fuse_token_mask``) against the unfused path, the oracle: the same masks
applied to the logits first (by plain torch ops from the bits), then the torch sampler.
Random batches mixing plain greedy, greedy with bias and penalties, seeded, unseeded,
min_tokens bans and n > 1 fork rows, some rows unconstrained, masks of every word
shape (empty, full, single tokens, sparse), a mask vocabulary narrower than the
logits, several steps of running state through the engine's steady-plan route: the
same tokens (unseeded ones in the allowed set), and the logits are left unmasked.
Rows that ask for logprobs are not fused (they are computed from the masked logits):
the caller applies the mask and the logprobs are the oracle's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve.sampler import Sampler, SamplingRow, make_generator
from hybridserve.sampling import SamplingParams
from hybridserve.structured.engine_hook import apply_bitmask

KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
         logit_bias={3: 5.0, 7: -2.0}),
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=20),
    dict(temperature=0.9, top_p=0.7),
    dict(temperature=1.0, min_p=0.05, logit_bias={1: 4.0}),
    dict(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.2, frequency_penalty=0.3,
         presence_penalty=0.3, min_tokens=2, stop_token_ids=[5]),
]


def random_bitmask(rng: random.Random, rows: int, vocab: int) -> torch.Tensor:
    """int32 ``[rows, words]`` in xgrammar's layout, every word shape present."""
    words = (vocab + 31) // 32
    out = np.zeros((rows, words), dtype=np.int64)
    for r in range(rows):
        style = rng.choice(["sparse", "sparse", "dense", "one", "none"])
        for w in range(words):
            if style == "sparse":
                v = rng.choice([0, 0, 0, 0, -1, 1 << rng.randrange(32), rng.getrandbits(32)])
            elif style == "dense":
                v = rng.choice([-1, -1, rng.getrandbits(32)])
            else:
                v = 0
            out[r, w] = v
        if style == "one":
            t = rng.randrange(vocab)
            out[r, t // 32] = 1 << (t % 32)
    return torch.from_numpy(((out + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32))


def masked_by_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> torch.Tensor:
    """The oracle's mask: bits unpacked with torch ops, disallowed logits -inf."""
    out = logits.clone()
    shifts = torch.arange(32, dtype=torch.int64)
    for r in rows:
        bits = ((bitmask[r].to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(-1)[:vocab].bool()
        out[r, :vocab] = out[r, :vocab].masked_fill(~bits, float("-inf"))
    return out


def make_rows(specs, prompts, outputs, streams, forked):
    rows = []
    for i, (p, n) in enumerate(specs):
        if n > 1 and not forked:
            rows.append(SamplingRow(params=p, prompt_token_ids=prompts[i], output_token_ids=[], num_samples=n,
                                    generators=streams[i], keys=[(i, j) for j in range(n)], eos_token_id=5))
        else:
            for j in range(n):
                rows.append(SamplingRow(params=p, prompt_token_ids=prompts[i], output_token_ids=outputs[i][j],
                                        generator=streams[i][j], key=(i, j), eos_token_id=5))
    return rows


@pytest.mark.parametrize("case", range(16))
def test_fused_mask_draws_the_tokens_of_masking_first(case):
    rng = random.Random(case)
    vocab = rng.choice([40, 272, 1000, 5003])
    mask_vocab = vocab - rng.choice([0, 0, 3])  # padded logits columns stay unmasked
    ties = case % 4 == 3
    dtype = torch.bfloat16 if case % 5 == 4 else torch.float32
    specs = []
    for _ in range(rng.randint(1, 10)):
        kw = dict(rng.choice(KINDS))
        seeded = kw["temperature"] == 0.0 or rng.random() < 0.8
        specs.append((SamplingParams(seed=rng.randrange(1 << 40) if seeded else None, max_tokens=64, **kw),
                      2 if rng.random() < 0.2 else 1))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in specs]
    outputs = {i: [[] for _ in range(n)] for i, (_, n) in enumerate(specs)}
    streams = {s: {i: [make_generator(p.seed, j) for j in range(n)] for i, (p, n) in enumerate(specs)}
               for s in ("fused", "oracle")}
    fused, oracle = Sampler(native=True, steady_rows=True), Sampler()
    g = torch.Generator().manual_seed(case)
    rows_f = None
    fused_steps = 0
    for step in range(5):
        forked = step > 0
        if rows_f is None or step == 1:  # the fork step's list, then one list kept (steady)
            rows_f = make_rows(specs, prompts, outputs, streams["fused"], forked)
        rows_o = make_rows(specs, prompts, {i: [list(o) for o in v] for i, v in outputs.items()},
                           streams["oracle"], forked)
        n_rows = len(rows_o)
        logits = (torch.randint(0, 5, (n_rows, vocab), generator=g).float() if ties
                  else torch.randn(n_rows, vocab, generator=g) * 3).to(dtype)
        bitmask = random_bitmask(rng, n_rows + rng.randint(0, 3), mask_vocab)
        rows = sorted(rng.sample(range(n_rows), rng.randint(0, n_rows)))
        before = logits.clone()
        prep = fused.plan(rows_f, vocab, torch.device("cpu"))
        took = fused.fuse_token_mask(logits, bitmask, rows, mask_vocab)
        assert took, "a native draw without logprobs takes the mask"
        fused_steps += 1
        got = fused.sample_planned(logits, prep).token_ids
        bits_dtype = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(logits.view(bits_dtype), before.view(bits_dtype)), "the fused draw does not write the logits"
        masked = masked_by_torch(logits.float(), bitmask, rows, mask_vocab).to(dtype)
        want = oracle(masked, rows_o).token_ids
        no_streams = {i: [None] * n for i, (_, n) in enumerate(specs)}
        processed = Sampler().process(masked, make_rows(specs, prompts, outputs, no_streams, forked))
        k = 0
        for i, (p, n) in enumerate(specs):
            for j in range(n):
                if p.seed is not None:
                    assert got[k] == want[k], (case, step, i, j, p)
                else:
                    # Unseeded: its own noise, but a token the mask and processors keep.
                    assert torch.isfinite(processed[k, got[k]]) or not torch.isfinite(processed[k]).any(), \
                        (case, step, i, j)
                outputs[i][j].append(got[k])
                k += 1
    assert fused_steps == 5


def test_rows_asking_for_logprobs_are_masked_by_the_caller_and_get_the_oracles_logprobs():
    vocab = 300
    rng = random.Random(3)
    params = [SamplingParams(seed=1, temperature=0.8, logprobs=3), SamplingParams(temperature=0.0)]
    prompts = [[1, 2, 3], [4, 5]]
    rows = [SamplingRow(params=p, prompt_token_ids=pr, output_token_ids=[], generator=make_generator(p.seed, 0),
                        key=i) for i, (p, pr) in enumerate(zip(params, prompts))]
    rows_o = [SamplingRow(params=p, prompt_token_ids=pr, output_token_ids=[], generator=make_generator(p.seed, 0),
                          key=i) for i, (p, pr) in enumerate(zip(params, prompts))]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = random_bitmask(rng, 2, vocab)
    bitmask[0, 0] = -1  # something allowed in each row
    bitmask[1, 0] = -1
    fused = Sampler(native=True, steady_rows=True)
    prep = fused.plan(rows, vocab, torch.device("cpu"))
    assert not fused.fuse_token_mask(logits, bitmask, [0, 1], vocab)
    apply_bitmask(logits, bitmask, [0, 1], vocab)  # what the engine then does
    got = fused.sample_planned(logits, prep)
    want = Sampler()(masked_by_torch(logits, bitmask, [0, 1], vocab), rows_o)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs and got.ranks == want.ranks and got.top_logprobs == want.top_logprobs


def test_the_torch_sampler_refuses_the_mask_and_an_unplanned_offer_is_refused():
    logits = torch.randn(1, 64)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)
    rows = [SamplingRow(params=SamplingParams(temperature=0.0), prompt_token_ids=[1], output_token_ids=[], key=0)]
    torch_sampler = Sampler()
    prep = torch_sampler.plan(rows, 64, torch.device("cpu"))
    assert not torch_sampler.fuse_token_mask(logits, bitmask, [0], 64)
    torch_sampler.discard(prep)
    assert not Sampler(native=True).fuse_token_mask(logits, bitmask, [0], 64)  # nothing planned


def test_a_mask_offered_for_other_logits_is_applied_to_them():
    vocab = 64
    rows = [SamplingRow(params=SamplingParams(temperature=0.0), prompt_token_ids=[1], output_token_ids=[], key=0)]
    s = Sampler(native=True)
    prep = s.plan(rows, vocab, torch.device("cpu"))
    offered = torch.zeros(1, vocab)
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    assert s.fuse_token_mask(offered, bitmask, [0], vocab)
    other = torch.zeros(1, vocab)
    other[0, 7] = 1.0
    assert s.sample_planned(other, prep).token_ids == [7]  # drawn unmasked
    assert torch.isinf(offered[0]).sum() == vocab - 1 and offered[0, 35] == 0.0


def test_the_engine_fuses_its_masks_and_generates_what_applying_them_generates(tmp_path):
    """Through the engine (tiny model, a JSON schema): the steps' masks go into the
    sampler's draw (counted), and greedy, seeded and n=2 outputs, with penalties, are
    token for token those of the same engine applying the masks to the logits first;
    a request asking for logprobs gets them from the masked logits either way."""
    import json

    from hybridserve import LLM
    from hybridserve.model.tiny import write_tiny_checkpoint

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    d = write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=5, qwen_chat=True)
    llm = LLM(d, dtype="float32", device="cpu", num_pages=96, max_num_seqs=6, max_model_len=512)
    sd = llm.engine.structured_decoding()
    sampler = sd.sampler
    assert sampler is not None, "the engine's sampler is handed to the structured decoding"
    prompts = ["A record:", "Another", "x" * 30]

    def params():
        return [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"json": schema}),
                SamplingParams(max_tokens=40, temperature=1.0, seed=3, presence_penalty=0.5,
                               structured_outputs={"json": schema}),
                SamplingParams(max_tokens=40, temperature=0.8, seed=4, n=2, top_p=0.9,
                               structured_outputs={"json": schema})]

    def with_logprobs():  # no step of it can fuse: its logprobs are of the masked logits
        return [SamplingParams(max_tokens=40, temperature=0.8, seed=6, logprobs=2,
                               structured_outputs={"json": schema})]

    fused0 = sd.stats()["mask_fused_rows"]
    got = llm.generate(prompts, params()) + llm.generate(prompts[:1], with_logprobs())
    assert sd.stats()["mask_fused_rows"] > fused0, "the masks went into the draw"
    sd.sampler = None  # the unfused path: masks applied to the logits
    try:
        want = llm.generate(prompts, params()) + llm.generate(prompts[:1], with_logprobs())
    finally:
        sd.sampler = sampler
    assert len(got) == len(want) == 4
    for g_out, w_out in zip(got, want):
        assert len(g_out.outputs) == len(w_out.outputs)
        for a, b in zip(g_out.outputs, w_out.outputs):
            assert list(a.token_ids) == list(b.token_ids)
            if a.finish_reason == "stop":  # else cut by max_tokens
                json.loads(a.text)
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                assert a.logprobs == b.logprobs
    assert got[-1].outputs[0].logprobs, "the logprobs request got logprobs"
