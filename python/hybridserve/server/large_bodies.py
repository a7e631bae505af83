"""Large response bodies (logprobs, echo: tens of MB of JSON for a 32K-token echo with
20 logprobs) built without stalling the event loop's other streams.

The server (:mod:`hybridserve.server.app`) builds a body here when it may be large: a
slice of positions at a time (:class:`hybridserve.server.protocol.LazyLogprobs`,
:func:`~hybridserve.server.protocol.json_pieces`), off the loop, with a short GIL
switch interval while it runs, written in chunks. ``benches/echo_stall.py`` compares
the modes side by side (numbers in benches/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from typing import Any

from hybridserve.server import protocol


def dumps_yielding(obj: Any, slice_len: int = 512) -> str:
    """``json.dumps(obj)``, the same text, encoded a slice of each long list at a time.
    The C encoder holds the GIL for a whole call (a second for tens of MB), so on any
    thread one call would stall the event loop that long; slices of a few hundred
    entries let the GIL switch every few milliseconds."""
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps_yielding(v, slice_len)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list):
        if len(obj) <= 64 and any(isinstance(x, (dict, list)) for x in obj[:1]):
            return "[" + ", ".join(dumps_yielding(x, slice_len) for x in obj) + "]"
        if len(obj) > slice_len:
            return "[" + ", ".join(json.dumps(obj[i:i + slice_len])[1:-1] for i in range(0, len(obj), slice_len)) + "]"
    return json.dumps(obj)


# How a large body (logprobs, echo) is built (benches/echo_stall.py compares them side
# by side; see benches/RESULTS.md):
# * "sliced-thread" (the default): its logprobs blocks are built and encoded a slice of
#   positions at a time (protocol.LazyLogprobs) on the tokenizer pool, which lets go of
#   the GIL every LARGE_BODY_SLICE_S (the loop, waiting for it, gets it then instead of
#   a whole switch interval later); then written in chunks, each write waiting for the
#   socket.
# * "sliced-loop": the same slices on the event loop itself, every other ready callback
#   run between slices.
# * "thread": the whole body built in one call on the tokenizer pool (a third thread
#   competing for the GIL: the loop waits whole switch intervals behind it).
# * "loop": the whole body in one call on the loop (what every stream then waits).
LARGE_BODY_MODE = "sliced-thread"
LARGE_BODY_SLICE_S = 0.002
# Bytes per write of a large body.
LARGE_BODY_CHUNK = 1 << 18
# The GIL's switch interval while a large body is built on the pool (None: leave it).
# A thread that wants the GIL (the engine thread after each native kernel, the loop after
# each poll) otherwise waits up to the default 5 ms for the builder to be made to drop
# it, several times per engine step: the neighbours' steps stretched by tens of ms.
LARGE_BODY_SWITCH_S: float | None = 0.0005
_switch_lock = threading.Lock()
_switch_users = [0, 0.0]  # builders running, the interval before the first


@contextlib.contextmanager
def short_switch_interval() -> Any:
    if LARGE_BODY_SWITCH_S is None:
        yield
        return
    with _switch_lock:
        if _switch_users[0] == 0:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(LARGE_BODY_SWITCH_S, _switch_users[1]))
        _switch_users[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


def chunks(pieces: Any) -> Any:
    """The pieces (protocol.json_pieces) as encoded chunks of about LARGE_BODY_CHUNK
    bytes, and None at each slice's end (where the consumer may hand the thread over)."""
    buf: list[str] = []
    size = 0
    for p in pieces:
        if not p:
            yield None
            continue
        buf.append(p)
        size += len(p)
        if size >= LARGE_BODY_CHUNK:
            yield "".join(buf).encode()
            buf, size = [], 0
    if buf:
        yield "".join(buf).encode()


async def encode_sliced(run_off: Any, body: dict[str, Any]) -> list[bytes]:
    """``json.dumps(body).encode()`` as chunks, built a slice at a time (LARGE_BODY_MODE);
    ``run_off(fn)`` awaits ``fn()`` on the tokenizer pool (the "sliced-thread" mode)."""
    gen = chunks(protocol.json_pieces(body))
    out: list[bytes] = []
    if LARGE_BODY_MODE == "sliced-thread":
        def run() -> list[bytes]:
            with short_switch_interval():
                t0 = time.perf_counter()
                for c in gen:
                    if c is not None:
                        out.append(c)
                    elif time.perf_counter() - t0 >= LARGE_BODY_SLICE_S:
                        # A sleep lets go of the GIL long enough for a waiting thread (the
                        # loop) to take it; a bare release is retaken by this thread at once.
                        time.sleep(0.0002)
                        t0 = time.perf_counter()
            return out

        return await run_off(run)
    # On the loop: the generator runs until a slice's time is spent, then every other
    # ready callback (the neighbours' tokens) gets its turn.
    t0 = time.perf_counter()
    for c in gen:
        if c is not None:
            out.append(c)
        elif time.perf_counter() - t0 >= LARGE_BODY_SLICE_S:
            await asyncio.sleep(0)
            t0 = time.perf_counter()
    return out


async def off_loop_if_large(run_off: Any, build: Any, large: bool) -> bytes:
    """``build()`` on the tokenizer pool when the body may be large (logprobs and echo:
    a 32K-token echo with 20 logprobs is tens of MB of JSON, built and encoded in
    hundreds of ms), so every other stream on this loop keeps getting its tokens; the
    build then holds the GIL only a switch interval at a time. Small bodies inline."""
    if large and LARGE_BODY_MODE != "loop":
        return await run_off(build)
    return build()
