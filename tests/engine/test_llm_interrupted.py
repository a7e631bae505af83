"""LLM.generate / LLM.beam_search interrupted mid-run (Ctrl-C, an exception in a
step) leave nothing running: the unfinished requests are aborted and the pools whole."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.beam_search import BeamSearchParams


def _interrupt_after(engine, n_steps):
    real = engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > n_steps:
            raise KeyboardInterrupt
        return real()

    engine.step = step
    return real


@pytest.mark.parametrize("kind", ["generate", "beam_search"])
def test_interrupted_call_aborts_what_it_started(tiny_dirs, kind):
    llm = LLM(str(tiny_dirs["test-a"]), dtype="float32", device="cpu", num_pages=48 + 3 * 8, max_num_seqs=8)
    engine = llm.engine
    real_step = _interrupt_after(engine, 3)
    with pytest.raises(KeyboardInterrupt):
        if kind == "generate":
            llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))
        else:
            llm.beam_search([[1, 2, 3, 4]], BeamSearchParams(beam_width=3, max_tokens=20))
    engine.step = real_step
    engine.step()  # the aborts are reported and freed at the next plan
    st = engine.stats()
    assert not engine.has_unfinished_requests()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0 and st["aborted_requests"] >= 1
    # The engine still serves: a fresh call completes.
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
