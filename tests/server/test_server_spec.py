"""Speculation through the OpenAI server: a stream's deltas (several tokens per step)
add up to the non-streamed answer, which equals the server's answer without drafts;
/metrics carries vLLM's spec_decode counters; every block and slot comes back."""

from __future__ import annotations

import json

import pytest

from hybridserve import default_model

SPEC = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 0}


@pytest.fixture(scope="module")
def servers(live_server_cls):
    path = default_model.path()
    on = live_server_cls(path, speculative_config=SPEC)
    off = live_server_cls(path)
    yield on, off
    on.stop()
    off.stop()


def _stream_text(server, body) -> tuple[str, str | None]:
    r = server.post("/v1/completions", dict(body, stream=True))
    assert r.status_code == 200, r.text
    text, reason = "", None
    for line in r.text.split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[len("data: "):])
        for ch in ev.get("choices", []):
            text += ch.get("text") or ""
            reason = ch.get("finish_reason") or reason
    return text, reason


@pytest.mark.parametrize("extra", [dict(temperature=0), dict(temperature=0.8, seed=11, top_p=0.9)])
def test_streamed_equals_non_streamed_equals_no_drafts(servers, extra):
    on, off = servers
    body = dict(model="tiny", prompt="def read_config(path):\n    ", max_tokens=60, stop=["\n\n\n"], **extra)
    a = on.post("/v1/completions", body)
    b = off.post("/v1/completions", body)
    assert a.status_code == b.status_code == 200
    ca, cb = a.json()["choices"][0], b.json()["choices"][0]
    assert (ca["text"], ca["finish_reason"]) == (cb["text"], cb["finish_reason"])
    assert _stream_text(on, body) == (ca["text"], ca["finish_reason"])
    vals = on.wait_idle_and_whole()
    assert vals["hybridserve:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < vals["hybridserve:spec_decode_num_accepted_tokens_total"] \
        <= vals["hybridserve:spec_decode_num_draft_tokens_total"]
    assert vals["hybridserve:spec_decode_mean_accepted_length"] > 1
