"""Hands batches from the engine thread to one client event loop, waking the loop with a
write that keeps the GIL.

``loop.call_soon_threadsafe`` wakes the loop by a ``socket.send`` on its self-pipe,
and Python releases the GIL around that call. The loop thread wakes at once (Linux
runs a woken thread ahead of the one that woke it), takes the free GIL and runs its
whole burst of consumer tasks, a few microseconds per request, before the engine
thread gets the GIL back: a waiting thread only asks for it after
``sys.getswitchinterval()`` (5 ms), and the burst is shorter. The engine's step waited
for every client's work there. Here the wake-up byte is written by libc's ``write``
called through ``ctypes.PyDLL`` (which does not release the GIL): the loop thread
wakes, finds the GIL held and waits for the engine thread's next release, which the
async engine places at the model call (see ``AsyncEngine``), where the engine thread
waits without the GIL anyway.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
from collections.abc import Callable
from typing import Any


def _write_keeping_gil() -> Callable[[int, bytes, int], int] | None:
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):  # no libc symbols in this process (not POSIX)
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_WRITE = _write_keeping_gil()


class LoopInbox:
    """Batches of ``(receiver, item)`` for one event loop; the loop calls
    ``receiver._put(item)`` for each, in order. Create it on the loop's thread;
    :meth:`post` from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # deque.append / popleft are atomic: the engine thread appends, the loop pops.
        self._batches: collections.deque[list[tuple[Any, Any]]] = collections.deque()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.closed = False
        loop.add_reader(self._r, self._drain)

    def post(self, items: list[tuple[Any, Any]]) -> None:
        """Queue a batch and wake the loop; RuntimeError if the loop is closed."""
        if self.closed or self.loop.is_closed():
            self.close()
            raise RuntimeError("the client's event loop is closed")
        self._batches.append(items)
        # A full pipe (EAGAIN) already holds a pending wake-up; the result is ignored.
        if _WRITE is not None:
            _WRITE(self._w, b"\0", 1)
        else:
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass

    def _drain(self) -> None:
        # Read first, then pop: a batch appended after the last pop comes with a byte
        # written after it, which wakes this again.
        try:
            os.read(self._r, 65536)
        except BlockingIOError:
            pass
        batches = self._batches
        while batches:
            for receiver, item in batches.popleft():
                receiver._put(item)

    def close(self) -> None:
        """Stop listening and close the pipe (from any thread)."""
        if self.closed:
            return
        self.closed = True

        def close_fds() -> None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._r)
                self._drain()  # batches posted before the close still arrive
            os.close(self._r)
            os.close(self._w)

        if self.loop.is_closed():
            close_fds()
            return
        try:
            self.loop.call_soon_threadsafe(close_fds)
        except RuntimeError:  # closed in between
            close_fds()
