"""Issues 5 and 17 on a live engine: the one arena, sized from one byte budget, holds
exactly what the planner says.

Oracle: the page arithmetic, checked by hand here (a page is one 16-token KV block of
every attention layer; a DeltaNet state is whole pages of items that never straddle a
page), and the scheduler's observable concurrency step by step.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from hybridserve import LLM, SamplingParams, planner
from hybridserve.config import ModelConfig
from hybridserve.memory.layout import arena_layout

K, L, BLOCK = 3, 48, 16
PROMPT, GEN = 40, 8  # 40 + 8 tokens: KV for 47 positions, 3 blocks of 16


def _state_pages(config) -> tuple[int, int]:
    """(page bytes, pages of one DeltaNet state), by hand for float32."""
    page = 2 * config.num_full_attention_layers * config.num_key_value_heads * config.head_dim * 4 * BLOCK
    rec_item = config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv_item = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * 4
    assert page >= rec_item and page >= conv_item and page % 64 == 0
    D, H = config.num_linear_attention_layers, config.linear_num_value_heads
    return page, -(-D * H // (page // rec_item)) + -(-D // (page // conv_item))


def _pool_for_k_sessions(model_dir):
    config = dataclasses.replace(ModelConfig.from_json(model_dir), torch_dtype="float32")
    page, state = _state_pages(config)
    # K sessions of 3 blocks (40 + 8 tokens) and a state each.
    assert arena_layout(config, BLOCK, "float32").pages_for_sequence(L) == 3 + state
    return K * (3 + state) * page + page - 1  # less than one page more: no extra page


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
                  kv_cache_memory_bytes=pool, max_num_seqs=16, max_num_batched_tokens=1024)
    engine = llm.engine
    _, state = _state_pages(engine.model_config)
    assert (engine.num_pages, engine.state_pages) == (K * (3 + state), state)
    assert engine.arena_plan.sessions(L).sessions == K
    assert f"{engine.num_pages:,} pages for KV blocks, DeltaNet state and checkpoints" in caplog.text
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
    max_len = 96  # reserves 6 blocks + a state per sequence
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=BLOCK,
              kv_cache_memory_bytes=pool, max_model_len=max_len,
              max_num_seqs=16, max_num_batched_tokens=1024, admission_policy="reserve_max")
    engine = llm.engine
    expect = engine.arena_plan.sessions_reserved_max().sessions
    state = engine.state_pages
    assert expect == (K * (3 + state)) // (max_len // BLOCK + state) < K
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
                  kv_cache_memory_bytes=pool, max_model_len=96,
                  max_num_seqs=16, max_num_batched_tokens=1024, admission_policy=policy)
        seen = _concurrency(llm)
        llm.generate(_prompts(K + 1), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
        peaks[policy] = max(seen)
        reserved = llm.engine.arena_plan.sessions_reserved_max().sessions
    assert peaks == {"paged": K, "reserve_max": reserved} and reserved < K


def test_pool_too_small_for_one_sequence_is_a_clear_error(tiny_dirs):
    from hybridserve.errors import ConfigError

    with pytest.raises(ConfigError, match="too small to run one sequence"):
        LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", kv_cache_memory_bytes=1024)


@pytest.mark.parametrize("old, hint", [
    (dict(expected_context_len=L), "expected_context_len no longer exists"),
    (dict(num_state_slots=4), "num_state_slots alone no longer sizes anything"),
    (dict(num_gpu_blocks=4), "num_gpu_blocks alone no longer sizes anything"),
])
def test_old_split_options_say_what_to_do_instead(tiny_dirs, old, hint):
    from hybridserve.errors import ConfigError

    with pytest.raises(ConfigError, match=hint):
        LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", **old)


def test_old_block_and_slot_pair_is_the_same_bytes_in_pages(tiny_dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine"):
        llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", num_gpu_blocks=20, num_state_slots=4)
    assert llm.engine.num_pages == 20 + 4 * llm.engine.state_pages
    assert "pass num_pages" in caplog.text
