"""Issue 21's operator-side and fairness items against a live server: stop-string
hold-back, the /metrics request_class cap, the access log, and ``serve``'s one-line
refusals of options this machine or model cannot honour.

Oracles: the non-streamed answer (what a stream must concatenate to) and brute-force
suffix/prefix comparison for what may be held back; the response's own id and usage
for the access-log line; counting label values in the Prometheus text.
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridserve.metrics import OTHER_CLASS, RequestClassLabels
from hybridserve.server.app import ServerSettings

C = "/v1/completions"


def _events(live, body):
    conn = live.connect()
    try:
        conn.request("POST", C, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        raw = conn.getresponse().read()
    finally:
        conn.close()
    out = [json.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: ") and ln != b"data: [DONE]"]
    return [e for e in out if e["choices"]]


def _pending(text, stops):
    """Brute force: the longest suffix of text that is a prefix of some stop string."""
    return max((k for k in range(len(text) + 1) for s in stops if s.startswith(text[len(text) - k:])), default=0)


def test_stop_string_holdback_releases_text_that_cannot_match(live):
    """A long stop string used to hold back its length - 1 characters of every stream
    (the whole completion arrived in the last chunk); only a possible stop prefix may
    be held now."""
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    whole = live.post(C, body).json()["choices"][0]["text"]
    assert len(whole) > 10
    # Starts with the text's 4th..6th characters and then goes where the text never
    # goes: the stream must hold those 3 characters while they could be its start.
    marker = next(ch for ch in "\u2603\u2604\u2605#~^" if ch not in whole)
    stops = [whole[3:6] + marker * 47, marker * 50]
    events = _events(live, {**body, "stop": stops})
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Before the final chunk, at most the possible stop prefix is missing from what was
    # streamed; before, all but 49 characters were.
    streamed = "".join(texts[:-1])
    assert whole.startswith(streamed)
    assert len(whole) - len(streamed) <= max(_pending(whole, stops), 4), (whole, texts)
    assert sum(1 for t in texts[:-1] if t) >= 5
    live.wait_idle_and_whole()


def test_metrics_size_stays_bounded_under_1000_request_classes(live):
    def send(i):
        r = live.post(C, {"prompt": [5, 6], "max_tokens": 1, "request_class": f"tenant-{i}"})
        assert r.status_code == 200, r.text

    cap = live.metrics.class_label.max
    for i in range(cap):
        send(i)
    first = live.request("GET", "/metrics").text
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(cap, 1000)))
    text = live.request("GET", "/metrics").text
    labels = set(re.findall(r'request_class="([^"]*)"', text))
    assert labels <= {f"tenant-{i}" for i in range(cap)} | {OTHER_CLASS, "default"}, sorted(labels)[:20]
    assert OTHER_CLASS in labels and f"tenant-{cap - 1}" in labels
    # 984 more classes added one label value ("other"), not 984 sets of series.
    per_class = len(first.splitlines()) / max(1, len(set(re.findall(r'request_class="([^"]*)"', first))))
    assert len(text.splitlines()) <= len(first.splitlines()) + 1.5 * per_class
    assert len(text.encode()) < 300_000
    live.wait_idle_and_whole()


def test_request_class_labels_with_a_configured_set():
    labels = RequestClassLabels(["gold", "free"])
    assert [labels(k) for k in ("gold", "free", "default", "evil", "x" * 64)] == \
        ["gold", "free", "default", OTHER_CLASS, OTHER_CLASS]
    capped = RequestClassLabels(max_request_classes=2)
    assert [capped(k) for k in ("a", "default", "b", "c", "a", "d")] == ["a", "default", "b", OTHER_CLASS, "a",
                                                                          OTHER_CLASS]


_ACCESS = re.compile(r"^(\S+) (GET|POST) (\S+) (\d{3}) (\d+\.\d+)s prompt_tokens=(\S+) output_tokens=(\S+) "
                     r"request_id=(\S+)$")


def _access_lines(caplog):
    return [_ACCESS.match(r.getMessage()) for r in caplog.records if r.name == "hybridserve.access"]


def test_access_log_line_per_request(live, caplog):
    caplog.set_level(logging.INFO, logger="hybridserve.access")
    r = live.post(C, {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}).json()
    events = _events(live, {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True})
    bad = live.post(C, {"prompt": "x", "temperature": -1})
    live.request("GET", "/health")
    # aiohttp writes the access line once the response is out, so the client may see
    # the answer a moment before the line exists: wait for it (bounded).
    deadline = time.monotonic() + 10
    while not any(m and m.group(3) == "/health" for m in _access_lines(caplog)) and time.monotonic() < deadline:
        time.sleep(0.02)
    lines = _access_lines(caplog)
    assert all(lines), [r.getMessage() for r in caplog.records if r.name == "hybridserve.access"]
    by_id = {m.group(8): m for m in lines}
    m = by_id[r["id"]]
    assert m.group(2, 3, 4) == ("POST", C, "200")
    assert (int(m.group(6)), int(m.group(7))) == (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])
    assert float(m.group(5)) >= 0
    m = by_id[events[0]["id"]]
    assert m.group(4, 6, 7) == ("200", "2", "4")
    assert bad.status_code == 400
    assert [(x.group(3), x.group(4), x.group(6)) for x in lines if x.group(4) == "400"] == [(C, "400", "-")]
    assert any(x.group(2, 3, 4) == ("GET", "/health", "200") for x in lines)
    live.wait_idle_and_whole()


def test_access_log_can_be_turned_off(tiny_dir, live_server_cls, caplog):
    caplog.set_level(logging.INFO, logger="hybridserve.access")
    server = live_server_cls(tiny_dir, settings=ServerSettings(access_log=False))
    try:
        r = server.post(C, {"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        server.stop()
    # Only this server's request counts: the module's other live server may still log
    # a line of an earlier test's last request while this one runs.
    rid = r.json()["id"]
    assert not [m for m in _access_lines(caplog) if m is None or m.group(8) == rid]
    assert rid


# ---------------------------------------------------------------- serve's refusals
def _serve(argv, capsys):
    from hybridserve.cli import main

    code = main(["serve", "--port", "0", *argv])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("argv,fragment", [
    (["--log-level", "chatty"], "--log-level 'chatty'"),
    (["--device", "cuda"], "no CUDA GPU"),
    (["--device", "cuda:1"], "no CUDA GPU"),
    (["--device", "tpu"], "not a device"),
])
def test_serve_refuses_bad_options_in_one_line(argv, fragment, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    code, err = _serve(argv, capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and fragment in err and "Traceback" not in err, err


def test_serve_refuses_max_model_len_above_the_models(tiny_dir, capsys):
    code, err = _serve([str(tiny_dir), "--max-model-len", "100000", "--device", "cpu"], capsys)
    with open(f"{tiny_dir}/config.json") as f:
        limit = json.load(f)["max_position_embeddings"]
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "100000" in err and str(limit) in err


def test_start_up_memory_line_counts_weights_pools_and_runtime(live, tiny_dir):
    """Oracles: the checkpoint's parameter count (float32 on CPU: 4 bytes each) and the
    planner's arena arithmetic, which the allocated cache must match byte for byte."""
    import glob
    import math

    from safetensors import safe_open

    from hybridserve.server.serve import memory_held, memory_held_line

    params = 0
    for f in glob.glob(f"{tiny_dir}/*.safetensors"):
        with safe_open(f, "pt") as g:
            # (The MTP layer's tensors load only for speculative decoding.)
            params += sum(math.prod(g.get_slice(k).get_shape()) for k in g.keys() if not k.startswith("mtp."))
    m = memory_held(live.engine)
    plan = live.engine.arena_plan
    assert m["weights"] == 4 * params
    assert m["pools"] == plan.arena_bytes == plan.total_pages * plan.layout.page_bytes
    assert m["total"] == m["weights"] + m["pools"] + m["runtime"] and m["runtime"] > 0
    assert m["total"] >= m["host_resident"] * 0.9  # on CPU the resident set is what is held
    line = memory_held_line(live.engine)
    assert line.startswith("memory held (host): ") and "weights" in line and "runtime" in line
