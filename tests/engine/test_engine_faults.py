"""Faults stay local (hybridserve.engine.faults): a step that raises is rolled back,
its requests retried once from their committed tokens or ended with an error; the
others go on exactly as in a fault-free run, and every page comes back. The oracle is
the same engine without faults (itself checked against HF elsewhere)."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine import faults
from hybridserve.engine import core as core_mod
from hybridserve.engine.faults import FAULT_INJECT_ENV, FaultInjector
from hybridserve.errors import ConfigError, FatalEngineError

# A small arena so that the load preempts; 16 run slots.
ENGINE = dict(dtype="float32", device="cpu", num_pages=80, max_num_seqs=16, max_num_batched_tokens=256)


def _workload(n: int = 200):
    """Mixed requests: greedy, seeded, n=2 (seeded), prefix hits (a shared 40-token
    prefix), long prompts that preempt in the small arena."""
    shared = [(7 * i) % 200 + 3 for i in range(40)]
    prompts, params = [], []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            prompts.append([(i * 13 + j) % 250 + 1 for j in range(5 + i % 7)])
            params.append(SamplingParams(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            prompts.append([(i * 3 + j) % 250 + 1 for j in range(6)])
            params.append(SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True))
        elif kind == 2:
            prompts.append([(i + j) % 250 + 1 for j in range(4)])
            params.append(SamplingParams(max_tokens=5, n=2, temperature=0.9, seed=1000 + i, ignore_eos=True))
        elif kind == 3:
            prompts.append(shared + [i % 250 + 1, 2])
            params.append(SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        else:
            prompts.append([(i * 5 + j) % 250 + 1 for j in range(60 + i % 20)])
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    return prompts, params


def _tokens(out):
    return [list(c.token_ids) for c in out.outputs]


def _caught_recorder(monkeypatch):
    """Records the requests of every failed step (the plan's and, after the update, the
    update's): the ones a fault caught."""
    caught: set[str] = set()
    real = core_mod.recover_step

    def spy(engine, plan, exc, phase, update=None):
        if plan is not None:
            caught.update(plan.request_ids)
        if update is not None:
            caught.update(update.request_ids)
            caught.update(update.finished_request_ids)
        return real(engine, plan, exc, phase, update)

    monkeypatch.setattr(core_mod, "recover_step", spy)
    return caught


def _assert_whole(engine):
    engine.step()  # aborts are reported and freed at the next plan
    st = engine.stats()
    assert not engine.has_unfinished_requests()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0, st


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    prompts, params = _workload()
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["preemptions"] > 0, "the workload must preempt"
    assert llm.engine.stats()["prefix_hits"] > 0, "the workload must hit the prefix cache"
    return [_tokens(o) for o in outs]


@pytest.mark.parametrize("spec", ["forward=0.05,seed=7", "forward=0.05,sample=0.03,output=0.02,seed=11"])
def test_faults_under_load_stay_local(tiny_dirs, reference, monkeypatch, spec):
    monkeypatch.setenv(FAULT_INJECT_ENV, spec)
    caught = _caught_recorder(monkeypatch)
    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    prompts, params = _workload()
    outs = llm.generate(prompts, params)
    engine = llm.engine
    st = engine.stats()
    assert len(outs) == len(prompts)  # every request ended
    assert st["failed_steps"] > 0 and st["retried_requests"] > 0
    errored = [o for o in outs if any(c.finish_reason == "error" for c in o.outputs)]
    assert st["errored_requests"] == len(errored)
    assert {o.request_id for o in errored} <= caught
    for i, (o, ref) in enumerate(zip(outs, reference)):
        if o.request_id not in caught:
            assert _tokens(o) == ref, (i, o.request_id)
        elif not any(c.finish_reason == "error" for c in o.outputs) and params[i].temperature == 0.0:
            # Retried from its committed tokens: a greedy request still ends the same.
            assert _tokens(o) == ref, (i, o.request_id)
    assert len(caught) > 0
    _assert_whole(engine)


def test_repeated_failures_are_fatal_and_fail_everything(tiny_dirs, monkeypatch):
    monkeypatch.setenv(FAULT_INJECT_ENV, "forward=1.0")
    # Two run slots: the first two requests fail twice (retried, then errored), the
    # third step is the third failure in a row.
    llm = LLM(str(tiny_dirs["test-a"]), **{**ENGINE, "max_num_seqs": 2}, max_consecutive_step_failures=3)
    with pytest.raises(FatalEngineError, match="3 consecutive failed steps"):
        llm.generate([[1, 2, 3], [4, 5, 6], [7, 8], [9, 10], [11, 12]], SamplingParams(max_tokens=4))
    engine = llm.engine
    assert engine.stats()["failed_steps"] == 3
    assert not engine.has_unfinished_requests()
    with pytest.raises(FatalEngineError):
        engine.step()  # the engine stays stopped
    st = engine.scheduler.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0


def test_fatal_after_makes_step_four_fatal(tiny_dirs, monkeypatch):
    monkeypatch.setenv(FAULT_INJECT_ENV, "fatal_after=3")
    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    with pytest.raises(FatalEngineError, match="step 4"):
        engine.step()
    assert engine.stats()["failed_steps"] == 1 and not engine.has_unfinished_requests()


def test_a_real_exception_in_the_runner_is_retried_then_errors(tiny_dirs):
    """Not injected: the runner itself raises (a device error) whenever one request is
    in the batch: retried once, then it ends with an error; the engine goes on. One run
    slot, so the neighbour is never in a failing batch."""
    llm = LLM(str(tiny_dirs["test-a"]), **{**ENGINE, "max_num_seqs": 1})
    engine = llm.engine
    ref = llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    real = engine.runner.execute
    fails = {"n": 0}

    def flaky(plan, *a):
        if "bad" in plan.request_ids and fails["n"] < 2:
            fails["n"] += 1
            real(plan, *a)  # the forward ran (pages written), then the step fails
            raise RuntimeError("transient device error")
        return real(plan, *a)

    engine.runner.execute = flaky
    engine.add_request("good", [9, 8, 7, 6], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["good"].outputs[0].finish_reason == "length"
    assert _tokens(finals["good"]) == _tokens(ref[0])
    st = engine.stats()
    assert st["failed_steps"] == 2 and st["retried_requests"] == 1 and st["errored_requests"] == 1
    engine.runner.execute = real
    _assert_whole(engine)
    # The engine goes on: the good request again, after the faults, gives the same tokens.
    again = llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert _tokens(again[0]) == _tokens(ref[0])


def test_beam_search_caught_in_a_failure(tiny_dirs, monkeypatch):
    from hybridserve.beam_search import BeamSearchParams

    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    ref = llm.beam_search([[1, 2, 3, 4]], BeamSearchParams(beam_width=3, max_tokens=8))
    monkeypatch.setenv(FAULT_INJECT_ENV, "forward=0.15,seed=5")
    llm2 = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    out = llm2.beam_search([[1, 2, 3, 4]] * 4, BeamSearchParams(beam_width=3, max_tokens=8))
    assert llm2.engine.stats()["failed_steps"] > 0
    for o in out:
        if all(s.finish_reason != "error" for s in o.sequences):
            assert [s.tokens for s in o.sequences] == [s.tokens for s in ref[0].sequences]
    _assert_whole(llm2.engine)


def test_injector_spec_parsing():
    assert FaultInjector.parse("") is None
    inj = FaultInjector.parse("forward=0.05,sample=0.01,output=0.01,seed=7")
    assert inj.probs == {"forward": 0.05, "sample": 0.01, "output": 0.01}
    assert FaultInjector.parse("fatal_after=3").fatal_after == 3
    for bad in ("forward=2", "forward", "nosuch=1", "fatal_after=-1", "seed=x"):
        with pytest.raises(ConfigError, match=FAULT_INJECT_ENV):
            FaultInjector.parse(bad)


def test_injection_off_by_default(tiny_dirs, monkeypatch):
    monkeypatch.delenv(FAULT_INJECT_ENV, raising=False)
    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    assert llm.engine.fault_injector is None


def test_fatal_classification():
    import torch

    assert faults.is_fatal(FatalEngineError("x"))
    assert faults.is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not faults.is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not faults.is_fatal(RuntimeError("shape mismatch"))
    assert not faults.is_fatal(KeyboardInterrupt())


def test_async_engine_thread_death_resolves_everything(tiny_dirs, monkeypatch):
    """A fatal fault kills the engine thread: every open stream gets its error, and every
    command queued or submitted after (a /metrics call, an add) fails instead of hanging."""
    from hybridserve.engine.async_engine import AsyncEngine, EngineDeadError

    monkeypatch.setenv(FAULT_INJECT_ENV, "fatal_after=4")
    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    aengine = AsyncEngine(llm.engine)

    async def main():
        streams = [await aengine.generate(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=200, ignore_eos=True))
                   for i in range(3)]

        async def drain(s):
            try:
                async for _ in s:
                    pass
            except EngineDeadError as e:
                return e
            return None

        errs = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 30)
        assert all(isinstance(e, EngineDeadError) for e in errs), errs
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(aengine.call(lambda e: e.stats()), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(aengine.generate("late", [1, 2], SamplingParams(max_tokens=2)), 5)

    asyncio.run(main())
    assert not aengine.is_alive
    aengine.shutdown()


def test_async_engine_queued_commands_fail_when_the_thread_dies(tiny_dirs):
    from hybridserve.engine.async_engine import AsyncEngine, EngineDeadError

    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    aengine = AsyncEngine(llm.engine)

    async def main():
        import threading

        gate = threading.Event()

        def block(engine):
            gate.wait(10)
            raise SystemExit("engine thread killed")  # not an Exception: kills the thread

        first = asyncio.ensure_future(aengine.call(block))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(aengine.call(lambda e: 1))  # behind the blocked call
        gate.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(first, 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(queued, 10)

    asyncio.run(main())
    aengine.shutdown()


def test_error_finish_is_a_request_failure_on_the_stream(tiny_dirs, monkeypatch):
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.errors import RequestFailed

    llm = LLM(str(tiny_dirs["test-a"]), **ENGINE)
    engine = llm.engine
    real = engine.runner.execute

    def always_for_bad(plan, *a):
        if "bad" in plan.request_ids:
            raise RuntimeError("boom")
        return real(plan, *a)

    engine.runner.execute = always_for_bad
    aengine = AsyncEngine(engine)

    async def main():
        bad = await aengine.generate("bad", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RequestFailed, match="retry"):
            async for _ in bad:
                pass
        engine.runner.execute = real
        good = await aengine.generate("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        last = None
        async for o in good:
            last = o
        assert last.outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert aengine.is_alive
    aengine.shutdown()
