"""Issue 34's memory side: with speculative decoding on, the one arena sized from one
byte budget holds exactly what the planner says once the MTP layer's KV is counted,
and ``hybridserve plan --speculative-config`` says the same as the engine.

Oracle: the page arithmetic, by hand here (a page is one 16-token KV block of every
trunk attention layer plus the MTP layer's; a DeltaNet state is whole pages of items
that never straddle a page), the engine's observable concurrency step by step, and,
for sequences still decoding, the Rust scheduler's own block tables.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from hybridserve import LLM, SamplingParams, _core
from hybridserve.cli import main
from hybridserve.config import ModelConfig
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.planner import size_arena

K, L, BLOCK = 3, 48, 16
# 40 + 8 tokens: a sequence ends at 48 tokens. The scheduler reserves no lookahead slot at
# or past prompt + max_tokens, so it never holds more than 3 blocks of 16, drafts or not.
PROMPT, GEN = 40, 8
BLOCKS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-capacity")
    return str(write_tiny_checkpoint(root / "a", preset="test-a", seed=5))


def _config(ckpt) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_json(ckpt), torch_dtype="float32")


def _pages(config, mtp: bool) -> tuple[int, int]:
    """(page bytes, pages of one DeltaNet state), by hand for float32."""
    layers = config.num_full_attention_layers + (1 if mtp else 0)
    page = 2 * layers * config.num_key_value_heads * config.head_dim * 4 * BLOCK
    rec_item = config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv_item = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * 4
    assert page >= rec_item and page >= conv_item and page % 64 == 0
    D, H = config.num_linear_attention_layers, config.linear_num_value_heads
    return page, -(-D * H // (page // rec_item)) + -(-D // (page // conv_item))


def _pool_for_k_sessions(config) -> int:
    page, state = _pages(config, mtp=True)
    return K * (BLOCKS + state) * page + page - 1  # less than one page more: no extra page


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0}


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


def test_the_mtp_block_makes_pages_larger_and_fewer(ckpt):
    # The same budget holds fewer sessions with speculation: every page grows by the MTP
    # layer's block. (This is what the engine test below relies on: at its budget,
    # sizing pages without the MTP layer would promise more sessions.)
    config = _config(ckpt)
    pool = _pool_for_k_sessions(config)
    page_on, state_on = _pages(config, mtp=True)
    page_off, state_off = _pages(config, mtp=False)
    assert page_on > page_off
    off = size_arena(config, block_size=BLOCK, kv_dtype="float32", budget_bytes=pool)
    on = size_arena(config, block_size=BLOCK, kv_dtype="float32", budget_bytes=pool, speculative_tokens=2)
    assert (on.page_bytes, on.state_pages, on.num_pages) == (page_on, state_on, K * (BLOCKS + state_on))
    assert (off.page_bytes, off.num_pages) == (page_off, pool // page_off)
    assert on.sessions(L).sessions == K
    assert off.sessions(L).sessions == (pool // page_off) // (BLOCKS + state_off) > K


@pytest.mark.parametrize("k", [2, 3])
def test_engine_with_speculation_runs_what_the_planner_says(ckpt, k, caplog, capsys):
    config = _config(ckpt)
    pool = _pool_for_k_sessions(config)
    page, state = _pages(config, mtp=True)
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        llm = LLM(ckpt, dtype="float32", device="cpu", block_size=BLOCK, kv_cache_memory_bytes=pool,
                  max_num_seqs=16, max_num_batched_tokens=1024, speculative_config=_spec(k))
    engine = llm.engine
    plan = engine.arena_plan
    assert (plan.page_bytes, engine.state_pages, engine.num_pages) == (page, state, K * (BLOCKS + state))
    assert plan.sessions(L).sessions == K
    # The start-up lines say the pages hold the MTP layer's KV.
    assert "(incl. 1 MTP)" in caplog.text
    assert "every page also holds the MTP layer's KV block" in caplog.text

    seen = _concurrency(llm)
    outs = llm.generate(_prompts(K + 1), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0  # it did speculate
    assert all(len(o.outputs[0].token_ids) == GEN for o in outs)  # the (K+1)th waited, did not fail
    assert stats["preemptions"] == 0
    # Peak concurrency is what the bytes hold once the MTP KV is counted (issue 34 asks
    # >= 95 %; the page arithmetic is exact, so it is all of it), and never more.
    assert max(seen) == K
    assert max(seen) >= 0.95 * plan.sessions(L).sessions

    # `hybridserve plan` with the same budget and --speculative-config: the same pages
    # and sessions as the engine (CPU: no CUDA-graph scratch, hence --enforce-eager).
    rc = main(["plan", ckpt, "--kv-cache-memory-bytes", str(pool), "--context", str(L),
               "--block-size", str(BLOCK), "--kv-cache-dtype", "float32", "--enforce-eager",
               "--speculative-config", json.dumps(_spec(k)), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    d = json.loads(out)
    assert d["speculative_tokens"] == k and d["speculative_config"]["num_speculative_tokens"] == k
    assert (d["arena"]["page_bytes"], d["arena"]["num_pages"], d["arena"]["total_pages"]) == (
        page, engine.num_pages, engine.num_pages)
    assert d["arena"]["layout"]["extra_attention_layers"] == 1
    assert d["sessions_paged"] == max(seen) == K
    assert d["session_table"][0] == {"context_len": L, "pages_per_session": BLOCKS + state,
                                     "sessions": K, "limited_by": "pages"}
    # A token's KV and a block count the MTP layer as one more attention layer.
    assert d["block_bytes"] == page
    assert d["kv_bytes_per_token"] * BLOCK == page


def test_plan_counts_the_mtp_weights(ckpt, capsys):
    from safetensors import safe_open

    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        mtp = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys()
                  if n.startswith(("mtp.", "model.mtp.")))
    assert mtp > 0
    base = ["plan", ckpt, "--kv-cache-memory-bytes", "4MiB", "--context", str(L), "--enforce-eager", "--json"]
    assert main(base) == 0
    off = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["weight_bytes"] - off["weight_bytes"] == on["mtp_weight_bytes"] == mtp
    assert off["mtp_weight_bytes"] == 0 and off["speculative_config"] is None
    # Same budget, larger pages: fewer of them, and never more sessions.
    assert on["arena"]["page_bytes"] > off["arena"]["page_bytes"]
    assert on["arena"]["num_pages"] < off["arena"]["num_pages"]
    assert on["sessions_paged"] <= off["sessions_paged"]
    assert main(base[:-1] + ["--speculative-config", '{"num_speculative_tokens": 1}']) == 0
    table = capsys.readouterr().out
    assert "+ 1 MTP layer" in table and "incl. the MTP layer's" in table
    assert "speculative decoding (MTP, k=1)" in table


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sequences_still_decoding_hold_drafts_and_lookahead(ckpt, k):
    """The planner's ``pages_while_decoding`` against the scheduler's block tables:
    sequences that go on decoding past L tokens, each handed k drafts every step and
    accepting none of them (so their drafts and lookahead stay in flight)."""
    config = _config(ckpt)
    page, state = _pages(config, mtp=True)
    plan = size_arena(config, block_size=BLOCK, kv_dtype="float32", num_pages=400, speculative_tokens=k)
    sched = _core.Scheduler(num_pages=400, block_size=BLOCK, state_pages=state, max_num_seqs=4,
                            max_num_batched_tokens=1024, max_model_len=config.max_position_embeddings,
                            enable_prefix_caching=False, num_speculative_tokens=k)
    n, prompt, gen = 3, 20, 60
    for i in range(n):
        sched.add_request(f"r{i}", [3 + i + j for j in range(prompt)], max_tokens=gen, ignore_eos=True)
    most = {}  # committed tokens -> the most KV blocks one sequence's table held in a step
    committed = {f"r{i}": prompt for i in range(n)}
    while sched.has_unfinished():
        out = sched.schedule()
        ids = list(out.request_ids)
        tables = sched.block_tables()
        for b, rid in enumerate(ids):
            blocks = int((tables[b] >= 0).sum())
            most[committed[rid]] = max(most.get(committed[rid], 0), blocks)
        drafts = [[5] * k for _ in ids]
        sched.update([4] * int(sum(out.num_samples)),
                           accepted=[1] * len(ids), drafts=drafts)
        for rid in ids:
            committed[rid] += 1
    for T, blocks in most.items():
        if T < prompt + gen - 2 * k:  # not yet capped by prompt + max_tokens
            assert blocks + state <= plan.pages_while_decoding(T), (T, blocks)
    # ... and the bound is reached: some step's table covers T + 2k positions.
    assert any(blocks + state == plan.pages_while_decoding(T) > plan.pages_for_sequence(T)
               for T, blocks in most.items() if T < prompt + gen - 2 * k)


# ---- the --speculative-config flag of `hybridserve plan` ---------------------------

@pytest.mark.parametrize("value, hint", [
    ('{"method": "mtp", num_speculative_tokens: 2}', "not valid JSON"),
    ('{"method": "mtp", "num_speculative_token": 2}', "unknown key(s) ['num_speculative_token']"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in 1..8, got 0"),
    ('{"num_speculative_tokens": 9}', "num_speculative_tokens must be an integer in 1..8, got 9"),
    ('{"num_speculative_tokens": "2"}', "num_speculative_tokens must be an integer"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": -1}', "disable_by_batch_size must be an integer >= 0"),
    ("[2]", "must be a JSON object"),
])
def test_bad_speculative_config_is_an_argparse_error_naming_it(ckpt, capsys, value, hint):
    argv = ["plan", ckpt, "--kv-cache-memory-bytes", "4MiB", "--context", str(L), "--speculative-config", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config" in err and hint in err, err


def test_empty_speculative_config_plans_without_speculation(ckpt, capsys):
    base = ["plan", ckpt, "--kv-cache-memory-bytes", "4MiB", "--context", str(L), "--json"]
    assert main(base) == 0
    off = json.loads(capsys.readouterr().out)
    for empty in ("{}", ""):
        assert main(base + ["--speculative-config", empty]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["speculative_config"] is None and d["speculative_tokens"] == 0
        assert (d["arena"], d["sessions_paged"], d["weight_bytes"]) == (
            off["arena"], off["sessions_paged"], off["weight_bytes"])


def test_speculation_with_tensor_parallelism_plans_each_devices_shard(ckpt, capsys):
    # The engine speculates under tensor parallelism with the MTP layer sharded like a
    # decoder layer: each device's weights grow by its shard of the layer (counted
    # against the sharded loader in test_planner_tensor_parallel.py), its pages by its
    # share of the MTP KV.
    base = ["plan", ckpt, "--kv-cache-memory-bytes", "4MiB", "--context", str(L), "-tp", "2", "--json"]
    assert main(base) == 0
    off = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert main(base + ["--speculative-config", '{"num_speculative_tokens": 2}']) == 0
    on = json.loads(capsys.readouterr().out)
    tp = on["tensor_parallel"]
    assert off["mtp_weight_bytes_per_device"] == 0
    assert 0 < tp["mtp_weight_bytes_per_device"] < on["mtp_weight_bytes"]
    assert tp["weight_bytes_per_device"] - off["weight_bytes_per_device"] == tp["mtp_weight_bytes_per_device"]
    assert tp["arena"]["page_bytes"] > off["arena"]["page_bytes"]
    assert main(base[:-1] + ["--speculative-config", '{"num_speculative_tokens": 2}']) == 0
    assert "incl. its shard of the MTP layer" in capsys.readouterr().out


def test_lookahead_never_reaches_past_max_model_len_and_is_nothing_when_off(ckpt):
    from hybridserve.errors import ConfigError
    from hybridserve.planner import format_arena_log

    config = dataclasses.replace(_config(ckpt), max_position_embeddings=64)
    _, state = _pages(config, mtp=True)
    on = size_arena(config, block_size=BLOCK, kv_dtype="float32", num_pages=100, speculative_tokens=3)
    # 60 tokens + 3 drafts + 3 lookahead would be 66 positions, but prompt + max_tokens <=
    # max_model_len (the scheduler refuses more) and no slot is reserved at or past it.
    assert on.pages_while_decoding(60) == state + 4 == on.pages_for_sequence(64)
    assert on.pages_while_decoding(58) == state + 4 and on.pages_for_sequence(58) == state + 4
    assert on.pages_while_decoding(42) == state + 3  # 48 positions
    assert on.pages_while_decoding(43) == state + 4  # 49
    off = size_arena(config, block_size=BLOCK, kv_dtype="float32", num_pages=100)
    assert all(off.sessions_while_decoding(n) == off.sessions(n) for n in (1, 16, 17, 63, 64))
    assert not any("speculative" in line for line in format_arena_log(off))
    assert "3 drafts + 3 lookahead slots" in format_arena_log(on)[-1]
    with pytest.raises(ConfigError, match="speculative_tokens must be a non-negative integer"):
        size_arena(config, block_size=BLOCK, num_pages=100, speculative_tokens=-1)
