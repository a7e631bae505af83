"""Prefix caching on the hybrid model, end to end, against HF transformers.

A prefix-cache hit must skip compute (DeltaNet state checkpoints restored, only the
rest prefilled) and change nothing: every logits row the engine computes is checked
against HF ``Qwen3_5ForCausalLM`` run over the completion's full sequence (1e-4
relative, float32), greedy tokens must be HF's, and the scheduler's counters must
show that tokens were actually skipped (not merely KV-matched) where expected.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve import LLM, SamplingParams

REL_TOL = 1e-4
GREEDY = dict(temperature=0, ignore_eos=True)


class Capture:
    """Records every logits row the runner returns, with (request, sample, draws, position)."""

    def __init__(self, llm: LLM):
        self.rows: list[tuple[str, int, int, int, torch.Tensor]] = []
        self.computed: list[int] = []  # tokens fed per step
        runner = llm.engine.runner
        inner = runner.execute

        def execute(plan):
            step = inner(plan)
            self.computed.append(len(plan.input_ids))
            if step is not None:
                seq_lens = np.asarray(plan.seq_lens)
                for row, (b, k) in enumerate(zip(step.batch_index.tolist(), step.num_samples.tolist())):
                    self.rows.append((plan.request_ids[b], int(plan.sample_indices[b]), k,
                                      int(seq_lens[b]) - 1, step.logits[row].detach().clone()))
            return step

        runner.execute = execute


def check_hf(hf_model, outs, cap: Capture, *, greedy: bool, prefix: list[int] | None = None) -> None:
    """With ``prefix`` (shared by every prompt), HF runs it once and continues each
    sequence from a copy of its own cache (HF's cached path, independent of ours);
    logits at positions inside the prefix are then not available (none are sampled)."""
    import copy

    by_id = {o.request_id: o for o in outs}
    ref: dict[tuple[str, int], torch.Tensor] = {}
    pre = None
    if prefix is not None:
        with torch.no_grad():
            pre = hf_model(torch.tensor([prefix]), use_cache=True)
    for o in outs:
        for c in o.outputs:
            seq = list(o.prompt_token_ids) + list(c.token_ids)
            with torch.no_grad():
                if pre is None:
                    ref[(o.request_id, c.index)] = hf_model(torch.tensor([seq])).logits[0].float()
                else:
                    assert seq[:len(prefix)] == prefix
                    rest = hf_model(torch.tensor([seq[len(prefix):]]),
                                    past_key_values=copy.deepcopy(pre.past_key_values), use_cache=True)
                    pad = torch.full((len(prefix), rest.logits.shape[-1]), float("nan"))
                    ref[(o.request_id, c.index)] = torch.cat([pad, rest.logits[0].float()])
            if greedy:
                p = len(o.prompt_token_ids)
                want = ref[(o.request_id, c.index)][p - 1: len(seq) - 1].argmax(-1).tolist()
                assert list(c.token_ids) == want, (o.request_id, c.index)
    rows = [r for r in cap.rows if r[0] in by_id]
    assert rows
    for rid, si, k, pos, row in rows:
        r = ref[(rid, 0 if k > 1 else si)][pos]
        rel = (row - r).abs().max().item() / r.abs().max().item()
        assert rel <= REL_TOL, f"{rid} sample {si} pos {pos}: relative error {rel:.2e}"
    assert sum(k for _, _, k, _, _ in rows) == sum(len(c.token_ids) for o in outs for c in o.outputs)


def toks(rng: random.Random, n: int, vocab: int = 259) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def make(tiny_dirs, preset="test-a", **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", block_size=16, num_pages=256 + 3 * 16,
                max_num_seqs=8, max_num_batched_tokens=2048)
    args.update(kw)
    return LLM(tiny_dirs[preset], **args)


def test_shared_system_prompt_skips_compute_and_matches_hf(tiny_dirs, hf_models):
    # 1,003-token system prompt (ends mid-block), 8 requests with different user parts:
    # the first writes a checkpoint at its prompt's last block, the second at the
    # branch point (end of the shared blocks), the other six resume there.
    rng = random.Random(5)
    system = toks(rng, 1003)
    prompts = [system + toks(rng, 10 + i) for i in range(8)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    on = make(tiny_dirs)
    cap = Capture(on)
    outs = on.generate(prompts[:1], params) + on.generate(prompts[1:2], params)
    before = on.engine.stats()
    assert before["checkpoint_writes"] >= 2 and before["prefix_skipped_tokens"] == 0
    steps_before = len(cap.computed)
    outs += on.generate(prompts[2:], params)
    st = on.engine.stats()
    shared = (1003 // 16) * 16
    assert st["checkpoint_hits"] - before["checkpoint_hits"] == 6
    assert st["prefix_skipped_tokens"] - before["prefix_skipped_tokens"] == 6 * shared
    # The six resumed requests fed only the tokens after the checkpoint, then decodes.
    fed = sum(cap.computed[steps_before:])
    assert fed == sum(len(q) - shared for q in prompts[2:]) + 6 * 3
    check_hf(hf_models["test-a"], outs, cap, greedy=True, prefix=system)
    # Identical to a run without prefix caching.
    off = make(tiny_dirs, enable_prefix_caching=False)
    outs_off = off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outs_off]
    assert off.engine.stats()["checkpoint_writes"] == 0
    assert on.engine.stats()["running_state_pages"] == 0 and on.engine.stats()["used_blocks"] == 0


@pytest.mark.parametrize("block_size", [16, 32])
def test_second_turn_resumes_from_the_first_turns_checkpoint(block_size, tiny_dirs, hf_models):
    rng = random.Random(6)
    llm = make(tiny_dirs, "test-b", block_size=block_size)
    cap = Capture(llm)
    first = toks(rng, 150)
    o1 = llm.generate([first], SamplingParams(max_tokens=12, **GREEDY))
    second = first + list(o1[0].outputs[0].token_ids) + toks(rng, 25)
    before = llm.engine.stats()
    o2 = llm.generate([second], SamplingParams(max_tokens=6, **GREEDY))
    st = llm.engine.stats()
    assert st["prefix_skipped_tokens"] - before["prefix_skipped_tokens"] == (149 // block_size) * block_size
    check_hf(hf_models["test-b"], o1 + o2, cap, greedy=True)


def test_evicted_checkpoint_is_recomputed_exactly(tiny_dirs, hf_models):
    # 17 pages: a running 96-token sequence (6 blocks + a 3-page state), one
    # checkpoint (3 pages) and the cached blocks of one prompt. A request with
    # another prompt evicts the first prompt's chain and with it its checkpoint; the
    # first prompt's repeat then recomputes and must still be exact.
    rng = random.Random(7)
    a, b = toks(rng, 90), toks(rng, 90)
    llm = make(tiny_dirs, num_pages=17, max_num_seqs=1)
    cap = Capture(llm)
    p = SamplingParams(max_tokens=5, **GREEDY)
    outs = llm.generate([a + [5]], p) + llm.generate([b + [6]], p)
    mid = llm.engine.stats()
    assert mid["checkpoint_evictions"] + mid["checkpoint_drops"] >= 1
    outs += llm.generate([a + [7]], p)
    st = llm.engine.stats()
    assert st["prefix_skipped_tokens"] == mid["prefix_skipped_tokens"]  # nothing to resume from
    check_hf(hf_models["test-a"], outs, cap, greedy=True)
    # A fresh checkpoint of `a` was written again and serves the next repeat.
    outs2 = llm.generate([a + [8]], p)
    assert llm.engine.stats()["prefix_skipped_tokens"] > st["prefix_skipped_tokens"]
    check_hf(hf_models["test-a"], outs2, cap, greedy=True)
    assert st["available_pages"] == st["num_pages"] and st["running_state_pages"] == 0


def test_n2_forks_on_a_cached_prefix(tiny_dirs, hf_models):
    rng = random.Random(8)
    system = toks(rng, 70)
    llm = make(tiny_dirs)
    cap = Capture(llm)
    outs = llm.generate([system + toks(rng, 9)], SamplingParams(max_tokens=3, **GREEDY))
    outs += llm.generate([system + toks(rng, 5)], SamplingParams(max_tokens=3, **GREEDY))
    before = llm.engine.stats()["prefix_skipped_tokens"]
    outs += llm.generate([system + toks(rng, 21)],
                         SamplingParams(n=2, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    assert llm.engine.stats()["prefix_skipped_tokens"] - before == 64
    assert outs[-1].outputs[0].token_ids != outs[-1].outputs[1].token_ids
    check_hf(hf_models["test-a"], outs[:2], cap, greedy=True)
    check_hf(hf_models["test-a"], outs[2:], cap, greedy=False)
    st = llm.engine.stats()
    assert st["running_state_pages"] == 0 and st["used_blocks"] == 0


def test_preempted_request_that_hit_the_cache_recomputes_exactly(tiny_dirs, hf_models):
    # Four requests on a 40-token shared prefix, growing by 30 tokens each, in 20
    # pages (a state is 3): they cannot all fit, so some are preempted and readmitted
    # (hitting the checkpoint again); the results must not change.
    rng = random.Random(9)
    system = toks(rng, 40)
    llm = make(tiny_dirs, "test-b", num_pages=20, max_num_seqs=4,
               max_num_batched_tokens=64)
    cap = Capture(llm)
    p = SamplingParams(max_tokens=30, **GREEDY)
    outs = llm.generate([system + toks(rng, 3)], SamplingParams(max_tokens=2, **GREEDY))
    outs += llm.generate([system + toks(rng, 4)], SamplingParams(max_tokens=2, **GREEDY))
    outs += llm.generate([system + toks(rng, 5 + i) for i in range(4)], p)
    st = llm.engine.stats()
    assert st["preemptions"] > 0, st
    assert st["checkpoint_hits"] >= 5, st  # four first admissions and at least one readmission
    check_hf(hf_models["test-b"], outs, cap, greedy=True)
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_with_a_small_budget_resumes_exactly(preset, block_size, tiny_dirs, hf_models):
    rng = random.Random(10 + block_size)
    system = toks(rng, 4 * block_size + 5)
    llm = make(tiny_dirs, preset, block_size=block_size, max_num_batched_tokens=24, max_num_seqs=4)
    cap = Capture(llm)
    p = SamplingParams(max_tokens=4, **GREEDY)
    # The first prompt's own checkpoint lies past the shared blocks: the second
    # request writes the branch-point one, the last three resume from it.
    outs = llm.generate([system + toks(rng, block_size + 7)], p) + llm.generate([system + toks(rng, 8)], p)
    outs += llm.generate([system + toks(rng, 9 + i) for i in range(2)], p)
    st = llm.engine.stats()
    assert st["prefix_skipped_tokens"] == 2 * 4 * block_size
    assert max(cap.computed) <= 24
    check_hf(hf_models[preset], outs, cap, greedy=True)


def test_engine_admits_what_the_shared_prefix_plan_predicts(tiny_dirs):
    # Sessions of 48 tokens (40-token prompt, 8 generated) sharing a 32-token prefix:
    # the planner says k sessions fit in 2 shared blocks + k own blocks + k states + one
    # checkpoint, in arena pages. Give the engine exactly that and k + 1 sessions at once.
    import dataclasses

    from hybridserve import planner
    from hybridserve.config import ModelConfig

    k, bs = 3, 16
    config = dataclasses.replace(ModelConfig.from_json(tiny_dirs["test-a"]), torch_dtype="float32",
                                 max_position_embeddings=2048)
    big = planner.size_arena(config, block_size=bs, kv_dtype="float32", num_pages=1 << 20)
    sp = planner.arena_sharing_plan(big, 48, 32, k)
    assert (sp.shared_blocks, sp.private_blocks, sp.checkpoint_slots) == (2, 1, 1)
    state = big.state_pages
    pages = sp.shared_blocks + sp.checkpoint_slots * state + k * (sp.private_blocks + state)
    exact = planner.size_arena(config, block_size=bs, kv_dtype="float32", num_pages=pages)
    assert planner.arena_sharing_plan(exact, 48, 32, k).max_count == k
    llm = make(tiny_dirs, num_pages=pages, max_num_seqs=8, max_num_batched_tokens=512)
    rng = random.Random(12)
    system = toks(rng, 32)
    p = SamplingParams(max_tokens=8, **GREEDY)
    llm.generate([system + toks(rng, 8)], p)  # writes the checkpoint at token 32
    seen: list[int] = []
    inner = llm.engine.runner.execute

    def execute(plan):
        seen.append(len(plan.request_ids))
        return inner(plan)

    llm.engine.runner.execute = execute
    before = llm.engine.stats()
    llm.generate([system + toks(rng, 8) for _ in range(k + 1)], p)
    st = llm.engine.stats()
    assert max(seen) == k, seen  # k together, the (k+1)-th waits for a session to end
    # Every session, the queued one included, resumed from the kept checkpoint.
    assert st["checkpoint_hits"] - before["checkpoint_hits"] == k + 1
    assert st["prefix_skipped_tokens"] - before["prefix_skipped_tokens"] == (k + 1) * 32
    assert st["checkpoint_evictions"] == 0


def test_serve_flag_turns_prefix_caching_off():
    from hybridserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--no-enable-prefix-caching"]).no_prefix_caching
    assert not parser.parse_args(["serve"]).no_prefix_caching


def test_metrics_tell_skipped_from_kv_matched_tokens(tiny_dirs):
    # Two requests sharing 48 tokens: the second KV-matches them but no checkpoint ends
    # there ("lost"), and writes one at the branch; a third skips them ("skipped").
    from hybridserve.metrics import EngineMetrics

    rng = random.Random(13)
    system = toks(rng, 70)  # 4 full blocks shared
    llm = make(tiny_dirs)
    p = SamplingParams(max_tokens=2, **GREEDY)
    for i in range(3):
        llm.generate([system + toks(rng, 20 + i)], p)
    m = EngineMetrics()
    m.refresh(llm.engine)
    text = m.render().decode()

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith("hybridserve:" + name + " "))
        return float(line.split()[1])

    st = llm.engine.stats()
    assert value("prefix_cache_hit_tokens_total") == 2 * 64 == st["prefix_hit_tokens"]
    assert value("prefix_cache_lost_tokens_total") == 64
    assert value("prefix_cache_skipped_tokens_total") == 64
    assert value("state_checkpoint_queries_total") == 3
    assert value("state_checkpoint_hits_total") == 1
    assert value("state_checkpoint_writes_total") == st["checkpoint_writes"] >= 4
    assert value("state_checkpoints") == st["checkpoints"] == len(llm.engine.scheduler.checkpoints())
    assert st["checkpoint_pages"] == st["checkpoints"] * st["pages_per_state"]
    assert value("prefix_cache_skip_rate") == pytest.approx(64 / sum(len(system) + 20 + i for i in range(3)))
