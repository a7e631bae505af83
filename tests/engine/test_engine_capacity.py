"""Issue 5 on a live engine: pools sized by the planner hold exactly what it says.

Oracle: the planner's arithmetic, checked by hand here (blocks per sequence, slots),
and the scheduler's observable concurrency step by step.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from hybridserve import LLM, SamplingParams, planner
from hybridserve.config import ModelConfig

K, L, BLOCK = 3, 48, 16
PROMPT, GEN = 40, 8  # 40 + 8 tokens: KV for 47 positions, 3 blocks of 16


def _pool_for_k_sessions(model_dir):
    config = ModelConfig.from_json(model_dir)
    config = dataclasses.replace(config, torch_dtype="float32")
    per_seq = planner.paged_sequence_bytes(config, L, BLOCK, "float32")
    # Hand check: 3 blocks x block bytes + one slot (matrix + conv state).
    kv_tok = 2 * config.num_full_attention_layers * config.num_key_value_heads * config.head_dim * 4
    slot = config.num_linear_attention_layers * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        + config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * 4
    )
    assert per_seq == 3 * BLOCK * kv_tok + slot
    return K * per_seq


def _concurrency(llm):
    seen = []
    inner = llm.engine.runner.execute

    def execute(plan):
        seen.append(len(set(plan.request_ids)))
        return inner(plan)

    llm.engine.runner.execute = execute
    return seen


def _prompts(n):
    return [[(7 * i + j) % 250 + 3 for j in range(PROMPT)] for i in range(n)]


def test_paged_engine_runs_k_sessions_and_queues_the_next(tiny_dirs, caplog):
    pool = _pool_for_k_sessions(tiny_dirs["test-a"])
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=BLOCK,
                  kv_cache_memory_bytes=pool, expected_context_len=L, max_num_seqs=16,
                  max_num_batched_tokens=1024)
    engine = llm.engine
    assert (engine.num_blocks, engine.num_state_slots) == (3 * K, K)
    assert engine.max_concurrency == K
    assert f"max concurrency at {L} tokens: {K}" in caplog.text
    seen = _concurrency(llm)
    outs = llm.generate(_prompts(K + 1), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    assert max(seen) == K  # K at once, never more
    assert all(len(o.outputs[0].token_ids) == GEN for o in outs)  # the (K+1)th waited, did not fail
    assert engine.stats()["preemptions"] == 0
    # The core measured the wait: the (K+1)th queued for steps the first K did not.
    delays = [o.metrics.queue_delay for o in outs]
    assert all(d is not None and d >= 0 for d in delays)
    assert delays[K] > max(delays[:K])


def test_reserve_max_policy_admits_only_what_the_planner_says(tiny_dirs):
    pool = _pool_for_k_sessions(tiny_dirs["test-a"])
    max_len = 96  # reserves 6 blocks per sequence: 9 blocks hold one such sequence
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=BLOCK,
              kv_cache_memory_bytes=pool, expected_context_len=L, max_model_len=max_len,
              max_num_seqs=16, max_num_batched_tokens=1024, admission_policy="reserve_max")
    engine = llm.engine
    expect = planner.max_concurrency_reserved(engine.pool_plan)
    assert expect == min(K, (3 * K) // (max_len // BLOCK)) == 1
    seen = _concurrency(llm)
    outs = llm.generate(_prompts(K + 1), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    assert max(seen) == expect
    assert all(len(o.outputs[0].token_ids) == GEN for o in outs)


def test_same_pool_paged_beats_reserved(tiny_dirs):
    # The seed's comparison, live: same engine, same pool, same workload.
    pool = _pool_for_k_sessions(tiny_dirs["test-a"])
    peaks = {}
    for policy in ("paged", "reserve_max"):
        llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=BLOCK,
                  kv_cache_memory_bytes=pool, expected_context_len=L, max_model_len=96,
                  max_num_seqs=16, max_num_batched_tokens=1024, admission_policy=policy)
        seen = _concurrency(llm)
        llm.generate(_prompts(K + 1), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
        peaks[policy] = max(seen)
    assert peaks == {"paged": K, "reserve_max": 1}


def test_pool_too_small_for_one_sequence_is_a_clear_error(tiny_dirs):
    from hybridserve.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", kv_cache_memory_bytes=1024,
            expected_context_len=L)
