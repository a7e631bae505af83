"""Hostile and malformed requests against a live server: each gets its 4xx with an
OpenAI-style error body that names the problem, never a 500, and loses nothing.

Oracle: the engine's pools being whole (every KV block and state slot free, no
request left) after each case, and a normal request still being served. Add new
cases to ``CASES``.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def _user(content):
    return {"messages": [{"role": "user", "content": content}]}


# (id, method, path, body: dict | bytes | None, expected status, fragment of the message
#  [, request headers])
GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
VOCAB = 272  # the test-a tiny checkpoint's vocabulary
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
    # ---- issue 21: no 500s left
    ("gzip-not-gzip", "POST", C, b'{"prompt":"a","max_tokens":2}', 400, "Content-Encoding", GZIP),
    ("deflate-not-deflate", "POST", C, b'{"prompt":"a"}', 400, "Content-Encoding",
     {"Content-Type": "application/json", "Content-Encoding": "deflate"}),
    ("content-encoding-unknown", "POST", C, b'{"prompt":"a"}', 415, "Content-Encoding",
     {"Content-Type": "application/json", "Content-Encoding": "foo"}),
    ("content-encoding-twice", "POST", C, b'{"prompt":"a"}', 415, "Content-Encoding",
     {"Content-Type": "application/json", "Content-Encoding": "gzip, gzip"}),
    # ---- issue 21: float64 values that over/underflow float32 (all-id-0 output before)
    ("temperature-1e308", "POST", C, {"prompt": "x", "temperature": 1e308}, 400, "temperature"),
    ("temperature-1e308-min-tokens", "POST", C, {"prompt": "x", "temperature": 1e308, "min_tokens": 3}, 400,
     "temperature"),
    ("temperature-1e308-stop-ids", "POST", C,
     {"prompt": "x", "temperature": 1e308, "min_tokens": 2, "stop_token_ids": [3]}, 400, "temperature"),
    ("repetition-penalty-1e-300", "POST", C, {"prompt": "x", "repetition_penalty": 1e-300}, 400,
     "repetition_penalty"),
    ("repetition-penalty-1e-45", "POST", C, {"prompt": "x", "repetition_penalty": 1e-45}, 400,
     "repetition_penalty"),
    ("repetition-penalty-1e300", "POST", C, {"prompt": "x", "repetition_penalty": 1e300}, 400,
     "repetition_penalty"),
    ("chat-temperature-1e308", "POST", CHAT, {**_user("hi"), "temperature": 1e308}, 400, "temperature"),
    # ---- issue 21: accepted although invalid
    ("stop-token-beyond-vocab", "POST", C, {"prompt": "x", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ("chat-stop-token-beyond-vocab", "POST", CHAT, {**_user("hi"), "stop_token_ids": [1, 10**6]}, 400,
     "stop_token_ids"),
    ("chat-name-object", "POST", CHAT, {"messages": [{"role": "user", "content": "hi", "name": {"a": 1}}]}, 400,
     "name"),
    ("chat-tool-calls-string", "POST", CHAT,
     {"messages": [{"role": "assistant", "content": "x", "tool_calls": "call"}, {"role": "user", "content": "y"}]},
     400, "tool_calls"),
    ("chat-tool-call-id-number", "POST", CHAT,
     {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, 400, "tool_call_id"),
    ("user-object", "POST", C, {"prompt": "x", "user": {"id": 1}}, 400, "user"),
    ("chat-user-list", "POST", CHAT, {**_user("hi"), "user": ["a"]}, 400, "user"),
    ("content-type-text-plain", "POST", C, b'{"prompt": "x"}', 415, "Content-Type",
     {"Content-Type": "text/plain"}),
    ("content-type-none", "POST", C, b'{"prompt": "x"}', 415, "Content-Type", {}),
    ("content-type-form", "POST", TOK, b'{"prompt": "x"}', 415, "Content-Type",
     {"Content-Type": "application/x-www-form-urlencoded"}),
    # ---- issue 21: one request must not slow everyone
    ("stop-100k-strings", "POST", C, {"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, 400,
     "max-stop-strings"),
    ("stop-5000-chars", "POST", C, {"prompt": "x", "stop": ["=" * 5000]}, 400, "max-stop-string-chars"),
    ("chat-stop-100k", "POST", CHAT, {**_user("hi"), "stop": ["ab"] * 100_000}, 400, "max-stop-strings"),
    # ---- issue 21: protocol
    ("model-retrieve-unknown", "GET", "/v1/models/gpt-5", None, 404, "does not exist"),
]


class _Response:
    def __init__(self, status, headers, content):
        self.status_code, self.headers, self.content = status, headers, content
        self.text = content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def _send(live, method, path, body, headers=None):
    if headers is not None:
        conn = live.connect()
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(body or b"")))
            conn.endheaders(body)
            r = conn.getresponse()
            return _Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()
    if isinstance(body, bytes):
        return live.request(method, path, content=body)
    return live.request(method, path, json_body=body)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_its_4xx_and_loses_nothing(live, case):
    _, method, path, body, status, fragment, *headers = case
    r = _send(live, method, path, body, *headers)
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


# ---------------------------------------------------------------- raw bytes (issue 21)
def _raw(live, data: bytes, half_close: bool = False) -> bytes:
    s = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    try:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and the (de-chunked) body of one HTTP/1.x response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            size, _, body = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, body = out + body[:n], body[n + 2:]
        body = out
    return status, headers, body


_POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
_BODY = b'{"prompt": [5, 6], "max_tokens": 2}'

# (id, raw request, expected status, fragment of the message, bytes the log must not quote)
RAW_CASES = [
    ("bad-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n", 400,
     "Content-Length", b"12abc"),
    ("header-100KB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"q" * 100_000 + b"\r\n\r\n", 400,
     "longer than", b"qqqqqqqq"),
    ("garbage-request-line", b"\x00\x01zorglub\r\n\r\n", 400, "HTTP method", b"zorglub"),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "HTTP/2", b"SM"),
    ("bad-header-name", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\x7f: zorglub\r\n\r\n", 400, "",
     b"zorglub"),
    ("chunked-garbage", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
     b"Content-Type: application/json\r\n\r\nzz-not-hex\r\n", 400, "", b"not-hex"),
]


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_parser_rejection_answers_json_and_logs_one_warning_without_the_bytes(live, case, caplog):
    _, data, status, fragment, secret = case
    caplog.set_level("DEBUG")
    got, headers, body = _parse(_raw(live, data))
    assert got == status, body
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error", err
    assert secret.decode("latin-1") not in err["message"]
    time.sleep(0.1)  # the log line is written on the server's thread
    mine = [r for r in caplog.records if r.name.startswith(("hybridserve", "aiohttp"))
            and r.levelno >= logging.WARNING]
    assert len(mine) == 1 and mine[0].levelno == logging.WARNING and not mine[0].exc_info, \
        [(r.name, r.levelname, r.getMessage()[:200]) for r in mine]
    assert secret.decode("latin-1") not in mine[0].getMessage()
    ok = live.post(C, {"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    live.wait_idle_and_whole()


@pytest.mark.parametrize("token", [b"\xff\xfe", b"sekrit\x80", b"sekr\xc3it"])
def test_api_key_header_that_is_not_utf8_gets_401(live, token, caplog):
    live.settings.api_key = "sekrit"
    try:
        raw = _raw(live, _POST + b"Authorization: Bearer " + token + b"\r\nContent-Length: "
                   + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
        good = live.post(C, {"prompt": [5, 6], "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"})
    finally:
        live.settings.api_key = None
    status, headers, body = _parse(raw)
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert good.status_code == 200
    live.wait_idle_and_whole()


def test_half_closed_client_gets_its_answer(live, caplog):
    """HTTP allows a client to shut its sending side after the request: it is answered
    (streamed or not), and a body cut short by the EOF is a 400, not a hang."""
    for stream in (False, True):
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": stream}).encode()
        raw = _raw(live, _POST.replace(b"Connection: close\r\n", b"") + b"Content-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body, half_close=True)
        status, _, payload = _parse(raw)
        assert status == 200, payload
        if stream:
            events = [ln[6:] for ln in payload.split(b"\n") if ln.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:
            out = json.loads(payload)
            assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    status, _, payload = _parse(_raw(live, _POST + b"Content-Length: 100\r\n\r\n" + _BODY, half_close=True))
    assert status == 400 and "Content-Length" in json.loads(payload)["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    live.wait_idle_and_whole()


def test_a_real_gzip_body_is_served(live):
    import gzip

    body = gzip.compress(json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode())
    r = _send(live, "POST", C, body, GZIP)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    live.wait_idle_and_whole()
