"""tensor_parallel_size=2 (gloo, two processes) against the single-process engine and HF.

One workload per tiny config runs through the paths where sharding could go wrong:
chunked prefill (24-token budget), prefix-cache hits restoring DeltaNet state
checkpoints, preemption and recompute (an arena too small for the batch), a seeded
n=2 request (forked state and KV) and a beam search. Every logits row the TP driver
computes must be within 1e-4 of the single-process engine's row for the same
(request, sample, position); greedy tokens must be HF's greedy tokens (teacher-forced
oracle); seeded samples and beams must equal the single-process engine's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.beam_search import BeamSearchParams

TOL = 1e-4
ENGINE = dict(dtype="float32", cpu_threads=1, block_size=16, max_num_seqs=4, max_num_batched_tokens=24,
              prefix_checkpoint_interval=16)


class RowCapture:
    """Every logits row the driver's runner returns, by (request, sample, position)."""

    def __init__(self, engine):
        self.rows: dict[tuple[str, int, int], torch.Tensor] = {}
        inner = engine.runner.execute

        def execute(plan, *rest):
            step = inner(plan, *rest)
            if step is not None:
                seq_lens = np.asarray(plan.seq_lens)
                for row, b in enumerate(step.batch_index.tolist()):
                    key = (plan.request_ids[b], int(plan.sample_indices[b]), int(seq_lens[b]) - 1)
                    self.rows[key] = step.logits[row].detach().clone()
            return step

        engine.runner.execute = execute


def _workload(llm: LLM):
    rng = random.Random(5)
    toks = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    system = toks(40)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate([system + toks(3)], SamplingParams(max_tokens=2, temperature=0))
    outs += llm.generate(
        [system + toks(5 + i) for i in range(3)] + [system + toks(9)],
        [greedy] * 3 + [SamplingParams(max_tokens=40, n=2, temperature=1.0, seed=7, ignore_eos=True)])
    beams = llm.beam_search([system + toks(6)], BeamSearchParams(beam_width=2, max_tokens=6))
    return outs, beams


def _hf(path: str, config: str):
    import transformers

    cls = transformers.Qwen3_5MoeForCausalLM if config.startswith("moe") else transformers.Qwen3_5ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("config", ["dense-gqa", "dense-kv1", "moe", "moe-kv1"])
def test_tp2_matches_single_process_and_hf(config, tp_dirs):
    path = tp_dirs[config]
    tp = LLM(path, tensor_parallel_size=2, num_pages=18, **ENGINE)
    cap_tp = RowCapture(tp.engine)
    outs_tp, beams_tp = _workload(tp)
    st = tp.engine.stats()
    # The workload went through the paths it is meant to cover, on the TP engine.
    assert st["preemptions"] > 0 and st["checkpoint_hits"] > 0 and st["prefix_skipped_tokens"] > 0, st
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
    del tp

    one = LLM(path, num_pages=64, **ENGINE)
    cap_one = RowCapture(one.engine)
    outs_one, beams_one = _workload(one)

    # Logits: every row the TP engine computed, against the single process's.
    assert cap_tp.rows
    worst = 0.0
    for key, row in cap_tp.rows.items():
        ref = cap_one.rows[key]
        worst = max(worst, float((row - ref).abs().max() / ref.abs().max().clamp(min=1.0)))
    assert worst <= TOL, worst

    # Tokens: seeded samples and beams as the single process; greedy as HF.
    assert [[c.token_ids for c in o.outputs] for o in outs_tp] == [[c.token_ids for c in o.outputs] for o in outs_one]
    assert [s.tokens for s in beams_tp[0].sequences] == [s.tokens for s in beams_one[0].sequences]
    hf = _hf(path, config)
    for o in outs_tp[:4]:  # the greedy requests
        c = o.outputs[0]
        seq = list(o.prompt_token_ids) + list(c.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0]
        p = len(o.prompt_token_ids)
        assert c.token_ids == logits[p - 1:len(seq) - 1].argmax(-1).tolist(), o.request_id
