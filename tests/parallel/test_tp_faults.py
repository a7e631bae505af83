"""A worker that dies or hangs mid-generation: the engine fails fast with an error
naming the rank, and the process exits leaving no worker and no port behind. And the
ordinary ends (the LLM dropped, SIGTERM, Ctrl-C) leave nothing behind either."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "tp_fault_script.py")
SHUTDOWN_SCRIPT = os.path.join(os.path.dirname(__file__), "tp_shutdown_script.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; /proc tells which.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _port_free(port: int) -> bool:
    """No process listens on ``port`` (SO_REUSEADDR, as any server binds: connections
    the kernel keeps in TIME_WAIT for a minute do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_worker_failure_names_the_rank_and_leaves_nothing_behind(how, tp_dirs):
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT="4")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, SCRIPT, tp_dirs["dense-gqa"], how], env=env,
                          capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    err = out["error"]
    assert err is not None, out
    assert out["steps"] >= 3, out  # it failed after the worker was stopped, not before
    assert err["ranks"] == [1]
    assert "rank 1" in err["message"], err
    if how == "kill":
        assert "SIGKILL" in err["message"], out
    else:
        assert "did not answer" in err["message"] and "timeout" in err["message"], out
    assert out["again"] == err["message"]
    # No silent hang: well under the collective timeout plus start-up (loose on a busy CI box).
    assert elapsed < 120
    # Nothing left behind: the worker is gone and the rendezvous port is free again.
    deadline = time.monotonic() + 5
    while _alive(out["worker_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(out["worker_pid"])
    assert _port_free(out["port"])


def test_a_driver_failing_at_start_stops_its_worker_at_once(tp_dirs):
    # A start-up timeout far longer than the test allows: only an explicit stop ends
    # the worker in time.
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT="120", HYBRIDSERVE_TP_START_TIMEOUT="300")
    proc = subprocess.run([sys.executable, SCRIPT, tp_dirs["dense-gqa"], "driver-start"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "tokenizer broken on the driver", out
    assert out["seconds"] < 100, out
    # The worker had exited within 10 s while its driver process still lived.
    assert out["worker_exit"] is not None, "the worker outlived its driver's failed start"
    assert _port_free(out["port"])


def test_an_idle_engine_outlives_the_collective_timeout(tp_dirs):
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT="3")
    proc = subprocess.run([sys.executable, SCRIPT, tp_dirs["dense-gqa"], "idle"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "failure": "None"}


def _wait_gone(pid: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_dropping_the_llm_stops_the_worker(tp_dirs):
    proc = subprocess.run([sys.executable, SHUTDOWN_SCRIPT, tp_dirs["dense-gqa"], "drop"], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["worker_exit"] == 0  # told to shut down, and exited cleanly, while the script still ran
    assert _wait_gone(info["worker_pid"])
    assert _port_free(info["port"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_driver_leaves_no_process_and_no_port(sig, tp_dirs):
    proc = subprocess.Popen([sys.executable, SHUTDOWN_SCRIPT, tp_dirs["dense-gqa"], "wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the whole foreground process group
        else:
            proc.send_signal(sig)
        proc.wait(timeout=60)
        assert _wait_gone(info["worker_pid"])
        assert _port_free(info["port"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
