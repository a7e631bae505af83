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


def _waiting_driver(tp_dirs) -> tuple[subprocess.Popen, dict]:
    """A TP=2 driver that has served one request and now waits for a signal, in a
    process group of its own; faulthandler makes it print every thread's stack on
    SIGABRT (what _wait_or_dump sends one that does not end)."""
    proc = subprocess.Popen([sys.executable, SHUTDOWN_SCRIPT, tp_dirs["dense-gqa"], "wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    return proc, json.loads(proc.stdout.readline())


def _wait_or_dump(proc: subprocess.Popen, seconds: float, what: str) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the driver did not end within {seconds:g} s of {what}; its threads:\n{err[-8000:]}")


def _nothing_left(info: dict) -> None:
    assert _wait_gone(info["worker_pid"])
    assert _port_free(info["port"])


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_driver_leaves_no_process_and_no_port(sig, tp_dirs):
    proc, info = _waiting_driver(tp_dirs)
    try:
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the whole foreground process group
        else:
            proc.send_signal(sig)
        _wait_or_dump(proc, 60, sig.name)
        _nothing_left(info)
    finally:
        _kill_group(proc)


def test_ctrl_c_with_a_frozen_worker_ends_promptly_and_leaves_nothing_behind(tp_dirs):
    """A worker that no longer answers (stopped here with SIGSTOP) cannot take the
    shutdown message: the driver's exit terminates it after close()'s bounded wait
    (tensor_parallel.CLOSE_WAIT_S), instead of waiting out the collective timeout."""
    proc, info = _waiting_driver(tp_dirs)
    try:
        os.kill(info["worker_pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _wait_or_dump(proc, 45, "Ctrl-C")
        took = time.monotonic() - t0
        err = proc.stderr.read()
        assert took < 35, f"{took:.1f}s"
        assert "did not take the shutdown message" in err, err[-3000:]
        _nothing_left(info)
    finally:
        _kill_group(proc)
        try:
            os.kill(info["worker_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_slow_rank_before_the_ready_barrier_is_under_the_start_limit(tp_dirs, tmp_path):
    """Rank 1 reaches agree_num_pages 12 s late, with a 2 s step limit:
    start-up collectives run under the start-up limit, so the engine starts; then
    every collective has the step limit."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import time\n"
        "    import hybridserve.parallel.tensor_parallel as tp\n"
        "    real = tp.TensorParallel.agree_num_pages\n"
        "    def slow(self, n):\n"
        "        time.sleep(12)\n"
        "        return real(self, n)\n"
        "    tp.TensorParallel.agree_num_pages = slow\n")
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT="2", HYBRIDSERVE_TP_START_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join([str(hook)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, SCRIPT, tp_dirs["dense-gqa"], "timeouts"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"control": 2.0, "model": 2.0, "tokens": 4}, out


def test_a_step_stuck_after_a_worker_death_ends_the_process(tp_dirs):
    """The driver's step blocks where no collective error can reach it and its
    worker dies: the step watchdog exits the process with EXIT_TP_STUCK, one line
    naming the rank, within the step limit plus its grace."""
    from hybridserve.parallel.tensor_parallel import EXIT_TP_STUCK

    limit = 3.0
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT=str(limit))
    proc = subprocess.Popen([sys.executable, SCRIPT, tp_dirs["dense-gqa"], "stuck"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        killed = json.loads(line)
        code = proc.wait(timeout=60)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert code == EXIT_TP_STUCK, (code, err[-3000:])
    # Seen dead at once (the launcher's monitor), then at most 5 s of grace; loose
    # for a loaded machine, far below any collective's start-up limit.
    assert ended - killed["killed_at"] < limit + 5 + 10, ended - killed["killed_at"]
    lines = [ln for ln in err.splitlines() if "exiting with status" in ln]
    assert len(lines) == 1 and "rank 1" in lines[0] and "SIGKILL" in lines[0], err[-3000:]
    assert _wait_gone(killed["worker_pid"])


def test_worker_killed_mid_speculation_fails_the_requests_and_leaves_nothing_behind(tp_dirs):
    # Speculative decoding (k=3): the worker dies inside a step's chained draft passes,
    # after the verify forward and the DeltaNet commit, as the driver broadcasts a
    # pass's draft ids. The step fails with the error naming the rank, every open
    # request ends with an error, and later steps raise the same error.
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT="4")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, SCRIPT, tp_dirs["dense-gqa"], "spec-kill"], env=env,
                          capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    err = out["error"]
    assert err is not None, out
    assert out["steps"] >= 2 and out["drafted"] > 0, out  # killed mid-generation, while drafting
    assert err["ranks"] == [1] and "rank 1" in err["message"] and "SIGKILL" in err["message"], err
    assert out["again"] == err["message"]
    assert not out["unfinished"] and out["errored"] == 2, out
    assert elapsed < 120
    deadline = time.monotonic() + 5
    while _alive(out["worker_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(out["worker_pid"])
    assert _port_free(out["port"])
