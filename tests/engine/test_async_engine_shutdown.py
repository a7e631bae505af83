"""AsyncEngine.abort_all (the server's drain timeout): a request whose add is still
queued behind it must be refused, not run for a client already told the server stopped."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine, ServerShuttingDown
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampling import SamplingParams


def test_add_queued_behind_abort_all_is_refused_and_nothing_runs(tiny_dirs):
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), dtype="float32", device="cpu",
                                  num_pages=32 + 3 * 4, max_num_seqs=4))
    ae = AsyncEngine(engine)
    gate = threading.Event()

    async def scenario():
        # Hold the engine thread so abort_all and the add queue up in that order.
        held = ae._submit("call", lambda _e: gate.wait(10))
        ae.abort_all(ServerShuttingDown("the server shut down"))
        late = asyncio.ensure_future(
            ae.generate("late", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)))
        await asyncio.sleep(0.2)  # tokenized and queued behind abort_all
        gate.set()
        await asyncio.wrap_future(held)
        with pytest.raises(ServerShuttingDown):
            await late

    try:
        asyncio.run(scenario())
        stats = ae._submit("call", lambda e: (dict(e.stats()), list(e.requests))).result(10)
        st, live = stats
        assert live == [] and "late" not in ae._streams
        assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
    finally:
        ae.shutdown()
