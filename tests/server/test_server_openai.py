"""The official ``openai`` Python client against a live server, plus the OpenAI shapes
it reads (chat logprobs, echo, text_offset, prompt lists, logit_bias, tokenize).

Oracles: HF transformers' ``Qwen3_5ForCausalLM`` over the same tiny checkpoint (greedy
tokens and every reported logprob), the checkpoint's tokenizer and chat template, and
the non-streamed answer for what a stream concatenates to.
"""

from __future__ import annotations

import math
import time

import openai
import pytest
import torch

from hybridserve.server.app import ServerSettings

TOL = 2e-3


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _hf_logprobs(hf, ids):
    """log_softmax of HF's logits at every position of ``ids`` (row p predicts ids[p+1])."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _hf_greedy(hf, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_logprobs(hf, seq)[-1].argmax()))
    return seq[len(ids):]


def _tok(live):
    return live.engine.tokenizer


def test_completion_with_the_client_matches_hf_greedy(live, client, hf_tiny):
    prompt = [40, 41, 42, 43, 44, 45]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    expect = _hf_greedy(hf_tiny, prompt, 7)
    assert r.choices[0].text == _tok(live).decode(expect)
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.created, int) and r.created > 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 7)
    live.wait_idle_and_whole()


def test_streamed_completion_concatenates_to_the_whole_and_every_chunk_has_created(live, client):
    kw = dict(model="tiny", prompt="Hello there", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(isinstance(c.created, int) and c.created > 0 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs_have_the_chat_shape_and_hf_values_streamed_or_not(live, client, hf_tiny):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    kw = dict(model="tiny", messages=messages, max_completion_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    # The prompt is the template over the normalised messages (parts joined, null as "").
    norm = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
    prompt_ids = _tok(live).apply_chat_template(norm, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    out_ids = _hf_greedy(hf_tiny, prompt_ids, 6)
    lps = _hf_logprobs(hf_tiny, prompt_ids + out_ids)
    for i, (entry, tok) in enumerate(zip(content, out_ids)):
        row = lps[len(prompt_ids) - 1 + i]
        assert entry.token == _tok(live).decode([tok])
        assert math.isclose(entry.logprob, float(row[tok]), abs_tol=TOL)
        assert len(entry.top_logprobs) == 3
        top = torch.topk(row, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].token == _tok(live).decode([int(top.indices[0])])
    # The tokens' bytes spell the message (partial UTF-8 pieces included).
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", "replace") == choice.message.content

    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert all(isinstance(c.created, int) and c.created > 0 for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    # The same tokens and entries; the values within TOL, not bit for bit: the second
    # request resumes from the first one's prefix-cache checkpoint, so its last rows run
    # in a smaller batch, and the CPU GEMMs round by batch shape (the native few-row
    # path vs MKL; for MoE, per-expert groups of other sizes).
    def shape(e):
        d = e.model_dump()
        return {**d, "logprob": None, "top_logprobs": [{**t, "logprob": None} for t in d["top_logprobs"]]}

    assert [shape(e) for e in streamed] == [shape(e) for e in content]
    for got, want in zip(streamed, content):
        assert math.isclose(got.logprob, want.logprob, abs_tol=TOL)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top_logprobs],
                                                                      abs=TOL)
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == choice.message.content
    live.wait_idle_and_whole()


def test_echo_returns_the_prompt_with_hf_prompt_logprobs_and_text_offsets(live, client, hf_tiny):
    prompt = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    out = _hf_greedy(hf_tiny, prompt, 4)
    tok = _tok(live)
    assert c.text == tok.decode(prompt) + tok.decode(out)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = _hf_logprobs(hf_tiny, prompt + out)
    for p in range(1, len(prompt) + 4):
        t = (prompt + out)[p]
        assert math.isclose(lp.token_logprobs[p], float(rows[p - 1][t]), abs_tol=TOL), p
        assert len(lp.top_logprobs[p]) >= 2  # the top 2, plus the chosen token when it is not among them
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    # Streamed echo: the same text, tokens and offsets, in pieces.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                            echo=True, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    offs = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offs == lp.text_offset
    live.wait_idle_and_whole()


def test_echo_without_logprobs_and_with_a_cached_prefix(live, client, hf_tiny):
    # A repeated prompt would hit the prefix cache; prompt logprobs must still be complete.
    prompt = list(range(50, 50 + 40))
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)  # fills the prefix cache
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                      logprobs=0)
        assert all(x is not None for x in r.choices[0].logprobs.token_logprobs[1:])
        rows = _hf_logprobs(hf_tiny, prompt)
        assert math.isclose(r.choices[0].logprobs.token_logprobs[39], float(rows[38][prompt[39]]), abs_tol=TOL)
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=2, echo=True, temperature=0)
    assert r.choices[0].text.startswith("abc") and r.choices[0].logprobs is None


def test_a_list_of_prompts_with_n_indexes_choices_across_prompts(live, client, hf_tiny):
    prompts = [[10, 11, 12], [20, 21, 22, 23]]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        expect = _tok(live).decode(_hf_greedy(hf_tiny, p, 3))
        assert [c.text for c in r.choices[2 * i:2 * i + 2]] == [expect, expect]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=3, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    by_index: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {c.index: c.text for c in r.choices}
    live.wait_idle_and_whole()


def test_logit_bias_clamps_and_steers_greedy_decoding(live, client, hf_tiny):
    prompt = [40, 41, 42]
    first = _hf_greedy(hf_tiny, prompt, 1)[0]
    # +1e6 is clamped to +100, which beats any logit of the tiny model: every token is 7.
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={"7": 1e6}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == _tok(live).decode([7] * 4)
    # -100 on the greedy token: the first token becomes HF's runner-up.
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    second = int(torch.topk(_hf_logprobs(hf_tiny, prompt)[-1], 2).indices[1])
    assert r.choices[0].text == _tok(live).decode([second])


def test_errors_raise_the_clients_exception_classes(live, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", stream=True, stream_options="x")  # type: ignore[arg-type]
    live.wait_idle_and_whole()


def test_models_and_tokenize_detokenize_shapes(live, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].created > 0
    tok = _tok(live)
    r = live.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    ids = list(tok.encode("Hello world", add_special_tokens=False))
    assert r == {"count": len(ids), "max_model_len": live.engine.max_model_len, "tokens": ids,
                 "token_strs": tok.convert_ids_to_tokens(ids)}
    msgs = [{"role": "user", "content": "hi"}]
    r = live.post("/tokenize", {"messages": msgs}).json()
    expect = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(expect, list):
        expect = expect["input_ids"]
    assert r["tokens"] == list(expect) and r["count"] == len(expect) and r["token_strs"] is None
    assert live.post("/detokenize", {"tokens": ids}).json() == {"prompt": tok.decode(ids)}


def test_api_key_guards_v1_and_leaves_health_and_metrics_open(tiny_dir, live_server_cls):
    LiveServer = live_server_cls
    for require_metrics in (False, True):
        server = LiveServer(tiny_dir, ServerSettings(api_key="sekrit", metrics_require_key=require_metrics,
                                                     keepalive_timeout=0.5))
        try:
            good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
            bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
            assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason
            with pytest.raises(openai.AuthenticationError) as e:
                bad.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
            r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert server.post("/tokenize", {"prompt": "x"}).status_code == 401
            assert server.request("GET", "/health").status_code == 200
            assert server.request("GET", "/metrics").status_code == (401 if require_metrics else 200)
            assert server.request("GET", "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
            # An idle keep-alive connection is closed after --keepalive-timeout.
            conn = server.connect(timeout=10)
            conn.request("GET", "/health")
            conn.getresponse().read()
            time.sleep(1.5)
            assert conn.sock.recv(1) == b""
            conn.close()
        finally:
            server.stop()


def test_prompt_logprobs_across_prefill_chunks_match_hf(live, client, hf_tiny):
    # 300 tokens with max_num_batched_tokens=128: prefilled in three chunks.
    prompt = [(7 * i + 3) % 250 for i in range(300)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    got = r.choices[0].logprobs.token_logprobs[:300]
    rows = _hf_logprobs(hf_tiny, prompt)
    expect = [None] + [float(rows[p - 1][prompt[p]]) for p in range(1, 300)]
    assert got[0] is None
    assert got[1:] == pytest.approx(expect[1:], abs=TOL)
    live.wait_idle_and_whole()


# ---------------------------------------------------------------- issue 21
def test_models_retrieve_with_the_client(live, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    assert card.id == client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-5")
    assert info.value.body["code"] == "model_not_found"


def test_include_usage_chunks_carry_null_usage_until_the_last(live):
    import json

    conn = live.connect()
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}), headers={"Content-Type": "application/json"})
    events = [ln[6:] for ln in conn.getresponse().read().split(b"\n") if ln.startswith(b"data: ")]
    conn.close()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]" and len(chunks) >= 3
    # OpenAI: every chunk has the key; null on all but the last, which has no choices.
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    live.wait_idle_and_whole()


def test_vanishing_top_p_and_huge_temperature_give_their_limits_not_id_0(live, client, hf_tiny):
    """top_p 1e-300 underflows float32 to 0; inside the range it must be greedy (HF's
    argmax), and the largest temperature with min_tokens must still sample real tokens."""
    prompt = [40, 41, 42, 43]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, top_p=1e-300,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == _tok(live).decode(_hf_greedy(hf_tiny, prompt, 6))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=1e4, seed=1,
                                  logprobs=0, extra_body={"ignore_eos": True, "min_tokens": 64,
                                                          "stop_token_ids": [3], "repetition_penalty": 1e-3})
    lps = r.choices[0].logprobs.token_logprobs
    assert len(lps) == 64 and all(math.isfinite(v) for v in lps)
    # Uniform over ~272 tokens: 64 draws hit many distinct tokens, never all one id.
    assert len(set(r.choices[0].logprobs.tokens)) > 20
    live.wait_idle_and_whole()
