"""The ranks of one tensor-parallel model and the collectives between them.

Two process groups over the same ranks:

* the **model group** carries the forward's collectives (all-reduce after each mixer
  and each MLP/MoE block, the embedding's all-reduce, the LM head's gather): NCCL on
  CUDA, gloo on the CPU;
* the **control group** (always gloo, host tensors) carries the driver's per-step plan
  broadcast and start-up agreements: the plan is built on the host and a CPU
  broadcast needs no device synchronisation (vLLM keeps the same split).

Every collective has a timeout: until the ready barrier (joining, agreeing on the
arena, loading, warm-up and graph capture) the start-up limit
(``HYBRIDSERVE_TP_START_TIMEOUT``, default 300 s: ranks that finish loading a large
model minutes apart are slow, not dead), then the step limit
(``HYBRIDSERVE_TP_TIMEOUT`` seconds, default 60): a dead or hung peer raises instead
of hanging the engine. Collectives that CUDA graphs replay are watched by
:class:`~hybridserve.parallel.tensor_parallel.TensorParallel`'s step watchdog, not
by NCCL's. Ranks come from the
torchrun environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``), set by torchrun or by :mod:`hybridserve.parallel.launcher` for the
workers it starts itself.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridserve.errors import ConfigError

TIMEOUT_ENV = "HYBRIDSERVE_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
# Joining waits for every rank to import torch and start (minutes on a loaded host):
# its own, longer limit, so a short step timeout does not fail a slow start.
START_TIMEOUT_ENV = "HYBRIDSERVE_TP_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 300.0
_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def env_rank() -> int | None:
    """This process's rank under torchrun (or a launcher that set the same variables);
    None when the torchrun variables are absent."""
    if not all(k in os.environ for k in _ENV):
        return None
    return int(os.environ["RANK"])


def env_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if env_rank() is not None else None


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"${env} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"${env} must be positive, got {raw!r}")
    return value


def timeout_seconds() -> float:
    """Limit of every collective once the ranks have joined."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def start_timeout_seconds() -> float:
    """Limit of the ranks' rendezvous at start-up."""
    return _seconds(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)


@dataclass
class CommStats:
    """Time and bytes the forward's collectives and the plan broadcast cost (this rank)."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [seconds, bytes, calls]

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        self.seconds += seconds
        self.bytes += nbytes
        self.calls += 1
        k = self.by_kind.setdefault(kind, [0.0, 0, 0])
        k[0] += seconds
        k[1] += nbytes
        k[2] += 1

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        self.by_kind.clear()


class TPGroup:
    """This process's place among the ranks, and the collectives it takes part in."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.stats = CommStats()
        # Timing each collective needs a device sync on CUDA; only when asked (bench).
        self.measure = False
        # Everything before the ready barrier runs under the start-up limit; `started()`
        # switches both groups to the step limit.
        timeout = datetime.timedelta(seconds=start_timeout_seconds())
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.backend = backend
        if not dist.is_initialized():
            kwargs = {}
            if device.type == "cuda":
                # Lets NCCL bind its communicator eagerly to this rank's device.
                kwargs["device_id"] = device
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=start_timeout_seconds()), **kwargs)
        self.model_group = dist.new_group(backend=backend, timeout=timeout) if backend != "gloo" else None
        self.control_group = dist.new_group(backend="gloo", timeout=timeout)
        if backend == "gloo":
            self.model_group = self.control_group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- model collectives (inside the forward) -----------------------------------
    def all_reduce(self, x: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (and returned)."""
        t0 = time.perf_counter() if self._timing() else 0.0
        dist.all_reduce(x, group=self.model_group)
        if t0:
            self._sync()
            self.stats.add(kind, time.perf_counter() - t0, x.numel() * x.element_size())
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``x`` concatenated along the last dim (the LM head's
        vocabulary shards, in vocabulary order); other ranks: their own ``x``.

        Only the driver samples, so on gloo the shards are *gathered* to rank 0 (1/N of
        an all-gather's bytes and no copy on the workers). On NCCL it is an all-gather
        into one tensor instead: one collective kernel, which CUDA graphs capture like
        the all-reduces (NCCL's gather is N-1 grouped point-to-point sends), and at
        decode sizes (``[B, V/N]``) the extra bytes are small next to the step.
        (The NCCL choice is written, not yet run on GPUs.)"""
        t0 = time.perf_counter() if self._timing() else 0.0
        x = x.contiguous()
        if self.device.type == "cuda":
            flat = torch.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(flat, x, group=self.model_group)
            out = torch.cat(flat.unbind(0), dim=-1)
        elif self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.gather(x, parts, dst=0, group=self.model_group)
            out = torch.cat(parts, dim=-1)
        else:
            dist.gather(x, None, dst=0, group=self.model_group)
            out = x
        if t0:
            self._sync()
            self.stats.add("gather_logits", time.perf_counter() - t0, x.numel() * x.element_size())
        return out

    def _timing(self) -> bool:
        # Timing syncs the device: never inside a CUDA graph capture.
        return self.measure and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- control collectives (host tensors) -------------------------------------
    def broadcast_host(self, x: torch.Tensor, kind: str = "plan") -> torch.Tensor:
        t0 = time.perf_counter() if self.measure else 0.0
        dist.broadcast(x, src=0, group=self.control_group)
        if self.measure:
            self.stats.add(kind, time.perf_counter() - t0, x.numel() * x.element_size())
        return x

    def ready_barrier(self) -> None:
        """Every rank has built its engine: from here on steps run under the (short)
        collective timeout; until here the start-up limit applies (a worker still
        allocating its arena on a loaded host is slow, not hung). gloo's monitored
        barrier names the ranks that did not arrive."""
        dist.monitored_barrier(group=self.control_group,
                               timeout=datetime.timedelta(seconds=start_timeout_seconds()))
        self.started()

    def started(self) -> None:
        """Past the ready barrier: every later collective has the step limit."""
        step = datetime.timedelta(seconds=self.timeout_s)
        for g in {id(self.control_group): self.control_group, id(self.model_group): self.model_group}.values():
            dist.set_timeout(step, g)

    def current_timeout_s(self, which: str = "control") -> float:
        """The limit the group's next collective runs under (tests, logs)."""
        g = self.control_group if which == "control" else self.model_group
        return g._get_backend(torch.device(self.device.type)).options._timeout.total_seconds()

    def abort(self) -> None:
        """Abort the groups so a collective blocked on a dead peer returns (NCCL:
        ncclCommAbort; a no-op where the backend cannot, the caller then ends the
        process)."""
        from torch.distributed import distributed_c10d as c10d

        for g in (self.model_group, self.control_group):
            try:
                c10d._abort_process_group(g)
            except Exception:  # noqa: BLE001 - gloo cannot abort; the watchdog exits instead
                pass

    def min_host(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def leave(self) -> None:
        """A barrier of the orderly shutdown. gloo's broadcast returns on the root
        once its data is sent: a driver destroying its process group right after the
        shutdown message closed connections that the worker was still reading, and
        the worker aborted at exit now and then (std::terminate in gloo). After this
        barrier no rank has a message in flight to another."""
        try:
            dist.barrier(group=self.control_group)
        except Exception:  # noqa: BLE001 - a peer already gone: close() ends the rest
            pass

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer already gone must not stop shutdown
                pass
