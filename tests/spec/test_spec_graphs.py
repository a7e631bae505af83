"""The verify graphs' data path (hybridserve.runner.verify_graphs) on the CPU.

CUDA graphs need a device; their test hook (``replay_eagerly``) runs the model on the
graphs' static, padded buffers at each replay instead, so everything around the
capture is exercised here: the input copies, the per-row attention layout computed
from the static buffers, padding sequences on the scratch state pages, the preset ring
and the commit from it, the hidden states handed to the drafter, bucket choice as the
batch shrinks, and the decode graphs that return hidden states for a speculating
engine. The model runs its module path (the one CUDA runs), not the CPU's native step.

The oracle is the eager engine without speculation: greedy output must be identical
token for token. The capture itself is checked on a GPU by benches/gpu_check.py.
Last, a verify step that runs eagerly on a device lays out its runs from the runner's
host copies, reading nothing back (checked on the meta device, which has no data).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine import builder
from hybridserve.model.qwen3_5 import Qwen3_5ForServing


@pytest.fixture(scope="module")
def ckpt(spec_tiny):
    return spec_tiny


@pytest.fixture(scope="module")
def any_ckpt(any_spec_ckpt):
    """Random MTP weights (drafts rejected: every rejection path) and the trained
    default model (drafts accepted: commits of several rows); tests/spec/conftest.py."""
    return any_spec_ckpt


def _prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 200) for _ in range(rnd.randint(3, 30))] for _ in range(n)]


def _generate(ckpt: str, prompts, params, k: int | None, graphs: bool, monkeypatch):
    monkeypatch.setattr(Qwen3_5ForServing, "native_decode", False)
    monkeypatch.setattr(builder, "_use_cuda_graphs", lambda config: graphs)
    kw = {}
    if k is not None:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 5}
    llm = LLM(ckpt, dtype="float32", num_pages=400, max_num_seqs=6, block_size=16, max_model_len=256, **kw)
    runner, steps = llm.engine.runner, []
    choose = runner._graphs_for

    def graphs_for(batch, spec, all_positions):
        g = choose(batch, spec, all_positions)
        qsl = batch.query_start_loc.tolist()
        longest = max(b - a for a, b in zip(qsl, qsl[1:]))
        steps.append((batch.num_seqs, batch.num_tokens, len(spec), int(batch.logits_indices.shape[0]), longest,
                      None if g is None else g.kind))
        return g

    runner._graphs_for = graphs_for
    if runner.verify_graphs is not None:
        runner.verify_graphs.run = _checked(runner.verify_graphs.run, llm.engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, [[c.token_ids for c in o.outputs] for o in outs], steps


def _checked(run, engine):
    """The verify graphs' ``run``, also checking each replay against an eager forward of
    the same batch: the logits, the hidden states and the ring the commit replays (the
    graph's holds every sequence's rows in its slot of k + 1, the eager one the
    speculative sequences' rows in batch order). The eager forward writes the same K/V
    again and leaves the state pages alone."""

    def checked(batch, *args):
        logits, hidden = run(batch, *args)
        got = (logits.clone(), hidden.clone(), batch.spec_ring)
        ring = {key: tuple(t.clone() for t in v) for key, v in got[2].items() if isinstance(key, int)}
        fresh = dataclasses.replace(batch, spec_ring=None, op_plans={})
        want_logits, want_hidden = engine.model(fresh, engine.cache, return_hidden=True)
        torch.testing.assert_close(got[0], want_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want_hidden, rtol=1e-5, atol=1e-5)
        r = engine.runner.verify_graphs.rows
        qsl = batch.query_start_loc.tolist()
        slots = torch.tensor([i * r + j for i in fresh.spec_ring["seqs"] for j in range(qsl[i + 1] - qsl[i])])
        assert ring.keys() == {key for key in fresh.spec_ring if isinstance(key, int)}
        for key, value in fresh.spec_ring.items():
            if isinstance(key, int):
                for mine, theirs in zip(ring[key], value):
                    torch.testing.assert_close(mine.index_select(0, slots), theirs, rtol=1e-5, atol=1e-5)
        batch.spec_ring = got[2]
        return logits, hidden

    return checked


@pytest.mark.parametrize("k", [1, 3])
def test_verify_graphs_give_the_eager_engine_tokens(any_ckpt, k, monkeypatch):
    prompts = _prompts(6, seed=k)
    # Different lengths: the batch shrinks through the buckets (6 -> ... -> 1); 6
    # decoding sequences do not draft (disable_by_batch_size 5), fewer do.
    params = [SamplingParams(max_tokens=8 + 10 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    _, eager, _ = _generate(any_ckpt, prompts, params, None, False, monkeypatch)
    llm, replayed, steps = _generate(any_ckpt, prompts, params, k, True, monkeypatch)
    assert replayed == eager
    runner = llm.engine.runner
    verify, decode = runner.verify_graphs, runner.graphs
    assert verify is not None and verify.buckets == [1, 2, 4] and verify.rows == k + 1
    assert decode.return_hidden and decode.buckets[-1] == 6
    # Every step with drafts whose rows all sample (drafting runs of up to k + 1 rows,
    # plain decodes beside them) within the buckets replayed the verify graphs, every
    # pure decode step (after prefill, over the drafting limit, or with every request
    # resting for low acceptance) the decode graphs; the rest (prefill rows) ran eagerly.
    for n, t, spec, sampled, longest, kind in steps:
        if spec and sampled == t and longest <= k + 1 and n <= 4:
            assert kind == "verify", steps
        elif spec == 0 and t == n:
            assert kind == "decode", steps
        else:
            assert kind is None, steps
    assert verify.replays == sum(kind == "verify" for *_, kind in steps) >= 2
    assert decode.replays == sum(kind == "decode" for *_, kind in steps) >= 5
    # Among them ragged ones: fewer than k drafts, or plain decodes beside the drafts.
    assert any(kind == "verify" and (spec < n or t < n * (k + 1)) for n, t, spec, _, _, kind in steps), steps
    st = llm.engine.stats()
    assert st["spec_draft_tokens"] > 0
    assert st["free_pages"] + st["cached_pages"] + st["checkpoint_pages"] == st["num_pages"], st


def test_a_verify_step_sends_its_layout_in_the_one_staging_copy(ckpt, monkeypatch):
    """The verify graphs' slot layout and the speculative flags travel in the runner's
    one staging copy: every step makes exactly one host->device copy (a recording shim
    on ``staging.h2d_copy``), and every replay finds its layout staged, a view of that
    copy's device buffer. (On the CPU the graphs' own fallback copy would be no copy at
    all, so the shim alone could not see it.)"""
    from hybridserve import staging
    from hybridserve.runner.verify_graphs import VERIFY_LAYOUT, VerifyGraphs

    calls: list[str] = []
    real = staging.h2d_copy
    fills: list[tuple] = []
    fill = VerifyGraphs._fill

    def shim(dst, src):
        calls.append(dst.untyped_storage().data_ptr())
        real(dst, src)

    def checked_fill(self, batch, n):
        fills.append((batch.op_plans.get(VERIFY_LAYOUT), batch.speculative.tolist(), batch.speculative_host))
        fill(self, batch, n)

    monkeypatch.setattr(staging, "h2d_copy", shim)
    monkeypatch.setattr(VerifyGraphs, "_fill", checked_fill)
    prompts = _prompts(4, seed=7)
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    llm, replayed, steps = _generate(ckpt, prompts, params, 2, True, monkeypatch)
    runner = llm.engine.runner
    dev = runner.staging.dev.untyped_storage().data_ptr()
    assert calls and set(calls) == {dev} and len(calls) == len(steps), (len(calls), len(steps))
    assert len(fills) == runner.verify_graphs.replays >= 2
    for layout, flags, spec in fills:
        assert layout is not None and layout.untyped_storage().data_ptr() == dev
        assert [i for i, f in enumerate(flags) if f] == spec
    _, eager, _ = _generate(ckpt, prompts, params, None, False, monkeypatch)
    assert replayed == eager


def test_verify_graphs_need_drafts(ckpt):
    from hybridserve.runner.verify_graphs import VerifyGraphs

    llm = LLM(ckpt, dtype="float32", num_pages=40, max_num_seqs=2, block_size=16, max_model_len=64)
    cache = llm.engine.cache
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        VerifyGraphs(llm.engine.model, cache, num_speculative_tokens=0, max_num_seqs=2, max_blocks_per_seq=4,
                     scratch_pages=list(range(cache.state_pages)), replay_eagerly=True)


def test_a_device_batch_lays_out_its_runs_from_host_copies():
    """On a device, a verify step's layout (the ring's runs and the rows-as-decodes
    attention layout) comes from the host copies the runner sets, reading nothing back:
    here every tensor is on the meta device, where any read of its values raises."""
    from hybridserve.model.batch import ForwardBatch
    from hybridserve.model.native_buffers import DECODE_ROWS

    meta = dict(device="meta")
    qsl, lens = [0, 3, 4, 7], [10, 5, 20]  # runs of 3 (speculative), 1, 3 (speculative)
    batch = ForwardBatch(
        input_ids=torch.empty(7, dtype=torch.int64, **meta), positions=torch.empty(7, dtype=torch.int64, **meta),
        slot_mapping=torch.empty(7, dtype=torch.int64, **meta),
        query_start_loc=torch.empty(4, dtype=torch.int32, **meta), seq_lens=torch.empty(3, dtype=torch.int32, **meta),
        block_tables=torch.empty(3, 2, dtype=torch.int32, **meta), state_pages=torch.empty(3, 1, dtype=torch.int32, **meta),
        has_initial_state=torch.empty(3, dtype=torch.bool, **meta), logits_indices=torch.empty(7, dtype=torch.int64, **meta),
        speculative=torch.empty(3, dtype=torch.bool, **meta), query_start_loc_host=qsl, seq_lens_host=lens,
        speculative_host=[0, 2])
    with pytest.raises(Exception):
        batch.speculative.tolist()  # what the layout must not do
    Qwen3_5ForServing._open_ring(batch)
    ring = batch.spec_ring
    assert ring["seqs"] == [0, 2] and ring["lens"] == [3, 3] and not ring["all"]
    q_e, l_e, tables = batch.op_plans[DECODE_ROWS]
    # Entries: 3 decodes, the plain run, 3 decodes.
    assert q_e.shape == (8,) and l_e.shape == (7,) and tables.shape == (7, 2)
    assert ring["rows"].shape == (6,)
