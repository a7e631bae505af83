"""The aiohttp server: OpenAI-compatible completions and chat, SSE streaming, metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` for server-sent events), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format).

Errors are values at the boundary: a bad body is a 400, a full queue a 503, each
with an OpenAI-style ``{"error": {...}}`` body; nothing a client sends can stop the
engine thread. A client that disconnects mid-stream has its request aborted, and its
blocks and slot return to the pools.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from hybridserve.engine.async_engine import AsyncEngine, EngineDeadError
from hybridserve.errors import CheckpointError, HybridServeError, InvalidRequest
from hybridserve.metrics import EngineMetrics
from hybridserve.server import protocol
from hybridserve.tokenizer import apply_chat_template

logger = logging.getLogger("hybridserve.server")

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", EngineMetrics)
MODEL_NAME_KEY = web.AppKey("model_name", str)


def _error(exc: BaseException) -> web.Response:
    status = getattr(exc, "http_status", 500) if isinstance(exc, HybridServeError) else 500
    if isinstance(exc, EngineDeadError):
        status = 503
    message = str(exc) if status < 500 or isinstance(exc, HybridServeError) else "internal error"
    if isinstance(exc, KeyError) and exc.args:
        message = str(exc.args[0])
    return web.json_response(
        protocol.error_body(message, protocol.error_type_for(exc, status), status), status=status
    )


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


class _Deltas:
    """Per-choice text already streamed; holds back a possible stop-string prefix."""

    def __init__(self, n: int, holdback: int) -> None:
        self.sent = [0] * n
        self.holdback = holdback

    def take(self, index: int, text: str, finished: bool) -> str:
        end = len(text) if finished else max(len(text) - self.holdback, 0)
        start = self.sent[index]
        if end <= start:
            return ""
        self.sent[index] = end
        return text[start:end]


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    model_name = request.app[MODEL_NAME_KEY]
    tokenizer = engine.engine.tokenizer
    try:
        body = await _json_body(request)
        fields = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
        params = protocol.sampling_params_from(body, fields, chat=chat)
        priority, klass = protocol.request_priority(body)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise InvalidRequest(
                    "'messages' must be a non-empty list of {\"role\": str, \"content\": str} objects"
                )
            try:
                prompt: str | list[int] = apply_chat_template(
                    tokenizer, messages, add_generation_prompt=bool(body.get("add_generation_prompt", True))
                )
            except CheckpointError as e:
                raise InvalidRequest(str(e)) from None
        else:
            prompt = protocol.completion_prompt(body)
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        stream = await engine.generate(rid, prompt, params, priority=priority, request_class=klass)
    except Exception as e:  # noqa: BLE001 - every failure becomes an error body
        if not isinstance(e, HybridServeError):
            logger.exception("request failed")
        return _error(e)

    if not body.get("stream"):
        final = None
        try:
            async for out in stream:
                final = out
        except Exception as e:  # noqa: BLE001
            return _error(e)
        make = protocol.chat_body if chat else protocol.completion_body
        return web.json_response(make(rid, model_name, final, tokenizer))

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    holdback = max((len(s) for s in params.stop), default=1) - 1 if not params.include_stop_str_in_output else 0
    deltas = _Deltas(params.n, holdback)
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    last = None
    try:
        if chat:
            first = {"id": rid, "object": obj, "model": model_name, "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(params.n)]}
            await resp.write(f"data: {json.dumps(first)}\n\n".encode())
        async for out in stream:
            last = out
            choices = []
            for c in out.outputs:
                done = c.finish_reason is not None
                text = deltas.take(c.index, c.text, done)
                if not text and not done:
                    continue
                if chat:
                    choices.append({"index": c.index, "delta": {"content": text},
                                    "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": c.index, "text": text, "finish_reason": c.finish_reason})
            if choices:
                chunk = {"id": rid, "object": obj, "model": model_name, "choices": choices}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if include_usage and last is not None:
            chunk = {"id": rid, "object": obj, "model": model_name, "choices": [], "usage": protocol.usage(last)}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, ConnectionError):
        # The client went away: the generator's finally aborts the request.
        pass
    except Exception as e:  # noqa: BLE001 - report in-band, the status line is gone
        err = protocol.error_body(str(e), protocol.error_type_for(e, 500), 500)
        try:
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        except ConnectionError:
            pass
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME_KEY]
    engine = request.app[ENGINE_KEY].engine
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "hybridserve", "max_model_len": engine.max_model_len}
    ]})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.is_alive:
        return web.json_response(protocol.error_body("engine thread stopped", "service_unavailable", 503), status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    await request.app[ENGINE_KEY].call(m.refresh)
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


def build_app(engine: AsyncEngine, metrics_: EngineMetrics, model_name: str) -> web.Application:
    app = web.Application(client_max_size=16 << 20)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = metrics_
    app[MODEL_NAME_KEY] = model_name
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def _shutdown(app_: web.Application) -> None:
        app_[ENGINE_KEY].shutdown()

    app.on_shutdown.append(_shutdown)
    return app
