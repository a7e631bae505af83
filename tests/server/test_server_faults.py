"""Faults stay local through the server: injected step faults under a mixed load end
some requests with an OpenAI error (500 body, or an error event on a stream), leave the
rest exactly as a fault-free run, and the server healthy with every page free; a fatal
fault under ``serve`` gives every open stream its error and exits non-zero in seconds."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import subprocess
import sys
import time

from hybridserve import LLM, SamplingParams
from hybridserve.engine.faults import FAULT_INJECT_ENV

ENGINE = dict(dtype="float32", device="cpu", num_pages=72, max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=2048)


def _bodies(n: int = 200):
    shared = [(11 * i) % 200 + 3 for i in range(40)]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            body = {"prompt": [(i * 13 + j) % 250 + 1 for j in range(5 + i % 7)], "max_tokens": 6}
        elif kind == 1:
            body = {"prompt": shared + [i % 250 + 1], "max_tokens": 5}  # prefix hits
        elif kind == 2:
            body = {"prompt": [(i + j) % 250 + 1 for j in range(4)], "max_tokens": 5, "n": 2, "seed": i,
                    "temperature": 0.9}
        else:
            body = {"prompt": [(i * 5 + j) % 250 + 1 for j in range(70 + i % 20)], "max_tokens": 16}
        body.update(temperature=body.get("temperature", 0.0), ignore_eos=True, stream=bool(i % 3 == 0))
        out.append(body)
    return out


def _post(port: int, body: dict) -> tuple[int, list[str] | None, dict | None]:
    """(status, the choices' texts or None, the error object or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()
    finally:
        conn.close()
    if not body.get("stream"):
        data = json.loads(raw)
        if r.status != 200:
            return r.status, None, data["error"]
        return 200, [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])], None
    texts: dict[int, str] = {}
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for ev in events[:-1]:
        obj = json.loads(ev)
        if "error" in obj:
            return r.status, None, obj["error"]
        for c in obj["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return r.status, [texts[i] for i in sorted(texts)], None


def test_faults_under_load_through_the_server(tiny_dir, live_server_cls, monkeypatch):
    bodies = _bodies()
    # The oracle: the same engine offline, no faults (greedy requests only compared).
    llm = LLM(str(tiny_dir), **ENGINE)
    greedy = [i for i, b in enumerate(bodies) if b["temperature"] == 0.0]
    ref = llm.generate([bodies[i]["prompt"] for i in greedy],
                       [SamplingParams(max_tokens=bodies[i]["max_tokens"], temperature=0.0, ignore_eos=True)
                        for i in greedy])
    expected = {i: o.outputs[0].text for i, o in zip(greedy, ref)}
    del llm

    monkeypatch.setenv(FAULT_INJECT_ENV, "forward=0.05,seed=7")
    server = live_server_cls(tiny_dir, **ENGINE)
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda b: _post(server.port, b), bodies))
        errored = 0
        for i, (status, texts, err) in enumerate(results):
            if err is not None:
                errored += 1
                assert err["code"] == 500 and "retry" in err["message"], err
                assert status == (200 if bodies[i]["stream"] else 500)
                continue
            assert status == 200 and len(texts) == bodies[i].get("n", 1)
            if i in expected:
                assert texts[0] == expected[i], i
        vals = server.wait_idle_and_whole(timeout=60)
        assert vals["hybridserve:failed_steps_total"] > 0
        assert vals["hybridserve:errored_requests_total"] == errored
        assert vals["hybridserve:retried_requests_total"] > 0
        assert server.request("GET", "/health").status_code == 200
        # Still serving: a fresh greedy request gives the fault-free answer (or, if a
        # fault catches it, a clean error).
        status, texts, err = _post(server.port, bodies[0])
        assert err is not None or (status == 200 and texts[0] == expected[0])
    finally:
        server.stop()


def _events(resp: http.client.HTTPResponse):
    while True:
        line = resp.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield line[6:].strip().decode()


def test_fatal_fault_under_serve_fails_every_stream_and_exits_nonzero(tiny_dir):
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", str(tiny_dir), "--port", "0",
           "--shutdown-timeout", "30", "--dtype", "float32", "--device", "cpu", "--max-model-len", "4096",
           "--num-pages", "400", "--max-num-seqs", "4", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", FAULT_INJECT_ENV: "fatal_after=150"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    conns = []
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(m.group(1))
        streams = []
        for p in ([3, 4, 5], [6, 7]):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": p, "max_tokens": 3000, "ignore_eos": True, "stream": True}),
                headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            ev = _events(resp)
            assert "choices" in json.loads(next(ev))  # it is generating
            conns.append(conn)
            streams.append(ev)
        t0 = None
        for ev in streams:
            rest = list(ev)
            t0 = t0 or time.monotonic()
            assert rest[-1] == "[DONE]", rest[-3:]
            err = json.loads(rest[-2])["error"]
            assert "engine stopped" in err["message"] and "fatal" in err["message"], err
        rc = proc.wait(timeout=10)
        assert rc != 0
        assert time.monotonic() - t0 < 10
        errs = proc.stderr.read()
        assert "Traceback" not in errs, errs
        assert re.search(r"exiting: the engine failed: .*injected fatal fault", errs), errs
    finally:
        for c in conns:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
