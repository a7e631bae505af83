"""The asyncio front of the engine: one engine thread, many awaiting clients.

The :class:`LLMEngine` is single-threaded and owns the scheduler. ``AsyncEngine`` runs
it on a dedicated thread; coroutines talk to that thread through a command queue
(add, abort) and receive their outputs on per-request ``asyncio.Queue``s filled with
``loop.call_soon_threadsafe``. ``add`` reports admission errors (InvalidRequest,
QueueFull) to the caller before anything streams, so the server can answer 4xx/503.

A request whose client goes away is aborted on the engine thread at the next step
boundary; its blocks and slot go back to the pools.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

logger = logging.getLogger("hybridserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the server must restart."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.Queue[tuple[str, Any, concurrent.futures.Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
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
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
                for out in outputs:
                    self._deliver(out.request_id, out)
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
                    result = self.engine.add_request(**arg)
                elif cmd == "abort":
                    if arg in self.engine.requests:
                        self.engine.abort_request(arg)
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

    def _submit(self, cmd: str, arg: Any) -> concurrent.futures.Future:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((cmd, arg, fut))
        self._wake.set()
        return fut

    # --------------------------------------------------------------- asyncio API
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (for stats, tokenization, ...)."""
        return await asyncio.wrap_future(self._submit("call", fn))

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_class: str = "default",
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request (raising its admission error here), then yield outputs."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        try:
            await asyncio.wrap_future(self._submit("add", dict(
                request_id=request_id, prompt=prompt, params=params,
                priority=priority, request_class=request_class,
            )))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._stream(request_id, q)

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # client went away or the consumer stopped early
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._commands.put(("abort", request_id, None))
            self._wake.set()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
