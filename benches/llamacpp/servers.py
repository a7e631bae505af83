"""The two servers as child processes: started, waited for, stopped (one at a time,
never both: the machine's cores are the thing measured)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# Per-slot context of llama-server: the workload's longest prompt + output (256 + 96)
# fits; llama-server's -c is the total over its slots.
CTX_PER_SLOT = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.log, "ab")
        f.write(f"\n$ {' '.join(self.cmd)}\n".encode())
        f.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                     start_new_session=True)
        f.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").splitlines()[-25:]
                raise RuntimeError(f"{self.name} exited (code {self.proc.returncode}) while starting:\n"
                                   + "\n".join(tail))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: it and only its children
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def pids(self) -> list[int]:
        """The server's process and its descendants (hybridserve may run helpers)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server's processes now (VmRSS summed; Linux)."""
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
                            break
            except OSError:
                pass
        return total

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def llama_server(exe: Path, gguf: Path, *, parallel: int, threads: int, log: Path,
                 extra: list[str] | None = None) -> Server:
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-c", str(CTX_PER_SLOT * parallel), "-t", str(threads), "-tb", str(threads),
           "--cont-batching", "--metrics", *(extra or [])]
    return Server("llama-server", cmd, log, port=port)


def hybridserve(model_dir: Path, *, dtype: str | None, parallel: int, threads: int, log: Path,
                extra: list[str] | None = None) -> Server:
    """``hybridserve serve`` of a checkpoint directory or a GGUF file; ``dtype`` None
    leaves the compute dtype to the server (a GGUF's weights keep their blocks)."""
    port = free_port()
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", str(model_dir), "--port", str(port),
           *(["--dtype", dtype] if dtype else []), "--max-num-seqs", str(parallel), "--cpu-threads", str(threads),
           "--kv-cache-memory-bytes", "2GiB", "--no-access-log", "--served-model-name", "peer", *(extra or [])]
    return Server("hybridserve", cmd, log, port=port)
