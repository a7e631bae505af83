"""The async engine raises the garbage collector's generation-0 threshold while it runs
(fewer collections walking the outputs clients still hold), never lowers it, and gives
the process's setting back when it stops, unless someone changed it meanwhile. The
oracle is ``gc.get_threshold()`` read on the engine thread and after shutdown."""

from __future__ import annotations

import asyncio
import gc

import pytest

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import GC_YOUNG_THRESHOLD, AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampling import SamplingParams


@pytest.fixture
def saved_threshold():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def _engine(tiny_dirs):
    return LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), dtype="float32", device="cpu",
                                num_gpu_blocks=64, num_state_slots=8, max_num_seqs=4,
                                max_num_batched_tokens=64, max_model_len=256))


def _run(aengine):
    async def main():
        stream = await aengine.generate("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        outs = [o async for o in stream]
        toks = outs[-1].outputs[0].token_ids if outs[-1].finished else []
        during = await aengine.call(lambda e: gc.get_threshold())
        return toks, during
    try:
        return asyncio.run(main())
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("start", [(700, 10, 10), (500, 7, 3)])
def test_threshold_raised_while_running_and_given_back(tiny_dirs, saved_threshold, start):
    gc.set_threshold(*start)
    toks, during = _run(AsyncEngine(_engine(tiny_dirs)))
    assert len(toks) == 4
    assert during == (GC_YOUNG_THRESHOLD, *start[1:])
    assert gc.get_threshold() == start


def test_threshold_never_lowered_and_none_leaves_it(tiny_dirs, saved_threshold):
    gc.set_threshold(GC_YOUNG_THRESHOLD * 3, 10, 10)
    _, during = _run(AsyncEngine(_engine(tiny_dirs)))
    assert during == (GC_YOUNG_THRESHOLD * 3, 10, 10)
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD * 3, 10, 10)
    gc.set_threshold(700, 10, 10)
    _, during = _run(AsyncEngine(_engine(tiny_dirs), gc_young_threshold=None))
    assert during == (700, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_threshold_changed_while_running_is_kept(tiny_dirs, saved_threshold):
    gc.set_threshold(700, 10, 10)
    aengine = AsyncEngine(_engine(tiny_dirs))

    async def main():
        during = await aengine.call(lambda e: gc.get_threshold())
        gc.set_threshold(1234, 10, 10)  # the application's own choice, made while it runs
        return during
    try:
        during = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert during == (GC_YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (1234, 10, 10)
