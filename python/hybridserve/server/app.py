"""The aiohttp server: OpenAI-compatible completions and chat, SSE streaming, metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` for server-sent events), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``,
``POST /detokenize`` (vLLM's shapes), ``GET /health``, ``GET /metrics`` (Prometheus).

Errors are values at the boundary: every failure a client can cause is a 4xx with an
OpenAI-style ``{"error": {...}}`` body (unknown routes and methods included), a full
queue or a draining server a 503; nothing a client sends can stop the engine thread.
Every admitted request is closed in a ``finally``: a client that disconnects, streamed
or not, has its request aborted, and its blocks and slot return to the pools (the
server must run with ``handler_cancellation=True``, see :func:`runner_kwargs`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from hybridserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from hybridserve.errors import CheckpointError, HybridServeError, InvalidRequest
from hybridserve.metrics import EngineMetrics
from hybridserve.outputs import DeltaCursor
from hybridserve.server import bounds, protocol
from hybridserve.server.access_log import REQUEST_ID_KEY, USAGE_KEY
from hybridserve.server.http_protocol import describe_rejection, peer_eof
from hybridserve.server.protocol import ApiError
from hybridserve.server import contract, large_bodies
from hybridserve.tokenizer import apply_chat_template

logger = logging.getLogger("hybridserve.server")


@dataclass
class ServerSettings:
    """Operator settings of the HTTP front (the ``serve`` options of the same names)."""

    api_key: str | None = None
    metrics_require_key: bool = False
    max_request_body_bytes: int = 16 << 20
    request_read_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    # One line per request on the ``hybridserve.access`` logger (serve --no-access-log).
    access_log: bool = True
    # Stop strings per request and characters per stop string; beyond is a 400. The
    # automaton over them is built per request (off the engine thread) and costs
    # memory and build time in proportion to their total length.
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    # One request's prompts x n (the sequences it becomes); beyond is a 400. None: no cap.
    max_sequences_per_request: int | None = 256
    # vLLM's --reasoning-parser / --tool-call-parser; "auto" reads them off the chat
    # template (hybridserve.server.tools.default_parsers), None turns one off.
    reasoning_parser: str | None = "auto"
    tool_call_parser: str | None = "auto"


ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", EngineMetrics)
MODEL_NAME_KEY = web.AppKey("model_name", str)
SETTINGS_KEY = web.AppKey("settings", ServerSettings)
STATE_KEY = web.AppKey("state", dict)
CONTRACT_KEY = web.RequestKey("contract", contract.Contract)

# Bodies above this many bytes are parsed (and checked) on the tokenizer pool, so a
# large body does not hold the event loop while other streams wait for their tokens.
_PARSE_OFF_LOOP_BYTES = 256 << 10


def runner_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """What ``AppRunner`` (or aiohttp's ``TestServer``) needs for this app to keep its
    promises: cancel a handler whose client disconnected (which aborts its request)."""
    return {"handler_cancellation": True, "keepalive_timeout": settings.keepalive_timeout}


def _error(exc: BaseException) -> web.Response:
    status = getattr(exc, "http_status", 500) if isinstance(exc, HybridServeError) else 500
    if isinstance(exc, EngineDeadError):
        status = 503
    message = str(exc) if status < 500 or isinstance(exc, HybridServeError) or isinstance(exc, EngineDeadError) \
        else "internal error"
    if isinstance(exc, KeyError) and exc.args:
        message = str(exc.args[0])
    code: int | str | None = status
    param = None
    if isinstance(exc, ApiError):
        code = exc.code if exc.code is not None else status
        param = exc.param
    return web.json_response(
        protocol.error_body(message, protocol.error_type_for(exc, status), code, param), status=status
    )


def _parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the request body is not UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:
        # A JSON integer longer than Python's int-to-string limit (4,300 digits): no
        # field of any request can hold it.
        raise InvalidRequest(f"a number in the request body is out of range: {e}") from None
    except RecursionError:
        raise InvalidRequest("the request body nests JSON too deeply") from None
    try:
        # JSON may spell lone UTF-16 surrogates ("\ud800"), which no tokenizer can encode.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "the request holds a lone UTF-16 surrogate (e.g. \"\\ud800\"), which is not text; "
            "send valid Unicode"
        ) from None
    except RecursionError:
        raise InvalidRequest("the request body nests JSON too deeply") from None
    return body


def _check_json_content_type(request: web.Request) -> None:
    ctype = request.headers.get("Content-Type")
    media = request.content_type  # aiohttp's parse: lower-cased, parameters dropped
    if ctype is None or not (media == "application/json" or (media.startswith("application/")
                                                             and media.endswith("+json"))):
        got = "no Content-Type" if ctype is None else f"Content-Type {media!r}"
        raise ApiError(f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})",
                       status=415, err_type="invalid_request_error")
    # aiohttp decodes gzip and deflate and passes any other coding through as if it
    # were none: the body would be parsed as what it is not.
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate", ""):
        raise ApiError(f"Content-Encoding {encoding[:40]!r} is not supported; send the body as is, gzip or deflate",
                       status=415, err_type="invalid_request_error")


async def _json_body(request: web.Request) -> dict[str, Any]:
    settings = request.app[SETTINGS_KEY]
    _check_json_content_type(request)
    bounds.check_transfer_coding(request)
    try:
        raw = await asyncio.wait_for(request.read(), timeout=settings.request_read_timeout)
    except (HttpProcessingError, ClientPayloadError, RequestPayloadError) as e:
        # A Content-Encoding body that does not decode (gzip that is not gzip), or a
        # body cut short: the client's fault, named without quoting its bytes. The
        # reader is ended, or aiohttp would drain it after the answer and log its error.
        request.content.feed_eof()
        cause = e if isinstance(e, HttpProcessingError) else (e.__cause__ or e)
        raise ApiError(f"the request body could not be read: {describe_rejection(cause)}") from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            f"the request body is larger than this server's limit of {settings.max_request_body_bytes} bytes "
            "(serve --max-request-body-bytes)", status=413) from None
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {settings.request_read_timeout:g} s",
                       status=408) from None
    if len(raw) > _PARSE_OFF_LOOP_BYTES:
        body = await request.app[ENGINE_KEY].run_off_engine(_parse_json, raw)
    else:
        body = _parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _check_prompt_chars(request: web.Request, n_chars: int) -> None:
    limit = request.app[STATE_KEY]["max_prompt_chars"]
    if n_chars > limit:
        engine = request.app[ENGINE_KEY].engine
        raise ApiError(
            f"the prompt has {n_chars} characters, more than can fit in max_model_len={engine.max_model_len} "
            f"tokens (at most {limit} characters); shorten it", param="prompt")


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _open_streams(request: web.Request, engine: AsyncEngine, rid: str, prompts: list[str | list[int]],
                        params: Any, priority: int, klass: str, prompt_lp: int | None) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            sub = rid if len(prompts) == 1 else f"{rid}-{i}"
            streams.append(await engine.generate(sub, p, params, priority=priority, request_class=klass,
                                                 prompt_logprobs=prompt_lp))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


def _check_stop_limits(request: web.Request, params: Any) -> None:
    settings = request.app[SETTINGS_KEY]
    stops = params.stop or []
    if len(stops) > settings.max_stop_strings:
        raise ApiError(f"'stop' has {len(stops)} strings; this server allows at most {settings.max_stop_strings} "
                       "(serve --max-stop-strings)", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > settings.max_stop_string_chars:
        raise ApiError(f"a stop string has {longest} characters; this server allows at most "
                       f"{settings.max_stop_string_chars} (serve --max-stop-string-chars)", param="stop")


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    state = request.app[STATE_KEY]
    model_name = request.app[MODEL_NAME_KEY]
    tokenizer = engine.engine.tokenizer
    tt: protocol.TokenText = state["token_text"]
    streams: list[RequestStream] = []
    try:
        body = await _json_body(request)
        protocol.check_model(body, model_name)
        fields = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
        params = protocol.sampling_params_from(body, fields, chat=chat,
                                               vocab_size=engine.engine.model_config.vocab_size)
        _check_stop_limits(request, params)
        if params.stop:  # built here, off the engine thread that reads it every token
            await engine.run_off_engine(lambda: params.stop_automaton)
        opts = protocol.stream_options(body)
        priority, klass = protocol.request_priority(body)
        prep = contract.prepare(body, chat=chat, reasoning_parser=state["reasoning_parser"],
                                tool_parser=state["tool_parser"])
        request[CONTRACT_KEY] = prep.contract
        beam = None if chat else protocol.beam_search_params(body, params)
        echo = False
        if chat:
            messages = protocol.chat_messages(body)
            add_gen = protocol._bool(body, "add_generation_prompt", True)
            _check_prompt_chars(request, sum(len(m["content"]) for m in messages))
            try:
                prompts: list[str | list[int]] = [await engine.run_off_engine(
                    lambda: contract.render_chat(tokenizer, messages, add_gen, prep))]
            except CheckpointError as e:
                raise InvalidRequest(str(e)) from None
            except InvalidRequest:
                raise
            except Exception as e:  # noqa: BLE001 - a template that rejects these messages
                raise InvalidRequest(f"the chat template cannot render these messages: {e}") from None
        else:
            prompts = protocol.completion_prompts(body)
            for p in prompts:
                if isinstance(p, str):
                    _check_prompt_chars(request, len(p))
            echo = protocol._bool(body, "echo", False)
        bounds.check_sequences(prompts, params.n, request.app[SETTINGS_KEY].max_sequences_per_request)
        # request_class is kept per value by the core and the engine: bounded as /metrics is.
        klass = request.app[METRICS_KEY].class_label(klass)
        spec = contract.constraint(prep, body.get("tools"))
        if spec is not None:  # compiled (and checked) here, off the engine thread; cached there
            params.structured_outputs = spec
            await engine.run_off_engine(lambda: engine.engine.structured_decoding().compiler.compile(spec))
        prompt_lp = params.logprobs if echo else None
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        request[REQUEST_ID_KEY] = rid
        streams = await _open_streams(request, engine, rid, prompts, beam or params, priority, klass, prompt_lp)
    except Exception as e:  # noqa: BLE001 - every failure becomes an error body
        if not isinstance(e, HybridServeError):
            logger.exception("request failed")
        return _error(e)

    try:
        echo_texts = [(p if isinstance(p, str) else tokenizer.decode(p)) if echo else None for p in prompts]
        if not opts.stream:
            return await _whole(request, rid, model_name, streams, params, tt, chat, echo_texts)
        return await _stream(request, rid, model_name, streams, params, tt, chat, echo_texts, opts)
    finally:
        for s in streams:
            s.close()


async def _whole(request: web.Request, rid: str, model_name: str, streams: list[RequestStream], params: Any,
                 tt: protocol.TokenText, chat: bool, echo_texts: list[str | None]) -> web.Response:
    async def last(s: RequestStream) -> Any:
        final = None
        async for out in s:
            final = out
        return final

    # Concurrently, so no stream's queue piles up outputs while another is read.
    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    early: web.StreamResponse | None = None
    try:
        eof = peer_eof(request)
        if eof is not None and not work.done():
            early = await _answer_after_half_close(request, work, eof)
        finals = await work
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client is gone: the handler's finally aborts the requests
    except Exception as e:  # noqa: BLE001
        if early is None:
            return _error(e)
        status = getattr(e, "http_status", 500) if isinstance(e, HybridServeError) else 500
        body = protocol.error_body(str(e) if isinstance(e, (HybridServeError, EngineDeadError)) else
                                   "internal error", protocol.error_type_for(e, status), status)
        await early.write(json.dumps(body).encode())
        await early.write_eof()
        return early
    finally:
        work.cancel()
    request[USAGE_KEY] = protocol.usage(finals)

    def body(lazy: bool = False) -> dict[str, Any]:
        if chat:
            return request[CONTRACT_KEY].chat_body(protocol.chat_body(rid, model_name, finals[0], tt, params, lazy))
        return protocol.completion_body(rid, model_name, finals, tt, params, echo_texts, lazy)

    large = params.logprobs is not None or any(echo_texts)
    if large and large_bodies.LARGE_BODY_MODE.startswith("sliced"):
        try:
            chunks = await _encode_sliced(request, body(lazy=True))
        except Exception as e:  # noqa: BLE001 - nothing is written yet: a whole error body
            logger.exception("building the response failed")
            if early is None:
                return _error(e)
            await early.write(json.dumps(protocol.error_body("internal error", "internal_server_error", 500)).encode())
            await early.write_eof()
            return early
        resp = early
        if resp is None:
            resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
            resp.content_length = sum(map(len, chunks))
            await resp.prepare(request)
        for c in chunks:  # each write waits for the socket to drain: other streams go on
            await resp.write(c)
        await resp.write_eof()
        return resp
    raw = await _off_loop_if_large(request, lambda: large_bodies.dumps_yielding(body()).encode(), large)
    if early is None:
        return web.Response(body=raw, content_type="application/json", charset="utf-8")
    await early.write(raw)
    await early.write_eof()
    return early


async def _encode_sliced(request: web.Request, body: dict[str, Any]) -> list[bytes]:
    """The large body as chunks (see :mod:`hybridserve.server.large_bodies`)."""
    return await large_bodies.encode_sliced(lambda fn: request.app[ENGINE_KEY].run_off_engine(fn), body)


async def _off_loop_if_large(request: web.Request, build: Any, large: bool) -> bytes:
    return await large_bodies.off_loop_if_large(lambda fn: request.app[ENGINE_KEY].run_off_engine(fn), build,
                                                large)


# While a half-closed client waits for a non-streamed answer, a space is written this
# often: a client that closed entirely answers it with a reset, and its request is
# aborted instead of computed for nobody.
_HALF_CLOSE_PROBE_S = 0.5


async def _answer_after_half_close(request: web.Request, work: asyncio.Future,
                                   eof: asyncio.Event) -> web.StreamResponse | None:
    """Wait for ``work``; if the client sends EOF first, start a chunked 200 answer
    and write whitespace (valid before a JSON value) until the work is done."""
    eof_wait = asyncio.ensure_future(eof.wait())
    try:
        await asyncio.wait([work, eof_wait], return_when=asyncio.FIRST_COMPLETED)
    finally:
        eof_wait.cancel()
    if work.done():
        return None
    resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    while not work.done():
        await resp.write(b" ")
        await asyncio.wait([work], timeout=_HALF_CLOSE_PROBE_S)
    return resp


async def _merged(streams: list[RequestStream]):
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(request: web.Request, rid: str, model_name: str, streams: list[RequestStream], params: Any,
                  tt: protocol.TokenText, chat: bool, echo_texts: list[str | None],
                  opts: protocol.StreamOptions) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    n = params.n
    # The engine streams deltas (stop-string prefixes already held back) and the whole
    # result once at the end; a cursor per stream turns both into what is new.
    cursors = [DeltaCursor() for _ in streams]
    finished_sent: set[int] = set()
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    k = params.logprobs or 0
    lasts: dict[int, Any] = {}

    # OpenAI: with include_usage every chunk carries "usage", null until the last one.
    usage_field = {"usage": None} if opts.include_usage else {}

    def chunk_obj(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                **usage_field, **extra}

    def chunk(choices: list[dict[str, Any]], _dumps: Any = json.dumps, **extra: Any) -> bytes:
        return f"data: {_dumps(chunk_obj(choices, **extra))}\n\n".encode()

    sliced = large_bodies.LARGE_BODY_MODE.startswith("sliced")

    try:
        if chat:
            await resp.write(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None} for i in range(n)]))
        echoed: set[int] = set()
        char_pos: dict[int, int] = {}  # text_offset of the next token, per choice
        async for si, out in _merged(streams):
            lasts[si] = out
            choices = []
            big = False  # an echoed prompt's logprobs: this chunk is encoded off the loop / in slices
            lazies: list[tuple[int, protocol.LazyLogprobs]] = []
            for c in out.outputs:
                index = si * n + c.index
                if index in finished_sent:
                    continue  # its finish went out with an earlier delta
                done = c.finish_reason is not None
                text, new_ids, new_lps = cursors[si].new_part(c, out.delta)
                if not text and not done and not (new_lps and new_ids):
                    continue
                if done:
                    finished_sent.add(index)
                if chat:
                    lp = protocol.chat_logprobs(tt, new_ids, new_lps, k) if new_lps is not None else None
                    ctr = request.get(CONTRACT_KEY)
                    if ctr is not None and ctr.active:  # reasoning / tool-call deltas, a chunk each
                        for part in ctr.stream_choices(index, text, c.finish_reason, lp):
                            await resp.write(chunk([part]))
                        continue
                    choices.append({"index": index, "delta": {"content": text} if text or not done else {},
                                    "logprobs": lp, "finish_reason": c.finish_reason})
                else:
                    lp = None
                    first_echo = echo_texts[si] is not None and index not in echoed
                    if first_echo:
                        echoed.add(index)
                        text = echo_texts[si] + text
                    if new_lps is not None:
                        ids, ents = new_ids, new_lps
                        if first_echo:
                            ids = list(out.prompt_token_ids) + ids
                            ents = itertools.chain(out.prompt_logprobs or [None] * len(out.prompt_token_ids), ents)
                        skip_from = len(ids) - len(new_ids) if params.skip_special_tokens else None
                        args = (tt, ids, ents, k, char_pos.get(index, 0), skip_from)
                        big = big or first_echo
                        if first_echo and sliced:
                            lp = protocol.LazyLogprobs("completion", *args)
                            lazies.append((index, lp))  # its end offset is known once encoded
                        else:
                            lp = (await _off_loop_if_large(request, lambda a=args: protocol.completion_logprobs(*a),
                                                           True) if first_echo else protocol.completion_logprobs(*args))
                        if isinstance(lp, dict) and lp["tokens"]:
                            skipped = (skip_from is not None and len(ids) - 1 >= skip_from
                                       and ids[-1] in tt.special_ids)
                            char_pos[index] = lp["text_offset"][-1] + (0 if skipped else len(lp["tokens"][-1]))
                    choices.append({"index": index, "text": text, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if choices and big and sliced:
                parts = await _encode_sliced(request, chunk_obj(choices))
                for i, part in enumerate(parts):
                    await resp.write((b"data: " if i == 0 else b"") + part)
                await resp.write(b"\n\n")
                for index, lazy in lazies:
                    char_pos[index] = lazy.end_offset
            elif choices:
                await resp.write(await _off_loop_if_large(request, lambda c=choices: chunk(c, _dumps=large_bodies.dumps_yielding), True) if big
                                 else chunk(choices))
        if lasts:
            request[USAGE_KEY] = protocol.usage(list(lasts.values()))
        if opts.include_usage and lasts:
            await resp.write(chunk([], usage=request[USAGE_KEY]))
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, ConnectionError):
        pass  # the client went away: the handler's finally aborts the requests
    except Exception as e:  # noqa: BLE001 - report in-band, the status line is gone
        status = getattr(e, "http_status", 500) if isinstance(e, HybridServeError) else 500
        msg = str(e) if isinstance(e, (HybridServeError, EngineDeadError)) else "internal error"
        if not isinstance(e, (HybridServeError, EngineDeadError)):
            logger.exception("stream failed")
        try:
            await resp.write(_sse(protocol.error_body(msg, protocol.error_type_for(e, status), status)))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


def _model_card(request: web.Request) -> dict[str, Any]:
    name = request.app[MODEL_NAME_KEY]
    engine = request.app[ENGINE_KEY].engine
    return {"id": name, "object": "model", "created": request.app[STATE_KEY]["created"], "owned_by": "hybridserve",
            "root": name, "parent": None, "max_model_len": engine.max_model_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``)."""
    name = request.app[MODEL_NAME_KEY]
    wanted = request.match_info["model"]
    if wanted != name:
        return web.json_response(protocol.error_body(
            f"The model `{wanted}` does not exist; this server serves `{name}` (GET /v1/models).",
            "invalid_request_error", "model_not_found", "model"), status=404)
    return web.json_response(_model_card(request))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` ->
    ``{"count", "max_model_len", "tokens", "token_strs"}``. ``add_special_tokens``
    defaults as in vLLM: true for a prompt (as a completion's prompt is tokenized, so
    ``count`` is what it costs), false for messages (the template writes them)."""
    engine = request.app[ENGINE_KEY]
    tokenizer = engine.engine.tokenizer
    try:
        body = await _json_body(request)
        protocol.check_model(body, request.app[MODEL_NAME_KEY])
        allowed = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise InvalidRequest(f"unknown field(s) {unknown}; /tokenize accepts {sorted(allowed)}")
        add_special = protocol._bool(body, "add_special_tokens", "prompt" in body)
        if ("prompt" in body) == ("messages" in body):
            raise InvalidRequest("give exactly one of 'prompt' (a string) or 'messages' (a chat)")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequest("'prompt' must be a string")
            _check_prompt_chars(request, len(prompt))
            ids = await engine.run_off_engine(
                lambda: list(tokenizer.encode(prompt, add_special_tokens=add_special)))
        else:
            messages = protocol.chat_messages(body)
            _check_prompt_chars(request, sum(len(m["content"]) for m in messages))
            add_gen = protocol._bool(body, "add_generation_prompt", True)
            try:
                ids = await engine.run_off_engine(
                    lambda: apply_chat_template(tokenizer, messages, add_generation_prompt=add_gen))
            except CheckpointError as e:
                raise InvalidRequest(str(e)) from None
        strs = tokenizer.convert_ids_to_tokens(ids) if protocol._bool(body, "return_token_strs", False) else None
    except Exception as e:  # noqa: BLE001
        if not isinstance(e, HybridServeError):
            logger.exception("tokenize failed")
        return _error(e)
    return web.json_response({"count": len(ids), "max_model_len": engine.engine.max_model_len,
                              "tokens": ids, "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``."""
    engine = request.app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        protocol.check_model(body, request.app[MODEL_NAME_KEY])
        unknown = sorted(set(body) - {"model", "tokens"})
        if unknown:
            raise InvalidRequest(f"unknown field(s) {unknown}; /detokenize accepts ['model', 'tokens']")
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(protocol._is_int(t) for t in tokens):
            raise InvalidRequest("'tokens' must be a list of token ids")
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        text = await engine.run_off_engine(engine.engine.tokenizer.decode, tokens)
    except Exception as e:  # noqa: BLE001
        if not isinstance(e, HybridServeError):
            logger.exception("detokenize failed")
        return _error(e)
    return web.json_response({"prompt": text})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.is_alive:
        return web.json_response(protocol.error_body("engine thread stopped", "service_unavailable", 503), status=503)
    if request.app[STATE_KEY]["draining"]:
        return web.json_response(protocol.error_body("server is shutting down", "service_unavailable", 503),
                                 status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    await request.app[ENGINE_KEY].call(m.refresh)
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


def _needs_key(path: str, settings: ServerSettings) -> bool:
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        return True
    return path == "/metrics" and settings.metrics_require_key


@web.middleware
async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    if settings.api_key and _needs_key(request.path, settings):
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        # aiohttp decodes header bytes that are not UTF-8 as lone surrogates
        # (surrogateescape); encoding them back the same way compares the raw bytes.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), settings.api_key.encode()):
            msg = ("Incorrect API key provided." if given else
                   "Missing API key: send the header 'Authorization: Bearer <key>'.")
            return web.json_response(protocol.error_body(msg, "invalid_request_error", "invalid_api_key"),
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
    if request.app[STATE_KEY]["draining"] and request.method == "POST":
        return web.json_response(
            protocol.error_body("the server is shutting down; retry on another replica", "service_unavailable", 503),
            status=503)
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            msg = f"no route {request.method} {request.path}; see GET /v1/models, POST /v1/completions, " \
                  "POST /v1/chat/completions"
        elif e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
            if e.headers.get("Allow"):
                msg += f"; use {e.headers['Allow']}"
        elif e.status == 413:
            msg = f"the request body is larger than this server's limit of {settings.max_request_body_bytes} bytes"
        else:
            msg = e.reason
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return web.json_response(protocol.error_body(msg, protocol.error_type_for(e, e.status), e.status),
                                 status=e.status, headers=headers)
    except Exception as e:  # noqa: BLE001 - a bug still answers in the API's error shape
        if not isinstance(e, (HybridServeError, EngineDeadError)):
            logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error(e)


def _max_token_chars(tokenizer: Any) -> int:
    try:
        vocab = tokenizer.get_vocab()
        return max((len(k) for k in vocab), default=1) or 1
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing
        return 64


def _parsers(settings: ServerSettings, tokenizer: Any) -> dict[str, str | None]:
    from hybridserve.server.tools import default_parsers

    reasoning, tool = default_parsers(getattr(tokenizer, "chat_template", None))
    r = reasoning if settings.reasoning_parser == "auto" else settings.reasoning_parser
    t = tool if settings.tool_call_parser == "auto" else settings.tool_call_parser
    contract.check_parsers(r, t)
    return {"reasoning_parser": r, "tool_parser": t}


def build_app(engine: AsyncEngine, metrics_: EngineMetrics, model_name: str,
              settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()
    app = web.Application(client_max_size=settings.max_request_body_bytes, middlewares=[_middleware])
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = metrics_
    app[MODEL_NAME_KEY] = model_name
    app[SETTINGS_KEY] = settings
    tokenizer = engine.engine.tokenizer
    app[STATE_KEY] = {
        "draining": False,
        "created": int(time.time()),
        "token_text": protocol.TokenText(tokenizer),
        # A token spans at most its longest vocabulary spelling in characters (byte-level
        # BPE spells one byte per character); x4 covers normalizers that merge characters.
        # A prompt longer than this cannot fit max_model_len, so it is refused before the
        # tokenizer spends seconds on it.
        "max_prompt_chars": engine.engine.max_model_len * _max_token_chars(tokenizer) * 4,
        **_parsers(settings, tokenizer),
    }
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def _shutdown(app_: web.Application) -> None:
        app_[ENGINE_KEY].shutdown()

    bounds.json_expect_failures(app)
    app.on_cleanup.append(_shutdown)
    return app
