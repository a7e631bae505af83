"""``hybridserve bench``: the workload, the statistics, and both runners end to end.

Oracles: numpy (percentiles), the generator's own arguments (ranges, counts, seeds),
HF transformers' greedy decode (``--compare-hf`` must report identity, and a
perturbed token must be reported as a mismatch), the server's ``/metrics`` and the
planner's arithmetic for the seed scenario.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

import numpy as np
import pytest

from hybridserve.bench.hf_baseline import compare_tokens
from hybridserve.bench.report import RequestRecord, build_report, render_table, summarize
from hybridserve.bench.workload import RequestClass, generate_workload, parse_class
from hybridserve.cli import main
from hybridserve.errors import ConfigError
from hybridserve.model.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "m", preset="test-a", seed=7))


# ---- workload ------------------------------------------------------------------------


def _classes():
    return [
        parse_class("interactive:rate=40,prompt=8-32,output=4-8,priority=0,prefix=16",
                    default_prompt=(64, 512), default_output=(16, 128)),
        parse_class("batch:rate=10,prompt=100-200,priority=2", default_prompt=(64, 512), default_output=(16, 128)),
    ]


def _key(w):
    return [(r.request_id, r.request_class, tuple(r.prompt), r.output_len, r.priority, r.arrival_time)
            for r in w.requests]


def test_workload_is_deterministic_for_a_seed_and_follows_the_specs():
    a = generate_workload(num_prompts=500, seed=3, classes=_classes())
    b = generate_workload(num_prompts=500, seed=3, classes=_classes())
    c = generate_workload(num_prompts=500, seed=4, classes=_classes())
    assert _key(a) == _key(b)
    assert _key(a) != _key(c)
    inter = [r for r in a.requests if r.request_class == "interactive"]
    batch = [r for r in a.requests if r.request_class == "batch"]
    assert (len(inter), len(batch)) == (400, 100)  # weights default to the rates, 40:10
    prefix = inter[0].prompt[:16]
    assert all(r.prompt[:16] == prefix and 8 <= len(r.prompt) - 16 <= 32 for r in inter)
    assert all(4 <= r.output_len <= 8 and r.priority == 0 for r in inter)
    assert all(100 <= len(r.prompt) <= 200 and 16 <= r.output_len <= 128 and r.priority == 2 for r in batch)
    assert all(32 <= t < 127 for r in a.requests for t in r.prompt)
    assert [r.arrival_time for r in a.requests] == sorted(r.arrival_time for r in a.requests)
    # Poisson arrivals: mean gap 1/rate (400 samples: within 15 %).
    gaps = np.diff([0.0] + [r.arrival_time for r in inter])
    assert abs(gaps.mean() - 1 / 40) < 0.15 / 40
    # Each class has its own stream: dropping one class leaves the other's requests as they were.
    only = generate_workload(num_prompts=400, seed=3, classes=_classes()[:1])
    assert _key(only) == [k for k in _key(a) if k[1] == "interactive"]


def test_workload_all_at_once_and_bad_specs():
    w = generate_workload(num_prompts=10, seed=0, prompt_len=(5, 5), output_len=(2, 3))
    assert all(r.arrival_time == 0 and len(r.prompt) == 5 for r in w.requests)
    with pytest.raises(ConfigError, match="unknown key 'speed'"):
        parse_class("x:speed=3", default_prompt=(1, 2), default_output=(1, 2))
    with pytest.raises(ConfigError, match="range"):
        parse_class("x:prompt=9-3", default_prompt=(1, 2), default_output=(1, 2))
    with pytest.raises(ConfigError, match="distinct"):
        generate_workload(num_prompts=4, classes=[RequestClass("a"), RequestClass("a")])


# ---- statistics ----------------------------------------------------------------------


def test_percentiles_match_numpy_and_the_report_slices_by_class():
    rng = np.random.default_rng(0)
    samples = rng.lognormal(size=997)
    s = summarize(samples)
    for p in (50, 90, 99):
        assert s[f"p{p}"] == pytest.approx(np.percentile(samples, p), rel=1e-12)
    assert s["mean"] == pytest.approx(samples.mean())
    # Known values (linear interpolation): 1..100.
    k = summarize(list(range(1, 101)))
    assert (k["p50"], k["p90"], k["p99"]) == pytest.approx((50.5, 90.1, 99.01))
    assert summarize([])["p99"] is None

    recs = []
    for i in range(30):
        klass = "a" if i % 3 else "b"
        times = list(np.cumsum(rng.uniform(0.01, 0.1, size=5)) + 1.0 + i)
        recs.append(RequestRecord(f"r{i}", klass, 0, float(i), 10, 5, ok=True, first_token_time=times[0],
                                  finish_time=times[-1], token_times=times, output_tokens=5))
    recs.append(RequestRecord("bad", "b", 0, 0.0, 10, 5, ok=False, error="HTTP 400: no"))
    rep = build_report(recs, duration=40.0, class_names=["a", "b"], mode="t", config={}, server={}, timeline=[])
    b = [r for r in recs if r.request_class == "b" and r.ok]
    assert rep["classes"]["b"]["completed"] == len(b) and rep["classes"]["b"]["failed"] == 1
    itl_b = np.concatenate([np.diff(r.token_times) for r in b])
    assert rep["classes"]["b"]["itl_s"]["p90"] == pytest.approx(np.percentile(itl_b, 90))
    ttft_all = [r.first_token_time - r.arrival_time for r in recs if r.ok]
    assert rep["overall"]["ttft_s"]["p99"] == pytest.approx(np.percentile(ttft_all, 99))
    assert rep["overall"]["output_throughput_tok_s"] == pytest.approx(30 * 5 / 40.0)
    assert rep["errors"] == ["HTTP 400: no"]


def test_token_identity_report_finds_a_difference():
    want = {"a": [1, 2, 3, 4], "b": [5, 6, 7]}
    assert compare_tokens({"a": [1, 2, 3, 4], "b": [5, 6, 7]}, want)["all_identical"]
    r = compare_tokens({"a": [1, 2, 9, 4], "b": [5, 6, 7]}, want)
    assert not r["all_identical"] and r["identical"] == 1
    assert r["mismatches"][0]["request_id"] == "a" and r["mismatches"][0]["first_diff"] == 2


# ---- bench serve against a live server -----------------------------------------------


@pytest.fixture(scope="module")
def live_server(model_dir):
    from aiohttp import web

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.server.app import build_app

    ready, held = threading.Event(), {}

    def serve():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        # 4 sequences at once for 8 requests: the queue shows in the metrics.
        engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", device="cpu", num_pages=64 + 3 * 4,
                                      max_num_seqs=4, max_num_batched_tokens=128,
                                      max_model_len=256))
        metrics = EngineMetrics()
        app = build_app(AsyncEngine(engine, on_step=metrics.observe_step), metrics, "tiny")
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        held.update(loop=loop, engine=engine, port=runner.addresses[0][1])
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(120)
    yield held
    held["loop"].call_soon_threadsafe(held["loop"].stop)
    thread.join(10)


def _all_fields(rep):
    assert set(rep) >= {"mode", "config", "duration_s", "overall", "classes", "server", "timeline", "requests", "errors"}
    for s in [rep["overall"], *rep["classes"].values()]:
        assert set(s) == {"completed", "failed", "input_tokens", "output_tokens", "output_throughput_tok_s",
                          "request_throughput_req_s", "ttft_s", "itl_s", "tpot_s", "e2e_s", "empty_streams"}
        for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(s[m]) == {"mean", "p50", "p90", "p99"}
            assert all(isinstance(v, float) and v >= 0 for v in s[m].values()), (m, s[m])
    assert set(rep["server"]) >= {"preemptions", "peak_kv_blocks_used", "kv_blocks_total", "peak_state_pages_used",
                                  "arena_pages_total", "peak_running", "peak_waiting", "prefix_tokens_skipped",
                                  "prefix_tokens_skipped_source"}


def test_bench_serve_against_a_live_server_reports_every_field_and_plots(live_server, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    phases0 = dict(live_server["engine"].stats()["step_phase_seconds"])
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{live_server['port']}", "--num-prompts", "8",
               "--seed", "1", "--class", "chat:prompt=8-24,output=4-8,priority=0,prefix=16",
               "--class", "batch:prompt=24-48,output=6-10,priority=1", "--output", str(out), "--plot", str(png),
               "--no-progress", "--metrics-interval", "0.05"])
    assert rc == 0
    rep = json.loads(out.read_text())
    _all_fields(rep)
    assert rep["mode"] == "serve" and rep["errors"] == []
    assert rep["overall"]["completed"] == 8 and set(rep["classes"]) == {"chat", "batch"}
    w = generate_workload(num_prompts=8, seed=1, classes=[
        parse_class("chat:prompt=8-24,output=4-8,priority=0,prefix=16", default_prompt=(1, 1), default_output=(1, 1)),
        parse_class("batch:prompt=24-48,output=6-10,priority=1", default_prompt=(1, 1), default_output=(1, 1))])
    # EOS ignored: every request produced exactly what it asked for (usage from the server).
    assert {r["request_id"]: r["output_tokens"] for r in rep["requests"]} == {r.request_id: r.output_len for r in w.requests}
    assert {r["request_id"]: r["prompt_len"] for r in rep["requests"]} == {r.request_id: len(r.prompt) for r in w.requests}
    assert all(r["ttft_s"] <= r["e2e_s"] for r in rep["requests"])
    srv = rep["server"]
    assert srv["kv_blocks_total"] == srv["arena_pages_total"] == 64 + 3 * 4
    # The peaks are sampled gauges (a scrape every 0.05 s): on a loaded machine the run can
    # fall between two scrapes, so the test checks what the report claims of its samples
    # (the peak is the largest one; 3 pages per running sequence, 4 at most), not that a
    # scrape caught a running sequence.
    assert srv["peak_state_pages_used"] == max(p["state_pages_used"] for p in rep["timeline"])
    assert srv["peak_kv_blocks_used"] == max(p["kv_blocks_used"] for p in rep["timeline"])
    assert srv["peak_state_pages_used"] in (0, 3, 6, 9, 12)
    # A sample that caught a running sequence caught its KV blocks too.
    assert all(p["kv_blocks_used"] >= 1 for p in rep["timeline"] if p["state_pages_used"] > 0)
    assert srv["peak_running"] <= 4 and srv["preemptions"] == 0
    assert srv["prefix_tokens_skipped"] is not None and srv["prefix_tokens_skipped_source"]
    assert len(rep["timeline"]) >= 2
    # The step phases from /metrics, before and after: per step, the engine's own
    # cumulative phase seconds over the run divided by its steps; per sequence,
    # by the sequences those steps scheduled (1 to max_num_seqs = 4 per step).
    phases1 = live_server["engine"].stats()["step_phase_seconds"]
    phases = srv["step_phases"]
    assert list(phases) == ["schedule", "prepare_inputs", "forward", "sample", "process_outputs"]
    assert srv["steps"] > 0
    for name, v in phases.items():
        assert v["us_per_step"] * srv["steps"] == pytest.approx(1e6 * (phases1[name] - phases0[name]), rel=1e-6)
        assert 1 <= v["us_per_step"] / v["us_per_seq"] <= 4
    ratios = {round(v["us_per_step"] / v["us_per_seq"], 9) for v in phases.values()}
    assert len(ratios) == 1
    text = render_table(rep)
    assert "step phases, us per step / per sequence: schedule" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ---- bench throughput ----------------------------------------------------------------


def test_bench_throughput_compare_hf_reports_token_identity(model_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", model_dir, "--num-prompts", "4", "--prompt-len", "8-24",
               "--output-len", "3-6", "--compare-hf", "--hf-batch-size", "2", "--threads", "2",
               "--output", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    _all_fields(rep)
    c = rep["compare_hf"]
    assert c["requests"] == 4 and c["useful_output_tokens"] == sum(r["output_len"] for r in rep["requests"])
    for key in ("tokens_vs_hf_single", "tokens_vs_hf_static"):
        assert c[key]["requests"] == 4 and c[key]["all_identical"], c[key]["mismatches"]
    for key in ("hf_static", "hf_single"):
        assert c[key]["output_throughput_tok_s"] > 0
        assert c["ratio_vs_" + key] == pytest.approx(
            c["hybridserve"]["output_throughput_tok_s"] / c[key]["output_throughput_tok_s"])
    assert rep["config"]["torch_threads"] == 2
    # The engine's step phases, per step and per scheduled sequence (issue 20).
    phases = rep["server"]["step_phases"]
    assert list(phases) == ["schedule", "prepare_inputs", "forward", "sample", "process_outputs"]
    assert all(v["us_per_step"] > 0 and 0 < v["us_per_seq"] <= v["us_per_step"] for v in phases.values())
    text = capsys.readouterr().out
    assert "HF generate, static batches of 2" in text and "4/4" in text
    assert "step phases, us per step / per sequence: schedule" in text


def test_seed_scenario_concurrency_matches_the_plan(model_dir, tmp_path):
    from hybridserve import planner
    from hybridserve.bench.scenario import SEED_POOL_MIB, SEED_SESSION_MIB
    from hybridserve.config import ModelConfig

    out = tmp_path / "s.json"
    rc = main(["bench", "throughput", model_dir, "--seed-scenario", "--scenario-context", "32",
               "--scenario-output", "2", "--scenario-sessions", "12", "--output", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads(out.read_text())["seed_scenario"]
    # By hand, in arena pages: a page is one 16-token block (8,192 B here); a session's
    # DeltaNet state is 3 pages (16,896 B of state); the pool (the seed's 1.79 sessions
    # of raw bytes per MiB ratio) holds 44 pages: 32-token sessions of 2 + 3 pages -> 8
    # paged; reserving the 256-token maximum takes 16 + 3 pages -> 2.
    import dataclasses
    cfg = dataclasses.replace(ModelConfig.from_json(model_dir), torch_dtype="float32", max_position_embeddings=256)
    bb, slot = planner.block_bytes(cfg, 16, "float32"), planner.state_slot_bytes(cfg)
    pool = (2 * bb + slot) * SEED_POOL_MIB // SEED_SESSION_MIB
    assert s["pool_bytes"] == pool
    page, state = bb, -(-slot // bb)
    assert (page, state, pool // page) == (8192, 3, 44)
    assert s["plan"]["sessions_paged"] == (pool // page) // (2 + state) == 8
    assert s["plan"]["sessions_reserved_max"] == (pool // page) // (16 + state) == 2
    assert s["policies"]["paged"]["peak_concurrent_sessions"] == 8
    assert s["policies"]["reserve_max"]["peak_concurrent_sessions"] == s["plan"]["sessions_reserved_max"]
    assert s["ratio_matches_plan"] and math.isclose(s["concurrency_ratio"], s["plan_ratio"])
    assert all(p["completed"] == 12 and p["failed"] == 0 for p in s["policies"].values())


def test_bench_throughput_with_speculation_reports_drafts_and_the_same_tokens_as_hf(model_dir, tmp_path, capsys):
    """--speculative-config on bench: greedy tokens still equal HF's (the oracle), and the
    report carries the drafts verified and accepted (the engine's counters)."""
    out = tmp_path / "s.json"
    rc = main(["bench", "throughput", model_dir, "--num-prompts", "3", "--prompt-len", "8-16",
               "--output-len", "6-10", "--compare-hf", "--hf-batch-size", "1", "--threads", "1",
               "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
               "--output", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    c = rep["compare_hf"]
    assert c["tokens_vs_hf_single"]["all_identical"], c["tokens_vs_hf_single"]["mismatches"]
    srv = rep["server"]
    assert srv["spec_draft_tokens"] > 0 and 0 <= srv["spec_accepted_tokens"] <= srv["spec_draft_tokens"]
    assert srv["spec_verify_runs"] > 0
    assert "speculative decoding: " in capsys.readouterr().out


def test_bench_refuses_a_bad_speculative_config(model_dir, capsys):
    assert main(["bench", "throughput", model_dir, "--speculative-config", '{"method": "ngram"}']) == 2
    assert "speculative_config method 'ngram' is not supported" in capsys.readouterr().err
