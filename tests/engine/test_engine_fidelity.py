"""End-to-end fidelity: Rust scheduler + runner + model, against HF transformers.

The oracle is HF ``Qwen3_5ForCausalLM`` loaded from the same tiny checkpoint. Every
row of logits the engine computes is captured with the (request, sample, position)
it belongs to; after generation, HF runs once over each completion's full token
sequence (teacher forcing) and its logits at those positions must match within 1e-4
relative. That checks the paged KV cache, the DeltaNet state slots, chunked prefill,
copy-on-write forks and preemption-by-recompute whatever tokens were sampled; greedy
runs must also produce HF's greedy tokens exactly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve import LLM, SamplingParams

REL_TOL = 1e-4


class LogitCapture:
    """Wraps the runner so that each computed logits row is recorded with its position."""

    def __init__(self, engine):
        self.rows: list[tuple[str, int, int, int, torch.Tensor]] = []
        self.max_tokens_per_step = 0
        self.max_seqs_per_step = 0
        self.mixed_steps = 0  # steps holding a prefill chunk and a decode together
        runner = engine.runner
        inner = runner.execute

        def execute(plan):
            step = inner(plan)
            n_tokens = len(plan.input_ids)
            self.max_tokens_per_step = max(self.max_tokens_per_step, n_tokens)
            self.max_seqs_per_step = max(self.max_seqs_per_step, len(plan.request_ids))
            sched = np.asarray(plan.num_scheduled_tokens)
            computed = np.asarray(plan.num_computed_tokens)
            if (sched > 1).any() and ((sched == 1) & (computed > 0)).any():
                self.mixed_steps += 1
            if step is not None:
                seq_lens = np.asarray(plan.seq_lens)
                for row, (b, k) in enumerate(zip(step.batch_index.tolist(), step.num_samples.tolist())):
                    rid = plan.request_ids[b]
                    si = int(plan.sample_indices[b])
                    pos = int(seq_lens[b]) - 1
                    self.rows.append((rid, si, k, pos, step.logits[row].detach().clone()))
            return step

        runner.execute = execute


def _run(llm: LLM, prompts, params):
    cap = LogitCapture(llm.engine)
    outs = llm.generate(prompts, params)
    return outs, cap


def _check_against_hf(hf_model, outs, cap, *, greedy: bool):
    by_id = {o.request_id: o for o in outs}
    hf_logits: dict[tuple[str, int], torch.Tensor] = {}
    for o in outs:
        for c in o.outputs:
            seq = list(o.prompt_token_ids) + list(c.token_ids)
            with torch.no_grad():
                hf_logits[(o.request_id, c.index)] = hf_model(torch.tensor([seq])).logits[0].float()
            if greedy:
                # HF's greedy choice at every generated position equals ours.
                p = len(o.prompt_token_ids)
                expect = hf_logits[(o.request_id, c.index)][p - 1 : len(seq) - 1].argmax(-1).tolist()
                assert c.token_ids == expect, (o.request_id, c.index)
    assert cap.rows, "no logits captured"
    worst = 0.0
    for rid, si, k, pos, row in cap.rows:
        o = by_id[rid]
        # At the fork step (k > 1) the row is the shared prompt's: any sample's sequence.
        ref = hf_logits[(rid, 0 if k > 1 else si)][pos]
        rel = (row - ref).abs().max().item() / ref.abs().max().item()
        worst = max(worst, rel)
        assert rel <= REL_TOL, f"{rid} sample {si} pos {pos}: relative error {rel:.2e}"
    # Every generated token came from a captured row.
    n_generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_drawn = sum(k for _, _, k, _, _ in cap.rows)
    assert n_drawn == n_generated
    return worst


def _prompts(seed: int, lengths, vocab: int = 259):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_batch_of_four_prompts_decoded_together(preset, block_size, tiny_dirs, hf_models):
    llm = LLM(tiny_dirs[preset], dtype="float32", device="cpu", block_size=block_size,
              num_pages=64 + 3 * 8, max_num_seqs=8, max_num_batched_tokens=512)
    prompts = _prompts(1, [5, 17, 33, 40])
    outs, cap = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    _check_against_hf(hf_models[preset], outs, cap, greedy=True)
    assert cap.max_seqs_per_step == 4  # decoded together
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = llm.engine.stats()
    assert stats["running_state_pages"] == 0 and stats["num_running_seqs"] == 0


@pytest.mark.parametrize("budget", [7, 13])
def test_chunked_prefill_at_awkward_budgets_mixed_with_decodes(budget, tiny_dirs, hf_models):
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
              num_pages=64 + 3 * 4, max_num_seqs=4, max_num_batched_tokens=budget)
    prompts = _prompts(2, [3, 29, 41, 8])
    outs, cap = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    _check_against_hf(hf_models["test-a"], outs, cap, greedy=True)
    assert cap.max_tokens_per_step <= budget
    assert cap.mixed_steps > 0, "no step mixed a prefill chunk with decodes"


@pytest.mark.parametrize("block_size,num_pages", [(16, 19), (32, 10)])
def test_preemption_by_recompute_gives_the_same_tokens(block_size, num_pages, tiny_dirs, hf_models):
    # Block size 16: 19 pages (3 per DeltaNet state + the KV blocks) cannot hold four
    # 20-token prompts growing by 24 tokens each (3 blocks + a state each); block size
    # 32: 10 pages against 4 x (2 blocks + 2 state pages). The scheduler must preempt
    # and recompute, and the results must not change.
    llm = LLM(tiny_dirs["test-b"], dtype="float32", device="cpu", block_size=block_size,
              num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = _prompts(3, [20, 20, 20, 20], vocab=259)
    outs, cap = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0, stats
    _check_against_hf(hf_models["test-b"], outs, cap, greedy=True)
    assert stats["available_pages"] == stats["num_pages"] == num_pages and stats["running_state_pages"] == 0


@pytest.mark.parametrize("block_size", [16, 32])
def test_n2_samples_fork_after_prefill_and_match_hf(block_size, tiny_dirs, hf_models):
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=block_size,
              num_pages=64 + 3 * 8, max_num_seqs=8, max_num_batched_tokens=256)
    prompts = _prompts(4, [21, 9])  # 21 tokens: a partly-filled shared tail block
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=14, ignore_eos=True)
    outs, cap = _run(llm, prompts, params)
    _check_against_hf(hf_models["test-a"], outs, cap, greedy=False)
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1]
        assert o.outputs[0].token_ids != o.outputs[1].token_ids  # they did diverge
    assert any(k == 2 for _, _, k, _, _ in cap.rows)  # one row sampled twice: the fork
    stats = llm.engine.stats()
    assert stats["cow_copies"] > 0
    assert stats["used_blocks"] == 0 and stats["running_state_pages"] == 0


def test_seeded_sampling_does_not_depend_on_batch_composition(tiny_dirs):
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
              num_pages=64 + 3 * 8, max_num_seqs=8, max_num_batched_tokens=256)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8, 9]], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    mixed = llm.generate([[11] * 30, [5, 6, 7, 8, 9], [12] * 7], [others, p, others])
    assert mixed[1].outputs[0].token_ids == alone
