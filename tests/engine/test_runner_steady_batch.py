"""A steady batch reuses what did not change (staged views, table views, the CPU
batch's int32/bool buffers); every step's batch must still hold exactly what the
scheduler's plan says. The oracle is the plan itself (its arrays, converted by
numpy) and a gather of the persistent tables, over steps whose batch grows,
shrinks, and changes rows (adds, aborts, finishes, n = 2, prefix-cache hits)."""

from __future__ import annotations

import random

import numpy as np
import torch

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampling import SamplingParams
from hybridserve.staging import StagingBuffer


def test_every_batch_holds_the_plan_and_a_steady_batch_reuses_its_tensors(tiny_dirs, monkeypatch):
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), device="cpu", dtype="float32",
                                  block_size=4, max_num_seqs=8, num_gpu_blocks=160, num_state_slots=24))
    runner = engine.runner
    real = runner.build_batch
    seen = {"steps": 0, "reused": 0, "changed": 0}
    last: dict = {}

    def build_batch(plan, *a):
        batch, sampling, num_samples = real(plan, *a)
        as64 = lambda x: torch.from_numpy(np.asarray(x, dtype=np.int64))  # noqa: E731
        assert torch.equal(batch.input_ids, as64(plan.input_ids))
        assert torch.equal(batch.positions, as64(plan.positions))
        assert torch.equal(batch.slot_mapping, as64(plan.slot_mapping))
        assert batch.query_start_loc.dtype == torch.int32 and batch.seq_lens.dtype == torch.int32
        assert torch.equal(batch.query_start_loc.long(), as64(plan.query_start_loc))
        assert torch.equal(batch.seq_lens.long(), as64(plan.seq_lens))
        assert torch.equal(batch.has_initial_state, torch.from_numpy(np.asarray(plan.num_computed_tokens) > 0))
        rows = torch.from_numpy(np.asarray(plan.block_table_rows, dtype=np.int64))
        width = -(-int(np.max(plan.seq_lens)) // engine.block_size)
        assert torch.equal(batch.block_tables, runner.block_table_buf[rows, :width])
        assert torch.equal(batch.state_pages, runner.state_table_buf[rows])
        qsl = np.asarray(plan.query_start_loc)
        assert torch.equal(batch.logits_indices[: len(sampling)], as64(qsl[1:][sampling] - 1))
        same = (last.get("n") == len(qsl) - 1 and last.get("width") == width
                and np.array_equal(last.get("rows"), np.asarray(plan.block_table_rows)))
        if same and bool((np.diff(np.asarray(plan.block_table_rows)) == 1).all()):
            assert batch.seq_lens is last["seq_lens"] and batch.block_tables is last["tables"]
            seen["reused"] += 1
        else:
            seen["changed"] += 1
        last.update(n=len(qsl) - 1, width=width, rows=np.asarray(plan.block_table_rows).copy(),
                    seq_lens=batch.seq_lens, tables=batch.block_tables)
        seen["steps"] += 1
        return batch, sampling, num_samples

    monkeypatch.setattr(runner, "build_batch", build_batch)
    rng = random.Random(3)
    shared = list(range(1, 13))
    for i in range(70):
        # Bursts of admissions and the odd abort, with steady decode steps between.
        for j in range(3 if i % 12 == 0 else 0):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 9))]
            engine.add_request(f"r{i}.{j}", prompt, SamplingParams(
                temperature=0.0 if rng.random() < 0.5 else 0.9, seed=i, n=2 if rng.random() < 0.2 else 1,
                max_tokens=rng.randrange(4, 24), ignore_eos=True))
        if engine.requests and i % 12 == 7:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert seen["reused"] >= 5 and seen["changed"] >= 5, seen


def test_staging_views_hold_the_segments_when_reused():
    """Segments of every kind (lists, int32, bool, 2-D int64) staged again and again,
    with the same and with other lengths: each view equals the segment converted to
    int64 (numpy's conversion is the oracle), reused view objects included."""
    buf = StagingBuffer("cpu", capacity=8)
    rng = np.random.default_rng(0)
    shapes = [(3, 0, 5, 2), (3, 0, 5, 2), (1, 4, 0, 6), (1, 4, 0, 6), (3, 0, 5, 2)]
    prev = None
    for step in range(25):
        lens = shapes[step % len(shapes)] if step < 20 else tuple(rng.integers(0, 40, size=4))
        segs = [list(rng.integers(-50, 50, size=lens[0]).tolist()),
                rng.integers(-2**31, 2**31 - 1, size=lens[1], dtype=np.int32),
                rng.random(lens[2]) < 0.5,
                rng.integers(-2**40, 2**40, size=(lens[3], 2))]
        views = buf.stage(segs)
        for v, s in zip(views, segs):
            assert torch.equal(v, torch.from_numpy(np.asarray(s, dtype=np.int64).reshape(-1)))
        if prev is not None and prev[0] == lens:
            assert all(a is b for a, b in zip(views, prev[1]))
        prev = (lens, views)
