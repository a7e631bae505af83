"""Capacity from the one arena (issue 17): pages a budget holds, sessions that fit by
context length, the CUDA-graph scratch state, page padding, and the start-up log.

Oracles: hand arithmetic from the shapes (factor by factor in the comments), and a
brute-force page allocator that admits sequences page by page until the arena is full.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve import planner as pl
from hybridserve.cli import main
from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError

KiB, MiB = 1024, 1024**2
PRESETS = Path(pl.__file__).parent.parent / "presets"

# 8 layers (2 attention, 6 DeltaNet), sizes chosen so nothing divides evenly: KV block
# 2 layers x 16 tokens x 3 KV heads x 80 x 2 (K, V) x 2 B = 30,720 B; a recurrent item
# 24 x 40 x 4 B = 3,840 B; conv channels 2 x (2 x 24) + 3 x 40 = 216, item 216 x 3 x 2 B
# = 1,296 B.
ODD = {
    "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 240,
    "intermediate_size": 480, "num_hidden_layers": 8, "num_attention_heads": 6,
    "num_key_value_heads": 3, "head_dim": 80, "linear_num_key_heads": 2,
    "linear_num_value_heads": 3, "linear_key_head_dim": 24, "linear_value_head_dim": 40,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def _seed() -> ModelConfig:
    return ModelConfig.from_json(PRESETS / "qwen3.5-27b.json")


def test_seed_table_holds_in_the_arena():
    # The 27B shape, a 23,859 MiB budget: 1 MiB pages (16 attention layers x 16 tokens x
    # 4 KV heads x 256 x 2 x 2 B), so 23,859 pages. A sequence's state: 48 layers x 48
    # heads of 128 x 128 x 4 B = 64 KiB, 16 a page -> 144 pages; conv 10,240 x 3 x 2 B =
    # 61,440 B a layer, 17 a page -> 3 pages; 147 pages. CUDA graphs set 147 aside:
    # 23,712 left. 32K tokens: 2,048 blocks + 147 = 2,195 pages; 23,712 // 2,195 = 10
    # (11 x 2,195 = 24,145). Reserving 262,144 tokens: 16,384 + 147 = 16,531 -> 1.
    plan = pl.size_arena(_seed(), budget_bytes=23_859 * MiB, cuda_graphs=True)
    assert plan.page_bytes == MiB
    assert (plan.layout.recurrent_pages, plan.layout.conv_pages, plan.state_pages) == (144, 3, 147)
    assert (plan.total_pages, plan.scratch_pages, plan.num_pages) == (23_859, 147, 23_712)
    assert list(plan.scratch_page_ids) == list(range(23_712, 23_859))
    fit = plan.sessions(32_768)
    assert (fit.pages_per_session, fit.sessions, fit.limited_by) == (2_195, 10, "pages")
    rmax = plan.sessions_reserved_max()
    assert (rmax.pages_per_session, rmax.sessions) == (16_531, 1)
    # The state pages' padding: 147 MiB of pages hold 144 MiB + 48 x 61,440 B of state.
    assert plan.layout.state_padding_bytes == 147 * MiB - 144 * MiB - 48 * 61_440 == 196_608
    assert plan.layout.kv_padding_bytes == 0
    assert plan.unused_bytes == 0


def test_scratch_state_is_counted():
    # The review's bug: the graphs' scratch state was allocated but not counted. Right
    # at the edge it decides a session: 11 sessions of 32K need 11 x 2,195 = 24,145
    # pages; with the scratch 147 more.
    c = _seed()
    eager = pl.size_arena(c, budget_bytes=24_145 * MiB)
    graphs = pl.size_arena(c, budget_bytes=24_145 * MiB, cuda_graphs=True)
    assert eager.sessions(32_768).sessions == 11
    assert graphs.sessions(32_768).sessions == 10
    assert pl.size_arena(c, budget_bytes=(24_145 + 147) * MiB, cuda_graphs=True).sessions(32_768).sessions == 11
    # Exact sizing in pages (tests): the scheduler's pages as given, the scratch on top.
    exact = pl.size_arena(c, num_pages=500, cuda_graphs=True)
    assert (exact.num_pages, exact.total_pages, exact.budget_bytes) == (500, 647, None)


def test_conv_state_in_the_cache_dtype():
    # An fp8 cache on a bf16 model: the conv item is 10,240 x 3 x 1 B = 30,720 B (the
    # cache allocates it in the KV dtype), 34 in a 512 KiB page (16 x 16 x 4 x 256 x 2 x
    # 1 B) -> 2 pages; in bf16 it would be 61,440 B, 8 a page, 6 pages.
    c = _seed()
    fp8 = pl.size_arena(c, kv_dtype="float8_e4m3fn", num_pages=1_000)
    assert fp8.page_bytes == 512 * KiB
    assert (fp8.layout.conv_item_bytes, fp8.layout.conv_per_page, fp8.layout.conv_pages) == (30_720, 17, 3)
    assert pl.conv_state_bytes(c, "float8_e4m3fn") == 48 * 30_720
    assert pl.conv_state_bytes(c) == 48 * 61_440
    # The byte arithmetic charges the same dtype the arena holds.
    assert pl.state_slot_bytes(c, kv_dtype="float8_e4m3fn") == 144 * MiB + 48 * 30_720


def test_padding_of_an_odd_shape():
    # ODD: the KV block is 30,720 B (a multiple of 64: no KV padding). Recurrent items of
    # 3,840 B: 8 a page (30,720 / 3,840), 6 layers x 3 heads = 18 items -> 3 pages.
    # Conv items of 1,296 B: 23 a page (23 x 1,296 = 29,808) -> 6 layers fit 1 page.
    # State: 4 pages = 122,880 B for 18 x 3,840 + 6 x 1,296 = 76,896 B: 45,984 B padding.
    plan = pl.size_arena(ModelConfig.from_dict(ODD), num_pages=100)
    lay = plan.layout
    assert lay.page_bytes == 30_720
    assert (lay.recurrent_per_page, lay.recurrent_pages) == (8, 3)
    assert (lay.conv_per_page, lay.conv_pages) == (23, 1)
    assert lay.state_bytes == 76_896
    assert lay.state_padding_bytes == 45_984
    text = "\n".join(pl.format_arena_log(plan, 1_000))
    assert "padding 44.9062 KiB" in text  # 45,984 / 1,024
    # A block that is not a multiple of 64 B: 1 attention layer, 1-token blocks, 1 KV
    # head of 81: 1 x 1 x 81 x 2 (K, V) x 2 B = 324 B -> a 384 B page (6 x 64), 60 B of
    # every KV page padding.
    tiny = dict(ODD, num_hidden_layers=4, num_key_value_heads=1, head_dim=81,
                num_attention_heads=1, linear_key_head_dim=2, linear_value_head_dim=2,
                linear_num_key_heads=1, linear_num_value_heads=1)
    t = pl.size_arena(ModelConfig.from_dict(tiny), block_size=1, num_pages=10)
    # conv: 2 x 2 + 2 = 6 channels x 3 x 2 B = 36 B; recurrent 2 x 2 x 4 = 16 B: the
    # block (324 B) is the largest item; page 384 B.
    assert (t.page_bytes, t.layout.kv_padding_bytes) == (384, 60)
    assert "padding 60 B" in pl.format_arena_log(t, 10)[1]


def _brute_force_sessions(num_pages: int, state_pages: int, block_size: int, tokens: int,
                          cap: int | None) -> int:
    """Admit sequences one page at a time (state, then each block) until a page is missing."""
    free = num_pages
    admitted = 0
    while cap is None or admitted < cap:
        need = state_pages
        for t in range(tokens):
            if t % block_size == 0:
                need += 1
        if need > free:
            return admitted
        free -= need
        admitted += 1
    return admitted


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("cap", [None, 7])
def test_sessions_by_context_match_a_brute_force_allocator(block_size, cap):
    c = ModelConfig.from_dict(ODD)
    for pages in (5, 37, 200, 1_001):
        try:
            plan = pl.size_arena(c, block_size=block_size, num_pages=pages, max_num_seqs=cap)
        except ConfigError:
            # One sequence needs its state pages + 1 block: 4 + 1 at blocks of 16 and 32;
            # at block_size 1 a page is the 3,840 B recurrent item (the 1,920 B block is
            # smaller), 1 a page -> 18, conv 2 a page -> 3: 21 + 1.
            assert pages < (21 if block_size == 1 else 4) + 1
            continue
        for L in (1, block_size, block_size + 1, 100, 999, 4_096):
            want = _brute_force_sessions(pages, plan.state_pages, block_size, L, cap)
            fit = plan.sessions(L)
            assert fit.sessions == want, (pages, L)
            assert fit.limited_by == ("max_num_seqs" if cap is not None and want == cap
                                      and pages // fit.pages_per_session > cap else "pages")
        rmax = plan.sessions_reserved_max()
        assert rmax.sessions == _brute_force_sessions(pages, plan.state_pages, block_size, 4_096, cap)


def test_too_small_and_ambiguous_sizes_are_refused_with_what_to_change():
    c = _seed()
    # One sequence needs 147 + 1 pages, the graphs 147 more: 295 MiB.
    assert pl.size_arena(c, budget_bytes=295 * MiB, cuda_graphs=True).num_pages == 148
    with pytest.raises(ConfigError, match="at least 295 MiB.*kv_cache_memory"):
        pl.size_arena(c, budget_bytes=295 * MiB - 1, cuda_graphs=True)
    with pytest.raises(ConfigError, match="exactly one"):
        pl.size_arena(c)
    with pytest.raises(ConfigError, match="exactly one"):
        pl.size_arena(c, budget_bytes=MiB, num_pages=3)
    with pytest.raises(ConfigError, match="max_model_len"):
        pl.size_arena(c, num_pages=500).sessions(262_145)


def test_plan_prints_the_engines_start_up_lines(capsys):
    # `hybridserve plan` and the engine's start-up log say the same thing: the lines the
    # engine logs for a budget (format_arena_log of size_arena) appear verbatim in plan's
    # output for that budget, and in its JSON.
    c = _seed()
    engine_lines = pl.format_arena_log(
        pl.size_arena(c, budget_bytes=23_859 * MiB, cuda_graphs=True, max_num_seqs=64), 32_768)
    assert main(["plan", "qwen3.5-27b", "--pool-mib", "23859", "--max-num-seqs", "64"]) == 0
    out = capsys.readouterr().out
    for line in engine_lines:
        assert f"  {line}" in out.splitlines()
    assert main(["plan", "qwen3.5-27b", "--pool-mib", "23859", "--max-num-seqs", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["arena_log"] == engine_lines
    # The cap shows where it binds: 1,024-token sessions (64 + 147 = 211 pages) would be
    # 23,712 // 211 = 112 but max_num_seqs is 64.
    assert "1,024: 64 (max_num_seqs)" in engine_lines[-1]
    assert {row["context_len"]: (row["sessions"], row["limited_by"]) for row in d["session_table"]}[1_024] == (
        64, "max_num_seqs")


def test_sharing_in_the_arena_by_hand():
    # The 27B arena without graphs: 23,859 pages. 4 sessions of 32K sharing a 1,000-token
    # prefix: 62 full prefix blocks shared, 2,048 - 62 = 1,986 own blocks + 147 state
    # pages each; with the prefix's 147-page checkpoint kept: (23,859 - 62 - 147) //
    # 2,133 = 23,650 // 2,133 = 11; evicting it: 23,797 // 2,133 = 11; no sharing:
    # 23,859 // 2,195 = 10.
    plan = pl.size_arena(_seed(), num_pages=23_859)
    sp = pl.arena_sharing_plan(plan, 32_768, 1_000, 4)
    assert (sp.shared_blocks, sp.private_blocks, sp.total_blocks) == (62, 1_986, 8_006)
    assert sp.total_bytes == (8_006 + 4 * 147) * MiB
    assert (sp.max_count, sp.max_count_evicting_checkpoint, sp.max_count_without_sharing) == (11, 11, 10)
    # A pool where the checkpoint decides: 62 + 11 x 2,133 = 23,525 pages.
    edge = pl.arena_sharing_plan(pl.size_arena(_seed(), num_pages=23_525), 32_768, 1_000, 4)
    assert (edge.max_count, edge.max_count_evicting_checkpoint) == (10, 11)
    # n = 4 samples of 1,500 tokens after a 1,000-token prompt: 62 shared + 4 x (94 - 62)
    # own blocks + 4 x 147 state pages = 778 pages; 23,859 // 778 = 30 requests.
    ps = pl.arena_parallel_sampling_plan(plan, 1_500, 4, prompt_len=1_000)
    assert ps.bytes_per_request == 778 * MiB
    assert (ps.requests_that_fit, ps.sequences_that_fit) == (30, 120)


def test_engine_start_up_log_is_what_plan_prints(tmp_path, caplog, capsys):
    # End to end: an engine built from one byte budget logs, line for line, what
    # `hybridserve plan` prints for that checkpoint and budget (CPU: no CUDA graphs, so
    # --enforce-eager; the engine's default context is max_model_len).
    import logging

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.model.tiny import write_tiny_checkpoint

    d = str(write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=7))
    cfg = ModelConfig.from_json(d)
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        engine = LLMEngine(EngineArgs(model=d, dtype="float32", device="cpu",
                                      kv_cache_memory_bytes=3 * MiB, max_num_seqs=8))
    logged = [r.getMessage() for r in caplog.records]
    assert main(["plan", d, "--pool-mib", "3", "--enforce-eager", "--kv-dtype", "float32",
                 "--max-num-seqs", "8", "--context", str(cfg.max_position_embeddings), "--json"]) == 0
    plan_lines = json.loads(capsys.readouterr().out)["arena_log"]
    assert len(plan_lines) == 4
    for line in plan_lines:
        assert line in logged
    # And the engine runs the arena it logged: 3 MiB of 8 KiB pages = 384 for the scheduler.
    assert (engine.arena_plan.num_pages, engine.arena_plan.page_bytes) == (384, 8 * KiB)
