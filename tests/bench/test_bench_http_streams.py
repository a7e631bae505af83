"""``bench serve``'s streaming client against a scripted server: what it makes of each
kind of stream a server can send.

Oracle: the scripted server itself. Each request's first prompt token picks the stream
it gets, so the test knows what every record must say: the chunks that carried text,
the server's own usage count, the finish reason, llama-server's ``timings`` object.
The scripted empty stream is the one llama-server sends when the model repeats a UTF-8
lead byte (no partial chunk, then a final chunk with ``text: ""`` and the usage), taken
from a recorded stream of llama-server's (benches/RESULTS.md, issue 35's empty streams).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from hybridserve.bench.http_runner import run_http
from hybridserve.bench.report import build_report, render_table
from hybridserve.bench.workload import BenchRequest, RequestClass, Workload

TIMINGS = {"cache_n": 0, "prompt_n": 3, "prompt_ms": 12.5, "predicted_n": 5, "predicted_ms": 40.0}


def _chunk(text: str, finish: str | None = None, usage: int | None = None, timings: bool = False) -> bytes:
    body: dict = {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
                  "object": "text_completion"}
    if usage is not None:
        body["usage"] = {"completion_tokens": usage, "prompt_tokens": 3, "total_tokens": 3 + usage}
    if timings:
        body["timings"] = TIMINGS
    return f"data: {json.dumps(body)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    kind = payload["prompt"][0]
    n = payload["max_tokens"]
    if kind == 4:
        return web.json_response({"error": {"message": "no such thing", "type": "invalid_request_error"}},
                                 status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if kind == 0:  # a normal stream: one text chunk per token, then usage
        for i in range(n):
            await resp.write(_chunk(f"t{i}", "length" if i == n - 1 else None))
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    elif kind == 1:  # llama-server's empty stream: a keep-alive comment, then only the final chunk
        await resp.write(b":\n\n")
        await resp.write(_chunk("", "length", usage=n, timings=True))
        await resp.write(b"data: [DONE]\n\n")
    elif kind == 2:  # text-less token chunks (a server that sends a chunk per token, text "")
        for i in range(n):
            await resp.write(_chunk("", "length" if i == n - 1 else None))
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    elif kind == 3:  # cut off: no token, no finish_reason, no [DONE]
        await resp.write(b":\n\n")
    await resp.write_eof()
    return resp


def _run(kinds: list[int], keep_raw_sse: bool):
    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", _completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            wl = Workload([BenchRequest(f"r{i}", "default", [k, 7, 7], 3, 5, 0, 0.0) for i, k in enumerate(kinds)],
                          [RequestClass("default", (3, 3), (5, 5))], seed=0, request_rate=float("inf"))
            return await run_http(f"http://127.0.0.1:{port}", wl, model="fake", send_class_fields=False,
                                  progress=False, keep_raw_sse=keep_raw_sse)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_each_kind_of_stream_is_recorded_as_the_server_sent_it():
    records, server, _timeline, duration = _run([0, 1, 2, 3, 4], keep_raw_sse=True)
    normal, empty, textless, cut, refused = records

    assert normal.ok and not normal.empty_stream and normal.output_tokens == 5 == len(normal.token_times)
    assert normal.finish_reason == "length" and normal.usage_tokens == 5 and normal.server_timings is None
    assert normal.ttft is not None and len(normal.itls) == 4

    # Finished, the server counted 5 tokens, no text: it completed, its tokens count,
    # and it has no TTFT or ITL.
    assert empty.ok and empty.error is None and empty.empty_stream
    assert empty.output_tokens == 5 and empty.usage_tokens == 5 and empty.finish_reason == "length"
    assert empty.ttft is None and empty.itls == [] and empty.finish_time is not None
    assert empty.server_timings == TIMINGS
    assert [line for _t, line in empty.raw_sse][0] == ":"
    assert json.loads(empty.raw_sse[1][1][5:])["usage"]["completion_tokens"] == 5
    assert empty.raw_sse[-1][1] == "data: [DONE]"

    assert textless.ok and textless.empty_stream and textless.output_tokens == 5

    assert not cut.ok and not cut.empty_stream and cut.error.startswith("the stream ended without any token")
    assert not refused.ok and refused.error == "HTTP 400: no such thing"

    rep = build_report(records, duration=duration, class_names=["default"], mode="serve", config={},
                       server=server, timeline=[])
    o = rep["overall"]
    assert o["completed"] == 3 and o["failed"] == 2 and o["empty_streams"] == 2
    assert o["output_tokens"] == 15  # the empty streams' tokens count
    assert o["ttft_s"]["p50"] == normal.ttft  # only the stream that delivered text has a TTFT
    assert [r["empty_stream"] for r in rep["requests"]] == [False, True, True, False, False]
    assert "empty streams: 2 finished" in render_table(rep)


def test_raw_sse_is_kept_only_when_asked():
    records, *_ = _run([0, 1], keep_raw_sse=False)
    assert all(r.raw_sse is None for r in records)
    assert [r.empty_stream for r in records] == [False, True]
