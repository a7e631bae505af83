"""Hostile and malformed requests against a live server: each gets its 4xx with an
OpenAI-style error body that names the problem, never a 500, and loses nothing.

Oracle: the engine's pools being whole (every KV block and state slot free, no
request left) after each case, and a normal request still being served. Add new
cases to ``CASES``.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def _user(content):
    return {"messages": [{"role": "user", "content": content}]}


# (id, method, path, body: dict | bytes | None, expected status, fragment of the message)
CASES = [
    ("body-over-cap", "POST", C, b'{"prompt": "' + b"a" * (17 << 20) + b'"}', 413, "larger than"),
    ("max-tokens-huge", "POST", C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("priority-huge", "POST", C, {"prompt": "x", "priority": 10**30}, 400, "priority"),
    ("stop-token-huge", "POST", C, {"prompt": "x", "stop_token_ids": [10**12]}, 400, "stop_token_ids"),
    ("seed-huge", "POST", C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("n-huge", "POST", C, {"prompt": "x", "n": 10**6}, 400, "n="),
    ("json-nested-100k", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, "deeply"),
    ("object-nested-100k", "POST", C, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "deeply"),
    ("surrogate-prompt", "POST", C, b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("surrogate-message", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400,
     "surrogate"),
    ("surrogate-stop", "POST", C, b'{"prompt": "ab", "stop": ["\\ud800"]}', 400, "surrogate"),
    ("stream-options-string", "POST", C, {"prompt": "x", "stream": True, "stream_options": "x"}, 400,
     "stream_options"),
    ("stream-options-no-stream", "POST", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("stream-not-bool", "POST", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("echo-not-bool", "POST", C, {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("unknown-model", "POST", C, {"prompt": "x", "model": "gpt-5"}, 404, "does not exist"),
    ("unknown-model-chat", "POST", CHAT, {**_user("hi"), "model": "gpt-5"}, 404, "does not exist"),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("user-content-null", "POST", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "null"),
    ("image-part", "POST", CHAT, _user([{"type": "image_url", "image_url": {"url": "x"}}]), 400, "text"),
    ("message-not-object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("top-logprobs-alone", "POST", CHAT, {**_user("hi"), "top_logprobs": 2}, 400, "top_logprobs"),
    ("top-logprobs-huge", "POST", CHAT, {**_user("hi"), "logprobs": True, "top_logprobs": 10**9}, 400,
     "top_logprobs"),
    ("max-completion-tokens-0", "POST", CHAT, {**_user("hi"), "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("logit-bias-key", "POST", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit-bias-vocab", "POST", C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("logit-bias-value", "POST", C, {"prompt": "x", "logit_bias": {"5": "big"}}, 400, "logit_bias"),
    ("prompt-mixed-list", "POST", C, {"prompt": ["a", 5]}, 400, "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, 400, "prompt"),
    ("prompt-token-out-of-vocab", "POST", C, {"prompt": [[1, 2], [10**9]]}, 400, "token ids"),
    ("prompt-15MB", "POST", C, {"prompt": "ab " * (5 << 20)}, 400, "characters"),
    ("chat-15MB", "POST", CHAT, _user("ab " * (5 << 20)), 400, "characters"),
    ("body-array", "POST", C, b"[1, 2]", 400, "JSON object"),
    ("body-not-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("unknown-route", "GET", "/v1/nope", None, 404, "no route"),
    ("unknown-route-post", "POST", "/nope", {"prompt": "x"}, 404, "no route"),
    ("wrong-method", "GET", C, None, 405, "not allowed"),
    ("wrong-method-health", "POST", "/health", {}, 405, "not allowed"),
    ("tokenize-unknown-field", "POST", TOK, {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("tokenize-both", "POST", TOK, {"prompt": "x", **_user("y")}, 400, "exactly one"),
    ("detokenize-out-of-vocab", "POST", DETOK, {"tokens": [1, 10**9]}, 400, "token ids"),
    ("detokenize-not-list", "POST", DETOK, {"tokens": "abc"}, 400, "tokens"),
]


def _send(live, method, path, body):
    if isinstance(body, bytes):
        return live.request(method, path, content=body)
    return live.request(method, path, json_body=body)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_its_4xx_and_loses_nothing(live, case):
    _, method, path, body, status, fragment = case
    r = _send(live, method, path, body)
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert fragment in err["message"], err
    assert isinstance(err["type"], str) and err["type"]
    if status == 404 and path in (C, CHAT):
        assert err["code"] == "model_not_found" and err["param"] == "model"
    # The engine keeps serving, and nothing leaked.
    ok = live.post(C, {"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    live.wait_idle_and_whole()


def test_huge_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(live):
    """A many-megabyte prompt is refused on its character count; a stream running at the
    same time keeps getting tokens (nothing tokenizes it on the engine thread)."""
    conn = live.connect()
    conn.request("POST", C, body=json.dumps({"prompt": [3, 4, 5], "max_tokens": 1500, "ignore_eos": True,
                                              "stream": True}), headers={"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.status == 200

    def next_event():
        while True:
            line = stream.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                return line

    next_event()
    r = live.post(C, {"prompt": "ab " * (5 << 20)})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    # The stream is still alive and producing after the big request was handled.
    for _ in range(3):
        next_event()
    conn.close()  # and its abort frees everything
    live.wait_idle_and_whole()


def test_slow_body_gets_408_and_loses_nothing(live):
    live.settings.request_read_timeout = 0.5
    try:
        s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")  # ...and the rest never comes
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
    finally:
        live.settings.request_read_timeout = 60.0
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    live.wait_idle_and_whole()


def test_stream_with_bad_stream_options_never_starts(live):
    """Validation happens before the 200: the old behaviour was a 200, a cut-off body and
    a request left running with no client."""
    r = live.post(C, {"prompt": "x", "stream": True, "stream_options": "x", "max_tokens": 500,
                      "ignore_eos": True})
    assert r.status_code == 400
    vals = live.wait_idle_and_whole()
    assert vals["hybridserve:num_seqs_running"] == 0


def test_non_streamed_request_is_aborted_when_its_client_disconnects(live):
    before = live.metric_values().get("hybridserve:aborted_requests_total", 0)
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    body = json.dumps({"prompt": [3, 4, 5, 6], "max_tokens": 2000, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 20
    while live.metric_values().get("hybridserve:num_seqs_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    s.close()  # the client goes away long before 2000 tokens
    vals = live.wait_idle_and_whole(timeout=10)
    # Aborted (not run to max_tokens): the abort counter moved by exactly this request.
    assert vals["hybridserve:aborted_requests_total"] == before + 1


def test_text_prompts_are_tokenized_off_the_engine_thread(live, monkeypatch):
    import threading

    seen = []
    real = live.engine.tokenize

    def spy(prompt):
        if isinstance(prompt, str):  # the engine thread only re-checks the ids' range
            seen.append(threading.current_thread().name)
        return real(prompt)

    monkeypatch.setattr(live.engine, "tokenize", spy)
    assert live.post(C, {"prompt": "hello " * 100, "max_tokens": 1}).status_code == 200
    assert seen and all(name.startswith("hybridserve-tokenize") for name in seen), seen
    live.wait_idle_and_whole()
