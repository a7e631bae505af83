"""/v1/completions with vLLM's ``use_beam_search`` (n = beam width), against HF
transformers' beam search; bad combinations answer 400 naming the field."""

from __future__ import annotations

import copy

import torch


def test_beam_search_completion_matches_hf(live, hf_tiny):
    prompt = [40, 41, 42, 43, 44, 45, 46]
    r = live.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5, "n": 3,
                                      "use_beam_search": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    gc = copy.deepcopy(hf_tiny.generation_config)
    gc.eos_token_id = None
    gc.num_beams, gc.num_return_sequences, gc.do_sample, gc.max_new_tokens = 3, 3, False, 5
    with torch.no_grad():
        ref = hf_tiny.generate(torch.tensor([prompt]), generation_config=gc)
    tok = live.engine.tokenizer
    want = [tok.decode(s[len(prompt):].tolist()) for s in ref]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == want
    assert all(c["finish_reason"] == "length" for c in choices)
    live.wait_idle_and_whole()


def test_beam_search_refusals_name_the_field(live):
    base = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "use_beam_search": True}
    for extra, param in [({"temperature": 0.8}, "temperature"), ({"stream": True}, "stream"),
                         ({"n": 10_000}, "n"), ({"n": 0}, "n"), ({"stop": ["x"]}, "stop"),
                         ({"logprobs": 2}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"logit_bias": {"5": 3}}, "logit_bias"), ({"echo": True}, "echo")]:
        r = live.post("/v1/completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    r = live.post("/v1/completions", {**base, "n": 1000})  # more beams than the state pool's slots
    assert r.status_code == 400 and "beam_width" in r.json()["error"]["message"], r.text
    r = live.post("/v1/completions", {"model": "tiny", "prompt": [1], "length_penalty": 2.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    live.wait_idle_and_whole()
