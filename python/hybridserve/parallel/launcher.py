"""Starting the workers of a one-host tensor-parallel engine, watching them, stopping them.

The driver process is rank 0 and computes its shard like every other rank: it is the
process that holds the scheduler and samples, and a driver that only scheduled would
idle through every forward (on the CPU it would also take a core from the model);
so N ranks are N model shards, and the engine starts N-1 workers.

Workers are plain subprocesses (``python -m hybridserve.parallel.worker``), given the
torchrun environment variables and the engine's arguments as JSON: the same entry
as under ``torchrun``, and no fork of a process holding threads, a Rust runtime or
a CUDA context. Each worker asks the kernel to kill it when the driver dies
(``PR_SET_PDEATHSIG``) and ignores SIGINT (a Ctrl-C reaches the whole terminal's
process group; the driver decides). A monitor thread notes a worker's death at once,
so the next step fails with an error naming the rank instead of waiting out a
collective's timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

ARGS_ENV = "HYBRIDSERVE_TP_ENGINE_ARGS"
DRIVER_PID_ENV = "HYBRIDSERVE_TP_DRIVER_PID"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class WorkerLauncher:
    """Ranks 1..N-1 as child processes of the driver."""

    def __init__(self, engine_args, world_size: int, host: str = "127.0.0.1") -> None:
        self.world_size = world_size
        self.host = host
        self.port = free_port(host)
        self.procs: dict[int, subprocess.Popen] = {}
        # rank -> exit code, as soon as the monitor sees it.
        self.dead: dict[int, int] = {}
        self._stopping = False
        args_json = json.dumps(asdict(engine_args))
        for rank in range(1, world_size):
            env = dict(os.environ)
            env.update(MASTER_ADDR=host, MASTER_PORT=str(self.port), WORLD_SIZE=str(world_size),
                       RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
            env[ARGS_ENV] = args_json
            env[DRIVER_PID_ENV] = str(os.getpid())
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "hybridserve.parallel.worker"], env=env, stdin=subprocess.DEVNULL)
        self._monitor = threading.Thread(target=self._watch, name="hybridserve-tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def _watch(self) -> None:
        while not self._stopping:
            for rank, p in self.procs.items():
                code = p.poll()
                if code is not None and rank not in self.dead:
                    self.dead[rank] = code
            time.sleep(0.05)

    def wait_for_death(self, seconds: float) -> dict[int, int]:
        """The workers that have exited, waiting up to ``seconds`` for one to (a
        collective usually fails a moment before the monitor sees the exit)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for rank, p in self.procs.items():
                code = p.poll()
                if code is not None:
                    self.dead.setdefault(rank, code)
            if self.dead:
                break
            time.sleep(0.02)
        return dict(self.dead)

    def stop(self, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` for the workers to exit, then terminate, then kill."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig_fn in (lambda p: p.terminate(), lambda p: p.kill()):
            alive = [p for p in self.procs.values() if p.poll() is None]
            if not alive:
                break
            for p in alive:
                sig_fn(p)
            for p in alive:
                try:
                    p.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
