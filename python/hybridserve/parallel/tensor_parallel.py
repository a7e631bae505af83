"""What the engine asks of tensor parallelism, in one object.

:class:`TensorParallel` is created at the top of :class:`LLMEngine` when
``tensor_parallel_size > 1``; the engine calls it at four points and is otherwise
unchanged on every rank:

1. :meth:`start`: join the ranks (torchrun's environment, or start N-1 workers on
   this host and be rank 0), with the shard of the model this rank holds;
2. :meth:`load_model`: this rank's shard (:mod:`hybridserve.parallel.loader`);
3. :meth:`agree_num_pages`: each rank sizes its arena from its own memory and the
   per-rank page layout (:meth:`ShardPlan.local_config`); the ranks take the smallest
   page count, since the one scheduler's page ids must exist on every rank;
4. :meth:`make_runner` / :meth:`attach`: the driver's runner broadcasts each plan;
   a worker, once its engine is built, runs :meth:`serve_steps` until the driver
   shuts down, then its process exits (a worker never returns to the caller's code:
   under torchrun every rank runs the user's command, and only rank 0 goes on).

Failing fast. Every collective before the ready barrier (joining,
:meth:`agree_num_pages`, warm-up, graph capture) runs under the start-up limit; after
it, under the step limit (:mod:`hybridserve.parallel.group`). A step on any rank is
watched (:meth:`_watch_steps`): a worker seen dead during a step, or (NCCL) a step
past the step limit, aborts the process groups (NCCL: a collective blocked on the dead peer
returns with an error, which fails the step); a step that still has not returned a
grace later (a collective replayed by a CUDA graph, which NCCL's own watchdog does
not see, or a backend that cannot abort) ends the process with
:data:`EXIT_TP_STUCK` after one log line naming the cause. A CUDA step ends with a
device synchronisation inside the watched window, so the host never blocks on a dead
peer's collective later, outside it (in ``.tolist()``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.parallel.errors import TensorParallelError
from hybridserve.parallel.group import TPGroup, env_rank, env_world_size, start_timeout_seconds, timeout_seconds
from hybridserve.parallel.launcher import WorkerLauncher, describe_exit
from hybridserve.parallel.shard import ShardPlan

logger = logging.getLogger("hybridserve.parallel")

# Exit status of a process whose step stayed stuck after its process groups were aborted.
EXIT_TP_STUCK = 3
# How long close() waits for the communication lock, and then for the shutdown
# handshake, before it terminates the workers instead.
CLOSE_WAIT_S = 10.0


def rank_device(device: torch.device, local_rank: int, local_world_size: int,
                device_count: int) -> torch.device:
    """This rank's CUDA device: ``cuda:B`` (``--device cuda:B``; plain ``cuda`` is B = 0)
    is the first of the host's ranks, which take ``cuda:B .. cuda:B+L-1`` (local rank r
    on ``cuda:B+r``). A range past the host's devices is refused with what to change."""
    base = device.index or 0
    if base + local_world_size > device_count:
        first = f"cuda:{base}" if device.index is not None else "cuda"
        raise ConfigError(
            f"--device {first} with {local_world_size} tensor-parallel ranks on this host needs "
            f"cuda:{base}..cuda:{base + local_world_size - 1}, but it has {device_count} CUDA device(s)"
            + (f"; give --device cuda:N with N <= {device_count - local_world_size}"
               if device_count >= local_world_size else "; lower --tensor-parallel-size")
            + " (or choose the GPUs with CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", base + local_rank)


class TensorParallel:
    def __init__(self, group: TPGroup, shard: ShardPlan, launcher: WorkerLauncher | None) -> None:
        self.group = group
        self.shard = shard
        self.launcher = launcher
        # A step's (or start-up's) collectives are under way: close() must not send the
        # shutdown message into the middle of them, it terminates the workers instead.
        self.in_step = True
        self.failure: TensorParallelError | None = None
        self.closed = False
        self._lock = threading.Lock()
        # Held by a step and by each heartbeat: the driver's broadcasts stay in order.
        self.comm_lock = threading.RLock()
        self.last_message = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        # When the step now running began on this rank (None between steps): the
        # step watchdog's clock.
        self.step_started: float | None = None
        self._watchdog: threading.Thread | None = None

    # ------------------------------------------------------------------ start-up
    @classmethod
    def start(cls, args: Any, config: ModelConfig, device: torch.device) -> "TensorParallel":
        n = args.tensor_parallel_size
        # Shapes first: a size that does not divide a dimension fails before any process starts.
        rank = env_rank()
        if rank is not None and env_world_size() != n:
            raise ConfigError(
                f"tensor_parallel_size={n} but the torchrun environment has WORLD_SIZE="
                f"{env_world_size()}: launch as many processes as --tensor-parallel-size")
        ShardPlan(config, 0, n)
        launcher = None
        if device.type == "cuda":
            # Before any worker starts: a device range this host lacks is one clear error.
            local = int(os.environ.get("LOCAL_RANK", rank or 0)) if rank is not None else 0
            device = rank_device(device, local, int(os.environ.get("LOCAL_WORLD_SIZE", n)),
                                 torch.cuda.device_count())
        if rank is None:
            rank = 0
            launcher = WorkerLauncher(args, n)
            os.environ.setdefault("LOCAL_RANK", "0")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            if launcher is not None:
                import datetime

                import torch.distributed as dist

                backend = "nccl" if device.type == "cuda" else "gloo"
                # device_id: NCCL's communicator is made now, not lazily by the first
                # collective (which must not happen inside a CUDA graph capture).
                extra = {"device_id": device} if device.type == "cuda" else {}
                dist.init_process_group(backend=backend, init_method=launcher.init_method, rank=0,
                                        world_size=n, timeout=datetime.timedelta(seconds=start_timeout_seconds()),
                                        **extra)
            group = TPGroup(rank, n, device, timeout_seconds())
        except Exception as e:
            tp = cls.__new__(cls)
            tp.launcher, tp.group, tp.closed, tp.in_step = launcher, None, False, False
            err = tp._name_failed(e, "while the ranks were joining")
            if launcher is not None:
                launcher.stop(grace_s=0.0)
            raise err from e
        tp = cls(group, ShardPlan(config, rank, n), launcher)
        if launcher is not None:
            atexit.register(tp.close)
        logger.info("tensor parallel: rank %d of %d on %s (%s)%s", rank, n, device,
                    "gloo" if device.type != "cuda" else "nccl",
                    f"; workers {launcher.pids()}" if launcher else "")
        return tp

    @property
    def is_driver(self) -> bool:
        return self.group.rank == 0

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def local_config(self) -> ModelConfig:
        return self.shard.local_config()

    def cpu_threads(self, requested: int | None) -> int | None:
        """Threads per rank on the CPU: as asked, else this host's cores shared out
        between the ranks on it (N ranks each taking every core would oversubscribe)."""
        if requested or self.device.type != "cpu":
            return requested
        from hybridserve.engine.device import physical_cores

        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.group.world_size))
        return max(1, physical_cores() // max(1, local))

    def load_model(self, model_dir: str, dtype: torch.dtype, device: torch.device, load_mtp: bool = False):
        from hybridserve.parallel.loader import load_sharded_model

        return load_sharded_model(model_dir, self.shard, self.group, dtype=dtype, device=device,
                                  load_mtp=load_mtp)

    def agree_num_pages(self, num_pages: int) -> int:
        # Before the ready barrier: the group still has the start-up limit (ranks that
        # finish loading minutes apart meet here).
        agreed = self.group.min_host(num_pages)
        if agreed != num_pages:
            logger.info("rank %d: %d pages fit here, %d on the smallest rank: using %d",
                        self.group.rank, num_pages, agreed, agreed)
        return agreed

    def make_runner(self, model, cache, **kwargs):
        if self.is_driver:
            from hybridserve.parallel.runner import TensorParallelRunner

            return TensorParallelRunner(model, cache, tp=self, **kwargs)
        from hybridserve.runner.model_runner import ModelRunner

        return ModelRunner(model, cache, **kwargs)

    def attach(self, engine: Any) -> None:
        """Driver: close the ranks when the engine is dropped. Worker: serve the
        driver's steps, then end this process (it never returns)."""
        if self.is_driver:
            try:
                self.group.ready_barrier()
            except Exception as e:
                self.failure = self._name_failed(e, "while starting")
                self.close()
                raise self.failure from e
            weakref.finalize(engine, self.close)
            self.in_step = False  # started: the workers wait for messages from here on
            self.last_message = time.monotonic()
            self._heartbeat = threading.Thread(target=self._beat, name="hybridserve-tp-heartbeat", daemon=True)
            self._heartbeat.start()
            self._start_watchdog()
            return
        code = 0
        try:
            self.group.ready_barrier()
            self._start_watchdog()
            spec = getattr(engine.core, "spec", None)
            self.serve_steps(engine.runner, spec.proposer if spec is not None else None)
        except BaseException:  # noqa: BLE001 - report, then exit non-zero
            logger.exception("tensor-parallel rank %d failed", self.group.rank)
            code = 1
        finally:
            self.group.close()
        # Under torchrun the user's command continues only on rank 0. The process ends
        # here without the interpreter's finalization: its daemon threads (the watchdog)
        # and gloo's own threads are still alive, and tearing down torch's C++ statics
        # under them aborted the worker now and then (SIGABRT after a clean shutdown).
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
                pass
        os._exit(code)

    def serve_steps(self, runner, proposer=None) -> None:
        """A worker's loop: replay each operation the driver broadcasts -- a step, and
        under speculative decoding the step's DeltaNet commit and the drafter's passes
        (``proposer``: this rank's :class:`~hybridserve.spec.proposer.MTPProposer`) --
        so every rank runs the same collectives in the same order. A worker keeps no
        sampler state: what those depend on (accepted rows, the drafter's inputs, its
        draft ids) comes from the driver."""
        from hybridserve.parallel import plan_message

        if proposer is not None:
            proposer.group = self.group
        plan = hidden = None
        while True:
            msg = plan_message.receive(self.group)
            if msg is None:
                return
            with self.watched_step():
                if msg.op == plan_message.OP_STEP:
                    plan = msg.plan
                    runner.want_hidden = msg.want_hidden
                    out = runner.execute(plan, msg.all_positions)
                    hidden = out.hidden if out is not None else None
                elif msg.op == plan_message.OP_COMMIT:
                    runner.commit_speculative(torch.from_numpy(msg.accepted))
                else:  # OP_PROPOSE
                    if proposer is None or hidden is None:
                        raise RuntimeError("the driver asked for draft passes, but this rank "
                                           + ("has no MTP drafter" if proposer is None
                                              else "ran no step that returned hidden states"))
                    runner.propose(proposer, hidden, query_start_loc=plan.query_start_loc,
                                   num_computed=plan.num_computed_tokens, committed=msg.committed,
                                   next_tokens=msg.next_tokens, table_rows=plan.block_table_rows,
                                   num_drafts=msg.num_drafts)
                    hidden = None

    # ------------------------------------------------------------ step watchdog
    def watched_step(self):
        """Context of one step on this rank: the watchdog's clock runs, and on CUDA
        the step ends with a device synchronisation (inside the window, so a
        collective blocked on a dead peer is seen here, not later in ``.tolist()``)."""
        import contextlib

        @contextlib.contextmanager
        def window():
            self.step_started = time.monotonic()
            try:
                yield
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            finally:
                self.step_started = None

        return window()

    def _start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch_steps, name="hybridserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch_steps(self) -> None:
        limit = timeout_seconds()
        period = min(0.25, limit / 8)
        # A whole step past the step limit counts only on NCCL, whose replayed
        # collectives nothing else watches; gloo times out each collective itself,
        # and a long CPU prefill step is slow, not stuck.
        watch_time = self.group is not None and self.group.backend == "nccl"
        while not self.closed:
            time.sleep(period)
            started = self.step_started
            if started is None:
                continue
            dead = dict(self.launcher.dead) if self.launcher is not None else {}
            overdue = watch_time and time.monotonic() - started > limit
            if (dead or overdue) and self.step_started == started:
                self._abort_stuck_step(started, dead)
                return

    def _abort_stuck_step(self, started: float, dead: dict) -> None:
        """A worker died during this rank's step, or the step is past the step limit:
        abort the process groups so the step fails; if it still does not return,
        end the process (a supervisor restarts it)."""
        if dead:
            err = self._name_failed(RuntimeError("worker exited"), "during a step")
        else:
            err = self._name_failed(TimeoutError(f"step running {time.monotonic() - started:.1f}s"), "during a step")
        if self.failure is None:
            self.failure = err
            logger.error("%s", err)
        if self.group is not None and self.group.backend == "nccl":
            self.group.abort()
        grace = min(5.0, max(1.0, timeout_seconds() / 4))
        deadline = time.monotonic() + grace
        while self.step_started == started and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.step_started != started:
            return  # the step failed (or ended): the engine reports it
        logger.critical("tensor-parallel rank %d: %s; the step did not return %.0fs after the process "
                        "groups were aborted: exiting with status %d", self.group.rank, self.failure, grace,
                        EXIT_TP_STUCK)
        for h in logging.getLogger().handlers + logger.handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        if self.launcher is not None:
            self.launcher.stop(grace_s=0.0)
        os._exit(EXIT_TP_STUCK)

    def _beat(self) -> None:
        """Driver, while the engine is idle: an idle message every quarter of the
        collective timeout, so waiting workers do not time out, and a worker that died
        or hung between steps is found (the next step then fails at once)."""
        period = max(0.05, timeout_seconds() / 4)
        while not self.closed and self.failure is None:
            time.sleep(period / 4)
            if time.monotonic() - self.last_message < period:
                continue
            with self.comm_lock:
                if self.closed or self.failure is not None or time.monotonic() - self.last_message < period:
                    continue
                from hybridserve.parallel import plan_message

                try:
                    plan_message.send_idle(self.group)
                    self.last_message = time.monotonic()
                except Exception as e:  # noqa: BLE001 - recorded; the next step raises it
                    self.fault(e, when="while the engine was idle")
                    return

    # ------------------------------------------------------------------- faults
    def check_healthy(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.launcher is not None and self.launcher.dead:
            raise self.fault(RuntimeError("worker exited"))

    def _name_failed(self, error: BaseException, when: str = "during a step") -> TensorParallelError:
        dead = self.launcher.wait_for_death(1.0) if self.launcher is not None else {}
        if dead:
            procs = self.launcher.procs
            what = "; ".join(f"rank {r} (pid {procs[r].pid}) {describe_exit(c)}" for r, c in sorted(dead.items()))
            return TensorParallelError(f"tensor-parallel worker failed {when}: {what} ({error})",
                                       ranks=tuple(sorted(dead)))
        if self.launcher is not None:
            alive = sorted(self.launcher.procs)
            procs = self.launcher.procs
            who = ", ".join(f"rank {r} (pid {procs[r].pid})" for r in alive)
            return TensorParallelError(
                f"tensor-parallel {who} did not answer {when} within the collective timeout "
                f"({timeout_seconds():g}s, ${'HYBRIDSERVE_TP_TIMEOUT'}): hung or unreachable ({error})",
                ranks=tuple(alive))
        return TensorParallelError(f"a tensor-parallel peer of rank {self.group.rank if self.group else '?'} "
                                   f"failed {when} (dead, hung past the collective timeout, or unreachable): {error}")

    def fault(self, error: BaseException, when: str = "during a step") -> TensorParallelError:
        """The engine's error for a failed step (kept: every later step raises it too).
        The surviving workers are stopped: the ranks are out of step for good."""
        if isinstance(error, TensorParallelError):
            self.failure = self.failure or error
        elif self.failure is None:
            self.failure = self._name_failed(error, when)
            logger.error("%s", self.failure)
        # Also when the step watchdog recorded the failure first (it cannot close:
        # the failed step held the communication lock).
        self.close()
        return self.failure

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers and free the ports: a shutdown message when the ranks are
        between steps, else (a failed or interrupted step) terminate them.

        Bounded (``CLOSE_WAIT_S`` for another thread's step or heartbeat to let go of
        the communication lock, as long again for the shutdown handshake): it runs at
        interpreter exit after a Ctrl-C, where waiting out a collective's timeout would
        keep the terminal for minutes. Past either bound the workers are terminated."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        # Not during another thread's step or heartbeat (waits for it; a failed one
        # holding it in this thread re-enters). Without the lock no message may go
        # out: it would land in the middle of that thread's collectives.
        locked = self.comm_lock.acquire(timeout=CLOSE_WAIT_S) if hasattr(self, "comm_lock") else False
        orderly = stuck = False
        try:
            if (locked and self.group is not None and self.is_driver and self.failure is None
                    and not self.in_step):
                orderly, stuck = self._send_shutdown(CLOSE_WAIT_S)
        finally:
            if locked:
                self.comm_lock.release()
        if self.launcher is not None:
            self.launcher.stop(grace_s=5.0 if orderly else 0.0)
        # After a handshake that did not finish, a thread is still inside a collective
        # of this group; tearing the group down under it can block, and the process
        # is ending anyway.
        if self.group is not None and not stuck:
            self.group.close()

    def _send_shutdown(self, seconds: float) -> tuple[bool, bool]:
        """The shutdown message and the ranks' last barrier, given ``seconds``:
        ``(every worker took it, the handshake is still blocked)``."""
        from hybridserve.parallel import plan_message

        done = threading.Event()

        def handshake() -> None:
            try:
                plan_message.send_shutdown(self.group)
                done.set()
            except Exception:  # noqa: BLE001 - a worker already gone: stop() ends the rest
                pass

        t = threading.Thread(target=handshake, name="hybridserve-tp-shutdown", daemon=True)
        t.start()
        t.join(seconds)
        if t.is_alive():
            logger.warning("tensor parallel: the workers did not take the shutdown message within %.0fs; "
                           "terminating them", seconds)
        return done.is_set(), t.is_alive()
