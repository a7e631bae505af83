"""The HTTP connection layer under the app: aiohttp's, with two behaviours changed.

* **Half-close.** HTTP lets a client send its request and shut its sending side
  (``SHUT_WR``) while it waits for the answer. asyncio closes a transport whose peer
  sent EOF unless the protocol's ``eof_received`` returns True, and aiohttp's returns
  None: the request was cancelled and its handler logged a traceback. Here the request
  already received is answered, then the connection is closed. A FIN looks the same
  whether the client half-closed or closed entirely, and only a write tells them
  apart (a closed socket answers it with a reset): :attr:`peer_eof` is set so that a
  handler with a long answer to compute can write early and find out (the app starts
  a non-streamed answer's chunked body with whitespace, which JSON allows).
* **Requests aiohttp's parser rejects** (a bad Content-Length, a 100 KB header, a
  garbage request line, an HTTP/2 preface, ...) are answered in the API's error shape,
  ``{"error": {...}}`` JSON, and logged as one WARNING line that names the problem
  but not the client's bytes (aiohttp answers in plain text and logs an ERROR with a
  traceback quoting them).

:class:`AppRunner` is aiohttp's runner serving its connections with
:class:`_RequestHandler`; ``serve_app`` uses it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from hybridserve.server import protocol

logger = logging.getLogger("hybridserve.server")

# Set on a request that the parser rejected: the access log leaves it to the WARNING.
REJECTED_KEY = web.RequestKey("hybridserve_rejected", bool)


def describe_rejection(exc: BaseException) -> str:
    """What was wrong with a request the HTTP parser refused, in words that quote none
    of its bytes (they go to the log and back to a client that may be a browser)."""
    text = str(getattr(exc, "message", "") or "")
    if "PRI" in text and "Upgrade" in text:
        return "HTTP/2 is not supported on this port; send HTTP/1.1"
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the"
        return f"a request line or header is longer than the server's limit of {limit} bytes"
    if isinstance(exc, BadHttpMethod):
        return "the request does not start with an HTTP method (is this HTTP?)"
    if isinstance(exc, BadStatusLine):
        return "the request line is malformed"
    if isinstance(exc, InvalidHeader):
        return "a request header is malformed"
    if isinstance(exc, InvalidURLError):
        return "the request target is not a valid URL"
    if isinstance(exc, (ContentLengthError, TransferEncodingError)):
        return "the request body does not match its Content-Length or chunked framing"
    if isinstance(exc, ContentEncodingError):
        return "the request body cannot be decoded per its Content-Encoding"
    # llhttp's reasons are fixed phrases ("Invalid character in Content-Length"); the
    # lines after the first quote the client's bytes.
    first = text.split("\n", 1)[0].strip().rstrip(":")
    if first and len(first) <= 80 and not any(q in first for q in ("'", '"', "\\")):
        return f"malformed HTTP request: {first}"
    return "malformed HTTP request"


def peer_eof(request: Any) -> "asyncio.Event | None":
    """Set once the client sent EOF on this request's connection (None when the
    connection is not served by :class:`AppRunner`, e.g. under aiohttp's test server)."""
    return getattr(request.protocol, "peer_eof", None)


class _RequestHandler(RequestHandler):
    _last_payload: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer_eof = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # The body reader of the newest request: at EOF it may already be off the
        # queue and not yet on a running handler.
        if self._messages:
            self._last_payload = self._messages[-1][1]

    def eof_received(self) -> bool:
        waiting = self._waiter is not None and not self._waiter.done()
        if waiting and not self._messages:
            return False  # an idle keep-alive connection: nothing to answer, close it
        # A request is being (or about to be) handled: answer it, then close. A body
        # still arriving will not complete; the parser's EOF ends its reader.
        self._close = True
        self.peer_eof.set()
        if self._parser is not None:
            try:
                self._parser.feed_eof()
            except HttpProcessingError as exc:  # the body is short of its Content-Length
                if self._last_payload is not None:
                    self._last_payload.set_exception(exc)
        return True

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            status = exc.code if 400 <= (exc.code or 0) < 500 else 400
            text = describe_rejection(exc)
            try:
                peer = request.remote
            except Exception:  # noqa: BLE001 - a transport already gone
                peer = None
            logger.warning("rejected a malformed HTTP request from %s: %s", peer or "?", text)
            err_type = "invalid_request_error"
        else:
            status = 500
            text = "internal error"
            logger.error("internal error handling a request", exc_info=exc)
            err_type = "internal_server_error"
        try:
            request[REJECTED_KEY] = True
        except Exception:  # noqa: BLE001
            pass
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        resp = web.json_response(protocol.error_body(text, err_type, status), status=status)
        resp.force_close()
        return resp


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` whose connections half-close and reject in JSON."""

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # aiohttp builds its Server in Application._make_handler; only the handler class
        # each connection gets differs, so the built server takes the subclass.
        server.__class__ = _Server
        return server


__all__ = ["AppRunner", "describe_rejection", "peer_eof", "REJECTED_KEY"]
