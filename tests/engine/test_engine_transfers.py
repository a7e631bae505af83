"""The per-step transfer structure that can be asserted without a GPU.

A recording shim on :func:`hybridserve.staging.h2d_copy` counts the host->device
copies of every engine step: the runner sends the whole plan (block-table updates,
copy-on-write and fork copy lists, tokens, positions, slot mapping, ...) and the
sampler's row data in exactly one copy; nothing else in the step goes through a
staging copy. On a GPU, benches/gpu_check.py asserts the stronger property
(no synchronising call in a decode step) with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import pytest

from hybridserve import staging
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.runner.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets
from hybridserve.sampling import SamplingParams


def test_one_staging_copy_per_step_for_the_plan_and_the_sampler(tiny_dirs, monkeypatch):
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), device="cpu", dtype="float32",
                                  block_size=4, max_num_seqs=8, num_gpu_blocks=64, num_state_slots=16))
    assert engine.runner.graphs is None and not engine.use_cuda_graphs  # never on the CPU
    calls: list[str] = []
    real = staging.h2d_copy
    runner_buf = engine.runner.staging

    def shim(dst, src):
        calls.append("runner" if dst.untyped_storage().data_ptr() == runner_buf.dev.untyped_storage().data_ptr()
                     else "other")
        real(dst, src)

    monkeypatch.setattr(staging, "h2d_copy", shim)
    # A shared prefix (prefix-cache hits, copy-on-write of the partial block), n=3
    # forks (state-slot copies), seeded penalties and a logit bias: every kind of
    # per-step data.
    prompt = list(range(1, 11))
    engine.add_request("a", prompt, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6,
                                                   presence_penalty=0.5, logit_bias={3: 2.0}))
    engine.add_request("b", prompt + [12], SamplingParams(temperature=0.0, max_tokens=5,
                                                          repetition_penalty=1.3))
    saw_copies = False
    plan_copies: list[int] = []
    orig = engine.runner.stage

    def stage(plan, *a):
        plan_copies.append(len(plan.block_copies) + len(plan.state_copies))
        return orig(plan, *a)

    monkeypatch.setattr(engine.runner, "stage", stage)
    steps = sampled_steps = 0
    while engine.has_unfinished_requests():
        calls.clear()
        engine.step()
        saw_copies |= plan_copies[-1] > 0
        # The sampler's row data rode in the runner's copy: no copy of its own.
        assert calls == ["runner"], calls
        sampled_steps += engine.last_step_stats["num_scheduled_seqs"] > 0
        steps += 1
        assert steps < 50
    assert saw_copies, "the scenario should exercise copy-on-write / fork copies"
    assert sampled_steps >= 5
    assert engine.sampler.num_tracked_rows == 0, "finished requests must release their sampler rows"


def test_decode_buckets_and_cpu_refusal(tiny_dirs):
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert [bucket_for(decode_buckets(30), n) for n in (1, 3, 9, 25, 30, 31)] == [1, 4, 16, 30, 30, None]
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), device="cpu", dtype="float32", num_pages=16))
    scratch = list(range(engine.cache.state_pages))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(engine.model, engine.cache, max_num_seqs=4, max_blocks_per_seq=4, scratch_pages=scratch)
    with pytest.raises(ValueError, match="scratch_pages must be"):
        DecodeGraphs(engine.model, engine.cache, max_num_seqs=4, max_blocks_per_seq=4, scratch_pages=[0],
                     replay_eagerly=True)


def test_decode_graph_plumbing_gives_the_eager_engine_tokens(tiny_dirs):
    """The graph runner's data path (static buffers, full-width block tables, padding
    rows on the scratch state pages, bucket choice, output slicing) with the model run
    on the padded buffers instead of a captured graph (its CPU test hook): the engine's
    tokens must equal the eager engine's while batches shrink across buckets."""
    import torch

    from hybridserve.model.cache import HybridCache

    def run(with_graphs: bool):
        engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), device="cpu", dtype="float32",
                                      block_size=4, max_num_seqs=6, num_pages=160))
        graphs = None
        if with_graphs:
            # The arena with state_pages scratch pages past the scheduler's page ids, as
            # the engine builds it on CUDA.
            n = engine.num_pages
            cache = HybridCache(engine.model_config, engine.cache.layout, n + engine.cache.state_pages,
                                dtype=torch.float32)
            scratch = list(range(n, n + cache.state_pages))
            engine.cache = engine.runner.cache = cache
            graphs = DecodeGraphs(engine.model, cache, max_num_seqs=6, max_blocks_per_seq=engine.max_blocks_per_seq,
                                  scratch_pages=scratch, replay_eagerly=True)
            graphs.capture()
            engine.runner.graphs = graphs
            scratch_before = cache.pages[n:].clone()
        for i in range(5):
            params = SamplingParams(temperature=0.0 if i != 2 else 0.9, seed=7, max_tokens=3 + 2 * i,
                                    ignore_eos=True)
            engine.add_request(f"r{i}", [(5 * i + j) % 250 + 1 for j in range(3 + 4 * i)], params)
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        if graphs is not None:
            # Padding rows used the scratch pages (their state changed) and nothing else.
            assert not torch.equal(scratch_before, cache.pages[n:])
        return tokens, graphs

    eager, _ = run(False)
    replayed, graphs = run(True)
    assert replayed == eager
    assert graphs.replays >= 8  # decode steps at batch sizes 5, 4, 3, 2, 1 went through it


def test_batch_block_tables_are_a_view_when_rows_are_consecutive(tiny_dirs, monkeypatch):
    """A batch whose block-table rows are consecutive reads the runner's persistent
    table through a view (no per-step copy that grows with context); any other batch
    gathers its rows. Either way the batch's tables are the rows the plan names (the
    oracle: a gather of those rows of the persistent buffer)."""
    import numpy as np
    import torch

    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), device="cpu", dtype="float32",
                                  block_size=4, max_num_seqs=8, num_gpu_blocks=96, num_state_slots=16))
    runner = engine.runner
    seen = {"view": 0, "gather": 0}
    real = runner.build_batch

    def build_batch(plan, *a):
        batch, sampling, num_samples = real(plan, *a)
        rows = np.asarray(plan.block_table_rows, dtype=np.int64)
        width = batch.block_tables.shape[1]
        want = runner.block_table_buf[torch.from_numpy(rows), :width]
        assert torch.equal(batch.block_tables, want)
        assert torch.equal(batch.state_pages, runner.state_table_buf[torch.from_numpy(rows)])
        shares = batch.block_tables.untyped_storage().data_ptr() == runner.block_table_buf.untyped_storage().data_ptr()
        consecutive = bool((np.diff(rows) == 1).all())
        assert shares == consecutive
        seen["view" if shares else "gather"] += 1
        return batch, sampling, num_samples

    monkeypatch.setattr(runner, "build_batch", build_batch)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid in "abc":
        engine.add_request(rid, list(range(1, 14)), greedy)
    for _ in range(4):
        engine.step()
    engine.abort_request("b")  # rows 0, 2 left: not consecutive
    engine.add_request("d", list(range(2, 9)), greedy)
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["view"] and seen["gather"]
