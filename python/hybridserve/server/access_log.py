"""One access-log line per request, at INFO on the ``hybridserve.access`` logger.

``POST /v1/completions 200 1.234s prompt_tokens=5 output_tokens=16 request_id=cmpl-...``
plus the client's address first, as uvicorn and vLLM log. Handlers record the request
id and token counts on the request (:data:`REQUEST_ID_KEY`, :data:`USAGE_KEY`); a
request that never reached generation logs ``-`` for them. ``serve --no-access-log``
turns the lines off. Requests the HTTP parser rejected are not logged here: they get
one WARNING line from :mod:`hybridserve.server.http_protocol`.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from hybridserve.server.http_protocol import REJECTED_KEY

ACCESS_LOGGER = logging.getLogger("hybridserve.access")

REQUEST_ID_KEY = web.RequestKey("hybridserve_request_id", str)
USAGE_KEY = web.RequestKey("hybridserve_usage", dict)


class AccessLogger(AbstractAccessLogger):
    def log(self, request: Any, response: Any, time: float) -> None:
        if request.get(REJECTED_KEY):
            return
        usage = request.get(USAGE_KEY) or {}
        self.logger.info(
            "%s %s %s %d %.3fs prompt_tokens=%s output_tokens=%s request_id=%s",
            request.remote or "-", request.method, request.raw_path, response.status, time,
            usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"),
            request.get(REQUEST_ID_KEY, "-"),
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


__all__ = ["AccessLogger", "ACCESS_LOGGER", "REQUEST_ID_KEY", "USAGE_KEY"]
