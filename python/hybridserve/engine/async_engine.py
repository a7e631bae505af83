"""The asyncio front of the engine: one engine thread, many awaiting clients.

The :class:`LLMEngine` is single-threaded and owns the scheduler. ``AsyncEngine`` runs
it on a dedicated thread; coroutines talk to that thread through a command queue
(add, abort) and receive their outputs on per-request streams, a step's outputs handed
to each client event loop as one batch (a :class:`LoopInbox`: one wake-up per loop and
step). ``generate`` reports admission errors (InvalidRequest, QueueFull) to the caller
before anything streams, so the server can answer 4xx/503.

Where the hand-off happens matters more than what it costs. Waking one consumer task
per request on the event loop costs a few microseconds of Python each, and the loop
thread and the engine thread share the GIL: handed over as a step ends, that work ran
while the engine scheduled and prepared the next step, and the engine thread waited for
it (at its first GIL release, the wake-up write or the Rust scheduler, for the loop's
whole burst: a waiting thread asks for the GIL only after ``sys.getswitchinterval()``,
5 ms). So a step's outputs are handed over during the next step, after its inputs are
prepared and just before its model call (``LLMEngine.before_forward``), by a wake-up
that keeps the GIL (see ``loop_inbox``): the loop runs while the engine thread is in
the forward without the GIL (waiting on the GPU; on the CPU, in torch's kernels,
between which it may wait for the loop). When no model call follows (no request left,
nothing scheduled) they are handed over as the step ends, and ``abort_all`` hands them
over before its errors.

The cyclic garbage collector's young generation is collected after 10,000 net
allocations instead of Python's 700 while the engine runs (``gc_young_threshold``):
a decode step makes a few objects per sequence (its delta output, its list, its
text) that the clients still hold when the next step runs, so at 700 a collection
came every step or two and walked every one of them, a cold cache miss per object and
referent after the forward (about 1.3 us per sequence per step at 256 sequences on
the bench model). At 10,000 a collection comes every few steps and finds most of those
outputs already freed by their reference counts.

Text prompts are tokenized on a small thread pool, never on the engine thread: a
many-megabyte prompt must not stall every other request's next token.

Every admitted request is a :class:`RequestStream`; closing it before it finished
(the client went away, the handler was cancelled) aborts the request on the engine
thread at the next step boundary, and its blocks and slot go back to the pools.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.loop_inbox import LoopInbox
from hybridserve.errors import FatalEngineError, HybridServeError, RequestFailed
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

logger = logging.getLogger("hybridserve.engine")


# The garbage collector's generation-0 threshold while an engine runs (see the module's
# docstring); None leaves the process's setting alone.
GC_YOUNG_THRESHOLD = 10_000


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the server must restart."""


class ServerShuttingDown(HybridServeError):
    """The server stopped before the request finished (drain timeout reached)."""

    http_status = 503


class RequestStream:
    """The outputs of one admitted request, as an async iterator.

    ``close()`` aborts the request unless it already finished; call it in a
    ``finally`` so that no exit path (cancellation included) leaves it running.
    """

    # A deque and one waiting future, not an asyncio.Queue: one consumer, and the
    # queue's bookkeeping (getter list, task counts, putters) cost more per output
    # than the wake-up itself (3.1 -> 1.9 us per output with 256 consumers).
    __slots__ = ("engine", "request_id", "_items", "_waiter", "_done")

    def __init__(self, engine: "AsyncEngine", request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False

    def _put(self, item: Any) -> None:
        """On the stream's event loop: an output, or an exception to raise."""
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(item)
                return
        self._items.append(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._items:
            item = self._items.popleft()
        else:
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                item = await w
            except BaseException:
                self._waiter = None
                self.close()
                raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
            if any(c.finish_reason == "error" for c in item.outputs):
                raise _request_failed(item)
        return item

    def _finish(self) -> None:
        self._done = True
        self.engine._streams.pop(self.request_id, None)

    def close(self) -> None:
        if not self._done:
            self._finish()
            self.engine.abort(self.request_id)


def _request_failed(out: RequestOutput) -> RequestFailed:
    """What a client of a request that ended with ``finish_reason == "error"`` gets
    (the server answers it as an OpenAI error object, or an error event on a stream)."""
    return RequestFailed(
        f"request {out.request_id!r} failed: the engine raised in two steps that ran it "
        "(see the server log); the server is still serving, retry the request"
    )


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 tokenizer_threads: int = 2, gc_young_threshold: int | None = GC_YOUNG_THRESHOLD) -> None:
        self.engine = engine
        self.gc_young_threshold = gc_young_threshold
        self.on_step = on_step
        self._commands: queue.Queue[tuple[str, Any, concurrent.futures.Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[LoopInbox, RequestStream]] = {}
        # One inbox per client event loop (made and pruned on that loop's thread).
        self._inboxes: dict[asyncio.AbstractEventLoop, LoopInbox] = {}
        # The last step's outputs, until the next step's model call (or sooner: see
        # the module's docstring). Only the engine thread touches it.
        self._pending: list[RequestOutput] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        # Set by abort_all (shutdown): adds still queued behind it are refused.
        self._closing: BaseException | None = None
        # Set as the engine thread exits (for any reason): queued commands then fail.
        self._thread_done = False
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=tokenizer_threads, thread_name_prefix="hybridserve-tokenize"
        )
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        engine.before_forward = self._hand_off_pending
        gc_set = self._raise_gc_threshold()
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                t0 = time.perf_counter()
                # The previous step's outputs went out before this step's model call;
                # they are still here if it made none (nothing was scheduled).
                self._hand_off_pending()
                self._pending = outputs or None
                if not engine.has_unfinished_requests():
                    # No model call follows: these go out now.
                    self._hand_off_pending()
                # The hand-off to the clients is part of processing the step's outputs.
                handoff = time.perf_counter() - t0
                engine.add_phase_time("process_outputs", handoff)
                engine.last_step_stats["phase_seconds"]["process_outputs"] += handoff
                if self.on_step is not None:
                    self.on_step(engine, outputs)
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            if isinstance(e, FatalEngineError):
                logger.error("engine thread stopped: %s", e)  # the engine logged the cause
            else:
                logger.exception("engine thread died")
            self._dead = e
            self._fail_commands(EngineDeadError(f"engine stopped: {e!r}"))
            try:
                self._hand_off_pending()  # what the engine produced before it failed
            finally:
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError(f"engine stopped: {e!r}"))
        finally:
            self._thread_done = True
            # Nothing queued for a thread that will not read it waits for ever.
            self._fail_commands(EngineDeadError(f"engine stopped: {self._dead!r}" if self._dead is not None
                                                else "engine stopped (shut down)"))
            engine.before_forward = None
            self._hand_off_pending()
            if gc_set is not None and gc.get_threshold()[0] == self.gc_young_threshold:
                # Ours still (nobody changed it since): the process's setting comes back.
                gc.set_threshold(*gc_set)

    def _fail_commands(self, error: BaseException) -> None:
        """Fails every queued command's future with ``error`` (the thread is gone)."""
        while True:
            try:
                _cmd, _arg, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.done():
                try:
                    fut.set_exception(error)
                except concurrent.futures.InvalidStateError:  # resolved meanwhile
                    pass

    def _raise_gc_threshold(self) -> tuple[int, ...] | None:
        """Raises generation 0's threshold to ``gc_young_threshold`` (never lowers it);
        returns the thresholds it replaced, or None if it changed nothing."""
        want = self.gc_young_threshold
        before = gc.get_threshold()
        if want is None or before[0] >= want:
            return None
        gc.set_threshold(want, *before[1:])
        return before

    def _hand_off_pending(self) -> None:
        """The outputs held since the last step to the clients' event loops."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._deliver_all(pending)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, arg, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if cmd == "add":
                    if self._closing is not None:
                        # Queued behind abort_all: admitting it now would run it for
                        # a client that has already been told the server stopped.
                        raise ServerShuttingDown(str(self._closing))
                    result = self.engine.add_request(**arg)
                elif cmd == "abort":
                    if arg in self.engine.requests:
                        self.engine.abort_request(arg)
                    result = None
                elif cmd == "abort_all":
                    # Tell every client first, then free: the error is their last event,
                    # after every output the engine produced.
                    self._hand_off_pending()
                    self._closing = arg
                    running = list(self.engine.requests)
                    for rid in running:
                        self._deliver(rid, arg)
                        self.engine.abort_request(rid)
                    told = set(running)
                    for rid in list(self._streams):  # admitted on the loop, not yet added
                        if rid not in told:
                            self._deliver(rid, arg)
                    result = None
                elif cmd == "call":
                    result = arg(self.engine)
                else:  # pragma: no cover - programming error
                    raise ValueError(cmd)
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                if fut is not None:
                    fut.set_exception(e)
                continue
            except BaseException as e:  # the thread ends: its caller still gets an answer
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDeadError(f"engine stopped: {e!r}"))
                raise
            if fut is not None:
                fut.set_result(result)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        inbox, stream = entry
        try:
            inbox.post([(stream, item)])
        except RuntimeError:  # the client's loop is closed
            self._streams.pop(request_id, None)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up per client event loop (not one per output)."""
        by_inbox: dict[LoopInbox, list[tuple[RequestStream, RequestOutput]]] = {}
        streams = self._streams
        for out in outputs:
            entry = streams.get(out.request_id)
            if entry is not None:
                items = by_inbox.get(entry[0])
                if items is None:
                    by_inbox[entry[0]] = [(entry[1], out)]
                else:
                    items.append((entry[1], out))
        for inbox, items in by_inbox.items():
            try:
                inbox.post(items)
            except RuntimeError:  # the client's loop is closed
                for _, out in items:
                    streams.pop(out.request_id, None)

    def _inbox(self) -> LoopInbox:
        """The running loop's inbox (on that loop's thread)."""
        loop = asyncio.get_running_loop()
        inbox = self._inboxes.get(loop)
        if inbox is None or inbox.closed:
            for old in [lp for lp in self._inboxes if lp.is_closed()]:
                self._inboxes.pop(old).close()
            inbox = self._inboxes[loop] = LoopInbox(loop)
        return inbox

    def _submit(self, cmd: str, arg: Any) -> concurrent.futures.Future:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((cmd, arg, fut))
        self._wake.set()
        if self._dead is not None or self._thread_done:
            # The thread stopped after the check above: it will not read this one.
            self._fail_commands(EngineDeadError(
                f"engine stopped: {self._dead!r}" if self._dead is not None else "engine stopped (shut down)"))
        return fut

    # --------------------------------------------------------------- asyncio API
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (for stats, ...)."""
        return await asyncio.wrap_future(self._submit("call", fn))

    async def run_off_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the tokenizer pool (CPU work that must not stall steps)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        _, ids = await self.run_off_engine(self.engine.tokenize, prompt)
        return ids

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_class: str = "default",
        prompt_logprobs: int | None = None,
    ) -> RequestStream:
        """Admit the request (raising its admission error here); iterate the result
        for its outputs and close it when done."""
        ids = await self.tokenize(prompt)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (self._inbox(), stream)
        try:
            await asyncio.wrap_future(self._submit("add", dict(
                request_id=request_id, prompt=ids, params=params,
                priority=priority, request_class=request_class, prompt_logprobs=prompt_logprobs,
            )))
        except BaseException:
            # Cancelled while the add was queued: the add may still land, so abort too.
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._commands.put(("abort", request_id, None))
            self._wake.set()

    def abort_all(self, error: BaseException) -> None:
        """Abort every request; each stream gets ``error`` as its last item."""
        if self._dead is None:
            self._commands.put(("abort_all", error, None))
            self._wake.set()

    @property
    def num_in_flight(self) -> int:
        """Requests admitted (or being admitted) whose stream is still open."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        for inbox in list(self._inboxes.values()):
            inbox.close()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
