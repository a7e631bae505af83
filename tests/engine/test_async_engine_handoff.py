"""The async engine's hand-off of outputs to the clients' event loop: a step's outputs
are held until the next step's model call (so the loop's work overlaps the forward),
all of them are out by then, none is lost or reordered (the synchronous engine is the
oracle of every token), and the per-phase timers still add up to each step's time with
the hand-off counted in process_outputs."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time

import pytest

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import STEP_PHASES, LLMEngine
from hybridserve.engine.loop_inbox import LoopInbox
from hybridserve.sampling import SamplingParams


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device="cpu", num_gpu_blocks=256,
                                num_state_slots=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256))


def _requests():
    reqs = []
    for i in range(6):
        params = SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True,
                                **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {"temperature": 0.0}))
        reqs.append((f"r{i}", [3 + i, 7, 11 + 2 * i, 5, 9][: 3 + i % 3], params))
    return reqs


def _sync_tokens(model_dir) -> dict[str, list[int]]:
    engine = _engine(model_dir)
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_outputs_are_held_until_the_next_model_call_and_none_is_lost(tiny_dirs, monkeypatch):
    expected = _sync_tokens(tiny_dirs["test-a"])
    engine = _engine(tiny_dirs["test-a"])
    produced = [0]  # outputs returned by engine.step() so far
    posted = [0]  # outputs handed to an event loop so far
    at_step_start, at_forward = [], []

    real_post = LoopInbox.post

    def counting_post(self, items):
        posted[0] += len(items)
        return real_post(self, items)

    monkeypatch.setattr(LoopInbox, "post", counting_post)
    inner_step = engine.step

    def step():
        at_step_start.append((produced[0], posted[0]))
        out = inner_step()
        produced[0] += len(out)
        return out

    engine.step = step
    model = engine.runner.model

    def forward(*a, **k):
        at_forward.append((produced[0], posted[0]))
        return model(*a, **k)

    engine.runner.model = forward
    aengine = AsyncEngine(engine)

    async def consume(rid, prompt, params):
        stream = await aengine.generate(rid, prompt, params)
        deltas, final = [], None
        try:
            async for out in stream:
                if out.finished:
                    final = out
                else:
                    deltas.extend(out.outputs[0].token_ids)
        finally:
            stream.close()
        return rid, deltas, final

    async def main():
        return await asyncio.gather(*(consume(*r) for r in _requests()))

    try:
        results = asyncio.run(main())
    finally:
        aengine.shutdown()
    for rid, deltas, final in results:
        assert final is not None and list(final.outputs[0].token_ids) == expected[rid], rid
        # Running outputs are deltas: with the last step's tokens they add up to the whole.
        assert deltas == expected[rid][: len(deltas)] and len(deltas) >= len(expected[rid]) - 1, rid
    # Every output a step produced is out before the next model call...
    assert at_forward and all(p == q for p, q in at_forward)
    # ... and not sooner while the next step follows at once (the overlap with the forward).
    held = [p > q for p, q in at_step_start[1:] if p]
    assert held and sum(held) >= len(held) - 2
    assert posted[0] == produced[0]


def test_phase_timers_add_up_through_the_async_engine(tiny_dirs, monkeypatch):
    # A hand-off made slow on purpose: its time must show in process_outputs (the phase
    # it belongs to), not in prepare_inputs, whose clock reads it runs between.
    slow = 0.01
    real_post = LoopInbox.post

    def slow_post(self, items):
        time.sleep(slow)
        return real_post(self, items)

    monkeypatch.setattr(LoopInbox, "post", slow_post)
    engine = _engine(tiny_dirs["test-a"])
    starts, rows = [], []
    inner_step = engine.step

    def step():
        starts.append(time.perf_counter())
        return inner_step()

    engine.step = step

    def on_step(eng, outputs):
        # Called after the engine thread's own hand-off, which it adds to this step.
        rows.append((time.perf_counter() - starts[-1], dict(eng.last_step_stats["phase_seconds"])))

    aengine = AsyncEngine(engine, on_step=on_step)

    async def consume(rid, prompt, params):
        stream = await aengine.generate(rid, prompt, params)
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()

    async def main():
        await asyncio.gather(*(consume(*r) for r in _requests()))

    try:
        asyncio.run(main())
        cumulative = asyncio.run(_call(aengine, lambda e: e.stats()["step_phase_seconds"]))
    finally:
        aengine.shutdown()
    assert len(rows) > 5
    for _, phases in rows:
        assert tuple(phases) == STEP_PHASES and all(v >= 0 for v in phases.values()), phases
    errors = [abs(sum(p.values()) - wall) / wall for wall, p in rows]
    assert statistics.median(errors) <= 0.05, errors
    assert all(sum(p.values()) <= wall for wall, p in rows)
    for k in STEP_PHASES:
        assert cumulative[k] == pytest.approx(sum(p[k] for _, p in rows), abs=1e-9)
    # Every step but the last hands off (the previous step's outputs, or its own when
    # nothing follows); prepare_inputs of the test model takes well under 10 ms.
    assert all(p["process_outputs"] >= slow for _, p in rows[1:]), rows
    assert statistics.median(p["prepare_inputs"] for _, p in rows) < slow, rows


async def _call(aengine, fn):
    return await aengine.call(fn)


class _Receiver:
    def __init__(self):
        self.items = []

    def _put(self, item):
        self.items.append((threading.get_ident(), item))


def test_loop_inbox_delivers_in_order_on_the_loop_thread_and_refuses_a_closed_loop():
    receivers = [_Receiver(), _Receiver()]
    result = {}

    async def main():
        loop = asyncio.get_running_loop()
        inbox = LoopInbox(loop)
        total = 2 * 500

        def producer():
            for i in range(500):
                inbox.post([(receivers[0], i), (receivers[1], -i)])
                if i % 97 == 0:
                    time.sleep(0.001)

        t = threading.Thread(target=producer)
        t.start()
        while sum(len(r.items) for r in receivers) < total:
            await asyncio.sleep(0.001)
        t.join()
        result["loop_thread"] = threading.get_ident()
        return inbox

    inbox = asyncio.run(main())
    assert [x for _, x in receivers[0].items] == list(range(500))
    assert [x for _, x in receivers[1].items] == [-i for i in range(500)]
    assert {tid for r in receivers for tid, _ in r.items} == {result["loop_thread"]}
    fds = (inbox._r, inbox._w)
    with pytest.raises(RuntimeError, match="closed"):
        inbox.post([(receivers[0], "late")])
    assert inbox.closed and receivers[0].items[-1][1] == 499
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
