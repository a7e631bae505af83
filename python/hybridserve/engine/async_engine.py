"""The asyncio front of the engine: one engine thread, many awaiting clients.

The :class:`LLMEngine` is single-threaded and owns the scheduler. ``AsyncEngine`` runs
it on a dedicated thread; coroutines talk to that thread through a command queue
(add, abort) and receive their outputs on per-request ``asyncio.Queue``s filled with
``loop.call_soon_threadsafe``. ``generate`` reports admission errors (InvalidRequest,
QueueFull) to the caller before anything streams, so the server can answer 4xx/503.

Text prompts are tokenized on a small thread pool, never on the engine thread: a
many-megabyte prompt must not stall every other request's next token.

Every admitted request is a :class:`RequestStream`; closing it before it finished
(the client went away, the handler was cancelled) aborts the request on the engine
thread at the next step boundary, and its blocks and slot go back to the pools.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.errors import HybridServeError
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

logger = logging.getLogger("hybridserve.engine")


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


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

    def __init__(self, engine: "AsyncEngine", request_id: str, q: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._q = q
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._q.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def _finish(self) -> None:
        self._done = True
        self.engine._streams.pop(self.request_id, None)

    def close(self) -> None:
        if not self._done:
            self._finish()
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 tokenizer_threads: int = 2) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.Queue[tuple[str, Any, concurrent.futures.Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        # Set by abort_all (shutdown): adds still queued behind it are refused.
        self._closing: BaseException | None = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=tokenizer_threads, thread_name_prefix="hybridserve-tokenize"
        )
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                t0 = time.perf_counter()
                self._deliver_all(outputs)
                # The hand-off to the clients is part of processing the step's outputs.
                handoff = time.perf_counter() - t0
                self.engine.add_phase_time("process_outputs", handoff)
                self.engine.last_step_stats["phase_seconds"]["process_outputs"] += handoff
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine thread died")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine stopped: {e!r}"))

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
                    # Tell every client first, then free: the error is their last event.
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
            if fut is not None:
                fut.set_result(result)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the client's loop is closed
            self._streams.pop(request_id, None)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up per client event loop (not one per output:
        each ``call_soon_threadsafe`` writes to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        streams = self._streams
        for out in outputs:
            entry = streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the client's loop is closed
                for q, out in items:
                    self._streams.pop(out.request_id, None)

    def _submit(self, cmd: str, arg: Any) -> concurrent.futures.Future:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((cmd, arg, fut))
        self._wake.set()
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
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        stream = RequestStream(self, request_id, q)
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
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
