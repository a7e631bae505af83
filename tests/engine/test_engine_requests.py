"""Request-level behaviour of the engine: stops, logprobs, aborts, rejections.

Oracles: HF transformers' greedy continuation (what the tokens must be), the
tokenizer's own decode of those tokens (what the text must be), and the pools being
whole once every request is gone.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve import LLM, InvalidRequest, QueueFull, SamplingParams

PROMPT = [30, 31, 32, 33, 34, 35, 36, 37, 38]


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
               num_pages=48 + 3 * 6, max_num_seqs=6, max_num_batched_tokens=128,
               max_model_len=128)


@pytest.fixture(scope="module")
def hf_greedy(hf_models):
    def run(ids, n):
        seq = list(ids)
        logits = []
        for _ in range(n):
            with torch.no_grad():
                out = hf_models["test-a"](torch.tensor([seq])).logits[0, -1].float()
            logits.append(out)
            seq.append(int(out.argmax()))
        return seq[len(ids):], logits

    return run


def _whole(llm):
    s = llm.engine.stats()
    assert s["used_blocks"] == 0 and s["running_state_pages"] == 0 and s["num_running_seqs"] == 0, s


def test_stop_token_ids_end_the_completion_with_the_token_as_stop_reason(llm, hf_greedy):
    expect, _ = hf_greedy(PROMPT, 12)
    stop_at = 5
    tok = expect[stop_at]
    if tok in expect[:stop_at]:
        pytest.fail("pick a prompt whose greedy continuation has a fresh token at position 5")
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == expect[: stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)
    _whole(llm)


def test_stop_string_truncates_text_and_frees_the_sequence(llm, hf_greedy):
    tokenizer = llm.get_tokenizer()
    expect, _ = hf_greedy(PROMPT, 12)
    full = tokenizer.decode(expect)
    # A stop string taken from the middle of the greedy text.
    stop = full[4:6]
    cut = full.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:cut]
    assert out.token_ids == expect[: len(out.token_ids)]
    assert len(out.token_ids) < 12
    _whole(llm)


def test_logprobs_are_hf_log_softmax(llm, hf_greedy):
    expect, logits = hf_greedy(PROMPT, 4)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == expect
    total = 0.0
    for tok, entry, lg in zip(out.token_ids, out.logprobs, logits):
        ref = torch.log_softmax(lg, -1)
        assert math.isclose(entry[tok].logprob, ref[tok].item(), rel_tol=1e-4, abs_tol=1e-5)
        assert entry[tok].rank == 1  # greedy picks the most likely token
        top3 = torch.topk(ref, 3).indices.tolist()
        assert set(top3) <= set(entry)
        total += ref[tok].item()
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-4, abs_tol=1e-5)


def test_abort_mid_generation_returns_every_block_and_slot(llm):
    engine = llm.engine
    engine.add_request("long", PROMPT * 3, SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add_request("short", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats()["used_blocks"] > 0
    engine.abort_request("long")
    while engine.has_unfinished_requests():
        engine.step()
    _whole(llm)
    assert engine.stats()["aborted_requests"] >= 1


@pytest.mark.parametrize("prompt, params, fragment", [
    ([5] * 200, SamplingParams(max_tokens=4), "max_model_len"),
    ([5] * 100, SamplingParams(max_tokens=60), "max_tokens"),
    ([5, 6], SamplingParams(n=7, max_tokens=4), "n = 7"),
    ([5, 10_000], SamplingParams(max_tokens=4), "token ids"),
    ([], SamplingParams(max_tokens=4), "empty"),
])
def test_rejections_are_immediate_and_leave_nothing_behind(llm, prompt, params, fragment):
    engine = llm.engine
    with pytest.raises(InvalidRequest, match=fragment):
        engine.add_request(None, prompt, params)
    assert not engine.has_unfinished_requests()
    _whole(llm)


def test_a_rejected_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(InvalidRequest):
        llm.generate([PROMPT, [5] * 500], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    _whole(llm)


def test_queue_cap_answers_queue_full(tiny_dirs):
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", num_pages=32 + 3 * 4, max_num_seqs=4, max_waiting_requests=2)
    engine = llm.engine
    # The cap counts requests that wait beyond the free run slots: 4 slots + 2 waiting.
    for rid in "abcdef":
        engine.add_request(rid, [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull, match="max_waiting_requests"):
        engine.add_request("g", [5, 6], SamplingParams(max_tokens=2))
    engine.step()  # a-d run, e and f wait: still full
    with pytest.raises(QueueFull, match="max_waiting_requests"):
        engine.add_request("g", [5, 6], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("g", [5, 6], SamplingParams(max_tokens=2))  # room again
    while engine.has_unfinished_requests():
        engine.step()
    _whole(llm)
