"""``hybridserve serve --tensor-parallel-size 2`` as a process: it serves; when a
worker dies, requests get 503, the server exits non-zero and leaves no worker behind."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_serve_tp2_answers_then_fails_with_503_and_exits_nonzero_when_a_worker_dies(tp_dirs):
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", tp_dirs["dense-gqa"], "--port", "0",
           "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu", "--num-pages", "64",
           "--cpu-threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(m.group(1))
        status, body = _post(port, {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        workers = [c for c in _children(proc.pid) if "hybridserve.parallel.worker" in
                   open(f"/proc/{c}/cmdline").read().replace("\0", " ")]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(0.5)
        status, body = _post(port, {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0})
        assert status == 503, body
        assert "rank 1" in json.dumps(body), body
        code = proc.wait(timeout=60)
        assert code != 0
        assert _gone(workers[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
