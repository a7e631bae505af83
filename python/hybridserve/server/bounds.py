"""Bounds on what one HTTP request may ask, and the HTTP corners aiohttp leaves open.

Small checks the front calls before anything reaches the engine; each failure is an
OpenAI-style error body with a 4xx status (see ``protocol.ApiError``)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from hybridserve.server.protocol import ApiError, error_body


def check_transfer_coding(request: web.Request) -> None:
    """aiohttp decodes only ``chunked``; any other transfer coding (``gzip, chunked``)
    would reach the JSON parser still encoded, or, worse, ignored."""
    te = request.headers.get("Transfer-Encoding")
    if te is None:
        return
    codings = [c.strip().lower() for c in te.split(",") if c.strip()]
    other = [c for c in codings if c not in ("chunked", "identity")]
    if other:
        raise ApiError(f"Transfer-Encoding {other[0][:40]!r} is not supported; send the body chunked or with a "
                       "Content-Length (compress it with Content-Encoding: gzip instead)",
                       status=400, err_type="invalid_request_error")


def check_sequences(prompts: list, n: int, limit: int | None) -> None:
    """One request's prompts x n (the sequences it becomes) against ``limit``."""
    if limit is not None and len(prompts) * n > limit:
        raise ApiError(f"this request asks for {len(prompts)} prompt(s) x n = {n} = {len(prompts) * n} sequences; "
                       f"this server allows at most {limit} per request (serve --max-sequences-per-request); "
                       "split it into several requests", param="n")


async def _expect_handler(request: web.Request) -> web.StreamResponse | None:
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1) or expect.lower() == "100-continue":
        return await _default_expect_handler(request)  # "100 Continue", or nothing on HTTP/1.0
    return web.json_response(
        error_body(f"unknown Expect: {expect[:60]!r}; only 100-continue is understood",
                   "invalid_request_error", 417), status=417)


def json_expect_failures(app: web.Application) -> None:
    """Every route answers an Expect it does not understand with an OpenAI JSON 417
    (aiohttp's default answers in plain text, before any middleware runs)."""
    for route in app.router.routes():
        route._expect_handler = _expect_handler  # noqa: SLF001 - aiohttp has no public setter
