"""A CPU engine runs its host work's torch ops on one thread and the model call on its
own thread count (``HOST_PARALLEL_MIN_ELEMENTS``), and gives the count back after
every step, a failed one included; with prompt logprobs the step keeps its threads."""

from __future__ import annotations

import pytest
import torch

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampling import SamplingParams


class _ThreadsSeen(torch.nn.Module):
    """The model, recording torch's intra-op thread count at each call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen: list[int] = []

    def forward(self, *args, **kwargs):
        self.seen.append(torch.get_num_threads())
        return self.inner(*args, **kwargs)


def _engine(tiny_dirs, max_num_seqs=8):
    return LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), dtype="float32", device="cpu",
                                num_gpu_blocks=256, num_state_slots=max_num_seqs + 8, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max(64, max_num_seqs), max_model_len=512, cpu_threads=2))


def _watch_sampler(engine, seen):
    for name in ("plan", "sample_planned"):
        fn = getattr(engine.sampler, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            seen.append((_name, torch.get_num_threads()))
            return _fn(*a, **k)

        setattr(engine.sampler, name, wrapped)


def test_host_work_on_one_thread_the_model_on_the_engines(tiny_dirs):
    torch_threads = torch.get_num_threads()
    try:
        engine = _engine(tiny_dirs)
        assert engine.cpu_threads == 2 and engine.core._host_one_thread
        model = engine.runner.model = _ThreadsSeen(engine.runner.model)
        seen: list[tuple[str, int]] = []
        _watch_sampler(engine, seen)
        for i in range(3):
            engine.add_request(None, list(range(3 + i, 30 + i)),
                               SamplingParams(max_tokens=5, temperature=0.8 if i else 0.0, seed=i, top_k=20,
                                              presence_penalty=0.3))
        while engine.has_unfinished_requests():
            engine.step()
            assert torch.get_num_threads() == 2  # given back after every step
        assert model.seen and set(model.seen) == {2}
        # The plan runs before the model call (engine threads), the draw after it (one).
        assert {n for name, n in seen if name == "sample_planned"} == {1}
        # A step that fails after the model call gives the threads back too.
        engine.add_request("x", list(range(3, 20)), SamplingParams(max_tokens=3))

        def broken(*a, **k):
            raise RuntimeError("sampler broke")

        engine.sampler.sample_planned = broken
        failed = engine.stats()["failed_steps"]
        engine.step()  # rolled back, its request to be retried (faults stay local)
        assert engine.stats()["failed_steps"] == failed + 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(torch_threads)


def test_prompt_logprobs_and_large_vocabularies_keep_the_engines_threads(tiny_dirs):
    torch_threads = torch.get_num_threads()
    try:
        engine = _engine(tiny_dirs)
        seen: list[tuple[str, int]] = []
        _watch_sampler(engine, seen)
        engine.add_request(None, list(range(3, 30)), SamplingParams(max_tokens=2), prompt_logprobs=2)
        engine.step()  # the prefill, with its prompt logprobs: [tokens, vocab] ops
        assert [n for name, n in seen if name == "sample_planned"] == [2]
        # Logits past the limit: every step keeps the engine's threads.
        vocab = engine.model_config.vocab_size
        from hybridserve.engine.device import HOST_PARALLEL_MIN_ELEMENTS

        big = HOST_PARALLEL_MIN_ELEMENTS // vocab + 1
        assert not _engine(tiny_dirs, max_num_seqs=big).core._host_one_thread
    finally:
        torch.set_num_threads(torch_threads)


def test_a_steady_batch_reuses_its_sampler_rows_and_only_then(tiny_dirs):
    """The rows of a steady decode batch are the last step's list; every step's rows
    must be the rows the per-request lookup gives (the oracle, run with the cache
    cleared) while requests are added, aborted and finished, and n > 1 requests
    fork."""
    import random

    engine = _engine(tiny_dirs)
    rng = random.Random(3)
    hits = [0]
    inner = engine.core._sampling_rows

    def checked(plan, batch_index, num_samples):
        cache_before = engine.core._rows_cache
        got = inner(plan, batch_index, num_samples)
        if cache_before is not None and got is cache_before[3]:
            hits[0] += 1
        saved, engine.core._rows_cache = engine.core._rows_cache, None
        want = inner(plan, batch_index, num_samples)
        engine.core._rows_cache = saved
        assert len(got) == len(want)
        for a, b in zip(got, want):
            if b.num_samples > 1:  # fork rows are made fresh each step: compare their fields
                assert (a.params, a.keys) == (b.params, b.keys)
            else:
                assert a is b
        return got

    engine.core._sampling_rows = checked
    n = 0
    for step in range(60):
        if step % 7 == 0 and n < 12:
            for _ in range(2):
                engine.add_request(f"r{n}", list(range(3 + n, 20 + n)),
                                   SamplingParams(max_tokens=rng.randrange(3, 20), temperature=0.8, seed=n,
                                                  n=2 if n % 5 == 4 else 1))
                n += 1
        if step % 11 == 5 and engine.requests:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert hits[0] > 10
    # The same id aborted and added again between two steps: the same plan, other rows.
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(2):
        engine.add_request("solo", list(range(5, 30)), SamplingParams(max_tokens=30, temperature=0.8, seed=1))
        for _ in range(3):
            engine.step()
        engine.abort_request("solo")
