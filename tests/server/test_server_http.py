"""The aiohttp server end to end, on loopback, over a tiny checkpoint.

Oracles: HF transformers' greedy decode (for what the server returns), the
non-streaming answer (for what the stream concatenates to), and the engine's own
pools being whole again after every bad or abandoned request.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from aiohttp.test_utils import TestClient, TestServer

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.metrics import EngineMetrics
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.server.app import build_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("srv") / "m", preset="test-a", seed=5)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _serve(model_dir, coro_fn, **engine_kwargs):
    async def main():
        kwargs = dict(dtype="float32", device="cpu", num_pages=32 + 3 * 4,
                      max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
        kwargs.update(engine_kwargs)
        engine = LLMEngine(EngineArgs(model=model_dir, **kwargs))
        metrics = EngineMetrics()
        aengine = AsyncEngine(engine, on_step=metrics.observe_step)
        app = build_app(aengine, metrics, "tiny")
        async with TestClient(TestServer(app)) as client:
            try:
                return await coro_fn(client, engine)
            finally:
                aengine.shutdown()

    return asyncio.run(main())


async def _pools_whole(client, engine, timeout=10.0):
    """Wait until the engine holds no request, then check every block and slot is free."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = await (await client.get("/metrics")).text()
        vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("hybridserve:") and " " in line}
        if vals.get("hybridserve:num_seqs_running", 1) == 0 and vals.get("hybridserve:num_requests_waiting", 1) == 0:
            break
        assert asyncio.get_running_loop().time() < deadline, vals
        await asyncio.sleep(0.05)
    assert vals["hybridserve:kv_blocks_used"] == 0, vals
    assert vals['hybridserve:arena_pages{use="running_state"}'] == 0, vals
    assert vals["hybridserve:arena_pages_available"] == vals["hybridserve:arena_pages_total"], vals
    return vals


def _hf_greedy(hf_model, ids, n):
    seq = list(ids)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_completion_matches_hf_greedy_and_stream_matches_whole(model_dir, hf_model):
    prompt_ids = [40, 41, 42, 43, 44, 45, 46]

    async def run(client, engine):
        body = {"prompt": prompt_ids, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200, await r.text()
        whole = await r.json()
        expect_ids = _hf_greedy(hf_model, prompt_ids, 9)
        assert whole["choices"][0]["text"] == engine.tokenizer.decode(expect_ids)
        assert whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
        assert whole["choices"][0]["finish_reason"] == "length"

        r = await client.post("/v1/completions", json={**body, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
        events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        await _pools_whole(client, engine)

    _serve(model_dir, run)


def test_chat_completion_uses_the_chat_template(model_dir, hf_model):
    async def run(client, engine):
        messages = [{"role": "user", "content": "hi"}]
        r = await client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status == 200, await r.text()
        body = await r.json()
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        expect = engine.tokenizer.decode(_hf_greedy(hf_model, ids, 5))
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expect}
        assert body["usage"]["prompt_tokens"] == len(ids)

    _serve(model_dir, run)


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "bogus_field": 1}, "bogus_field"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "token ids"),
    ({"prompt": [5] * 300}, "max_model_len"),
    ({"messages": "hello"}, "messages"),
])
def test_bad_requests_get_400_and_lose_nothing(model_dir, body, fragment):
    async def run(client, engine):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await client.post(path, json=body)
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert fragment in err["message"]
        # The engine keeps serving everyone else, and nothing leaked.
        ok = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert ok.status == 200
        await _pools_whole(client, engine)

    _serve(model_dir, run)


def test_invalid_json_is_400(model_dir):
    async def run(client, engine):
        r = await client.post("/v1/completions", data=b"{not json", headers={"content-type": "application/json"})
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]

    _serve(model_dir, run)


def test_client_disconnect_aborts_and_returns_blocks(model_dir):
    async def run(client, engine):
        r = await client.post("/v1/completions", json={
            "prompt": list(range(3, 40)), "max_tokens": 200, "ignore_eos": True, "stream": True})
        assert r.status == 200
        await r.content.readline()  # the stream has started
        r.close()  # the client goes away mid-generation
        vals = await _pools_whole(client, engine)
        assert vals["hybridserve:aborted_requests_total"] >= 1

    _serve(model_dir, run)


def test_metrics_are_sliced_by_request_class(model_dir):
    async def run(client, engine):
        for klass in ("interactive", "batch"):
            r = await client.post("/v1/completions", json={
                "prompt": [7, 8, 9], "max_tokens": 3, "request_class": klass})
            assert r.status == 200
        text = await (await client.get("/metrics")).text()
        for klass in ("interactive", "batch"):
            assert f'hybridserve:time_to_first_token_seconds_count{{request_class="{klass}"}} 1.0' in text
            assert f'hybridserve:request_queue_time_seconds_count{{request_class="{klass}"}} 1.0' in text
        assert "hybridserve:kv_blocks_free" in text and "hybridserve:arena_pages_available" in text

    _serve(model_dir, run)
