"""Speculative decoding end to end: the engine with drafts against the engine without.

The oracle is non-speculative decoding of the same requests (itself checked against HF
elsewhere): greedy outputs must be identical token for token, and so must seeded
sampled outputs (hybridserve.spec.acceptance draws every token with the stream offset a
non-speculative step uses). Random MTP weights make most drafts wrong, which exercises
every rejection path; a model whose MTP layer copies the trunk's answer would accept
everything, so both ends are covered by the acceptance counters checked below.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError
from hybridserve.model.tiny import write_tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(spec_tiny):
    return spec_tiny


@pytest.fixture(scope="module")
def any_ckpt(any_spec_ckpt):
    """See tests/spec/conftest.py: random MTP weights, and the trained default model."""
    return any_spec_ckpt


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 200) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, vocab) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def _run(ckpt: str, prompts, params, k: int | None, **kw):
    args = dict(dtype="float32", num_pages=kw.pop("num_pages", 400), max_num_seqs=kw.pop("max_num_seqs", 8),
                block_size=kw.pop("block_size", 16), max_model_len=256, **kw)
    if k is not None:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0}
    llm = LLM(ckpt, **args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outs


def _tokens(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def _all_free(llm):
    st = llm.engine.stats()
    assert st["free_pages"] + st["cached_pages"] + st["checkpoint_pages"] == st["num_pages"], st


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_identical_on_and_off(any_ckpt, k):
    prompts = _prompts(6, seed=k)
    params = [SamplingParams(max_tokens=20 + 3 * i, **GREEDY) for i in range(len(prompts))]
    _, off = _run(any_ckpt, prompts, params, None)
    llm, on = _run(any_ckpt, prompts, params, k)
    assert _tokens(on) == _tokens(off)
    st = llm.engine.stats()
    assert st["spec_draft_tokens"] > 0
    assert 0 <= st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    # The scheduler's own count agrees with the engine's.
    assert list(st["spec_accepted_by_position"]) == st["spec_accepted_by_position_counts"]
    if any_ckpt != _ckpt_random(any_ckpt):
        # The trained MTP layer: drafts are accepted, so steps commit several tokens.
        assert st["spec_accepted_tokens"] > 0.2 * st["spec_draft_tokens"]
    _all_free(llm)


def _ckpt_random(path: str) -> str:
    return path if "spec-tiny" in path else ""


def test_greedy_identical_under_chunked_prefill_prefix_hits_and_preemption(any_ckpt):
    ckpt = any_ckpt
    shared = _prompts(1, seed=9, lo=40, hi=40)[0]
    prompts = [shared + p for p in _prompts(8, seed=3, lo=2, hi=30)] + _prompts(4, seed=4, lo=50, hi=90)
    params = [SamplingParams(max_tokens=24, **GREEDY) for _ in prompts]
    # A small arena and token budget: chunked prefills, preemption (recompute), and
    # prefix-cache hits on the shared 40 tokens.
    kw = dict(num_pages=30, max_num_batched_tokens=32, max_num_seqs=6, enable_prefix_caching=True)
    llm_off, off = _run(ckpt, prompts, params, None, **dict(kw))
    llm, on = _run(ckpt, prompts, params, 3, **dict(kw))
    assert _tokens(on) == _tokens(off)
    st = llm.engine.stats()
    assert st["spec_draft_tokens"] > 0
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0
    _all_free(llm)


def test_seeded_sampling_identical_on_and_off_under_every_processor(any_ckpt):
    ckpt = any_ckpt
    prompts = _prompts(6, seed=21)
    params = [
        SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, seed=2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=24, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=1.2, repetition_penalty=1.2, seed=4, max_tokens=24, ignore_eos=True,
                       logit_bias={7: 3.0, 11: -2.0}),
        SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3, repetition_penalty=1.3),
    ]
    _, off = _run(ckpt, prompts, params, None)
    llm, on = _run(ckpt, prompts, params, 2)
    assert _tokens(on) == _tokens(off)
    for a, b in zip(on, off):
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.logprobs is None:
                assert ca.logprobs is None
                continue
            assert len(ca.logprobs) == len(cb.logprobs) == len(cb.token_ids)
            for la, lb, t in zip(ca.logprobs, cb.logprobs, cb.token_ids):
                assert set(la) == set(lb)
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    # Seeded runs are reproducible from run to run.
    _, again = _run(ckpt, prompts, params, 2)
    assert _tokens(again) == _tokens(on)
    _all_free(llm)


def test_n2_stop_strings_max_tokens_and_stop_ids(ckpt):
    prompts = _prompts(4, seed=31)
    _, probe = _run(ckpt, prompts[:1], [SamplingParams(max_tokens=12, **GREEDY)], None)
    stop_tok = probe[0].outputs[0].token_ids[5]
    params = [
        SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=15, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=1, **GREEDY),
        SamplingParams(max_tokens=2, **GREEDY),
    ]
    prompts = [prompts[1], prompts[0], prompts[2], prompts[3]]
    _, off = _run(ckpt, prompts, params, None)
    llm, on = _run(ckpt, prompts, params, 4)
    assert _tokens(on) == _tokens(off)
    assert [len(c.token_ids) for c in on[2].outputs] == [1]
    # An n=2 request's samples draft too (each its own drafts after the fork).
    llm2, alone = _run(ckpt, prompts[:1], params[:1], 4)
    assert _tokens(alone) == _tokens(off[:1])
    assert llm2.engine.stats()["spec_draft_tokens"] > 0
    _all_free(llm)


def test_running_state_pages_per_sequence_unchanged(ckpt):
    """Drafts take no DeltaNet state: every running sequence holds exactly one state
    (pages_per_state pages) at every step, with speculation on as off, and the state's
    bytes are the same (the pages are larger with speculation on, by the MTP layer's KV
    block, so a state may span fewer of them)."""
    prompts = _prompts(4, seed=41, lo=5, hi=10)
    state_bytes = {}
    for k in (None, 3):
        llm = LLM(ckpt, dtype="float32", num_pages=400, max_num_seqs=4, max_model_len=256,
                  **({} if k is None else {"speculative_config": {"num_speculative_tokens": k,
                                                                  "disable_by_batch_size": 0}}))
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(max_tokens=30, **GREEDY))
        ratios = set()
        while eng.has_unfinished_requests():
            eng.step()
            st = eng.stats()
            if st["num_running_seqs"]:
                ratios.add(st["running_state_pages"] / st["num_running_seqs"])
        assert ratios == {st["pages_per_state"]}
        state_bytes[k] = eng.cache.layout.state_bytes
        if k is not None:
            assert eng.cache.layout.extra_attention_layers == 1
    assert state_bytes[None] == state_bytes[3]


def test_refused_without_an_mtp_layer(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "nomtp", preset="test-a", seed=5, mtp=False)
    with pytest.raises(ConfigError, match="MTP"):
        LLM(str(d), dtype="float32", num_pages=100, speculative_config={"method": "mtp",
                                                                       "num_speculative_tokens": 1})


@pytest.mark.parametrize("bad", [{"method": "eagle"}, {"num_speculative_tokens": 0},
                                 {"num_speculative_token": 2}, "not json", {"disable_by_batch_size": -1}])
def test_bad_speculative_config_is_a_clear_error(ckpt, bad):
    with pytest.raises(ConfigError, match="speculative_config"):
        LLM(ckpt, dtype="float32", num_pages=100, speculative_config=bad)


def test_beams_run_without_drafts_and_equal_the_plain_search(ckpt):
    from hybridserve.beam_search import BeamSearchParams

    prompts = _prompts(2, seed=51)
    res = {}
    for k in (None, 2):
        llm = LLM(ckpt, dtype="float32", num_pages=400, max_num_seqs=8, max_model_len=256,
                  **({} if k is None else {"speculative_config": {"num_speculative_tokens": k,
                                                                  "disable_by_batch_size": 0}}))
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
        res[k] = [[s.tokens for s in o.sequences] for o in outs]
    assert res[None] == res[2]


def test_greedy_identical_with_priorities_and_priority_preemption(ckpt):
    """Low-priority requests fill the run slots; urgent ones arrive after a few steps and
    preempt them (their drafts dropped with them); every output equals speculation off."""
    prompts = _prompts(6, seed=61, lo=20, hi=40)
    outs = {}
    for k in (None, 3):
        kw = dict(dtype="float32", num_pages=400, max_num_seqs=3, max_model_len=256)
        if k is not None:
            kw["speculative_config"] = {"num_speculative_tokens": k, "disable_by_batch_size": 0}
        eng = LLM(ckpt, **kw).engine
        done = {}
        for i in range(3):
            eng.add_request(f"low{i}", prompts[i], SamplingParams(max_tokens=24, **GREEDY), priority=5)
        for _ in range(4):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        for i in range(3, 6):
            eng.add_request(f"high{i}", prompts[i], SamplingParams(max_tokens=12, **GREEDY), priority=0)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        st = eng.stats()
        assert st["preemptions_priority"] > 0, st
        if k is not None:
            assert st["spec_draft_tokens"] > 0
        assert st["free_pages"] + st["cached_pages"] + st["checkpoint_pages"] == st["num_pages"]
        outs[k] = {r: o.outputs[0].token_ids for r, o in done.items()}
    assert outs[3] == outs[None] and len(outs[3]) == 6
