"""The prepared device run (benches/gpu_check.py) in its CPU dry run, so that it cannot
rot while no GPU is around: every check's code path runs at toy sizes (Triton kernels
under TRITON_INTERPRET=1), each prints one JSON line, and the run exits 0 only when
none fails. Criteria only CUDA can decide say "not applicable" there, never passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_on_the_cpu():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(REPO / "benches" / "gpu_check.py"), "--device", "cpu", "--small",
                        "--budget-s", "100000"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    by_name = {rec["check"]: rec for rec in lines}
    # Other checks may be registered too; these are the ones this test knows.
    assert {"device", "kernels", "gpu_tests", "fidelity", "sync", "seed", "e2e", "pools", "moe", "tp", "quant", "spec", "summary"} <= set(by_name), \
        r.stdout + r.stderr[-3000:]
    failed = {k: v for k, v in by_name.items() if v.get("status") == "fail"}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert r.returncode == 0
    checks = {k: v for k, v in by_name.items() if k not in ("device", "summary")}
    # Every check asserts something, and its status follows from its criteria.
    for name, rec in checks.items():
        statuses = [c["status"] for c in rec["criteria"]]
        assert statuses, name
        assert rec["status"] == ("pass" if "pass" in statuses else "not applicable"), (name, statuses)
        assert rec["ok"] == (rec["status"] == "pass"), name
    # What only CUDA can decide is "not applicable" on the CPU, never passed.
    na = lambda rec, text: [c for c in rec["criteria"] if text in c["name"]]  # noqa: E731
    assert by_name["sync"]["status"] == "not applicable" and not by_name["sync"]["ok"]
    assert {c["status"] for c in by_name["sync"]["criteria"]} == {"not applicable"}
    # tests_gpu's tests that can run on the CPU do; "none skipped" is the device's to decide.
    assert [c["status"] for c in na(by_name["gpu_tests"], "skipped")] == ["not applicable"]
    assert [c["status"] for c in na(by_name["e2e"], "CUDA graphs and eager")] == ["not applicable"]
    assert [c["status"] for c in na(by_name["e2e"], "replayed")] == ["not applicable"]
    assert [c["status"] for c in na(by_name["seed"], "bandwidth floor")] == ["not applicable"]
    assert [c["status"] for c in na(by_name["fidelity"], "CUDA graphs")] == ["not applicable"]
    spec = by_name["spec"]
    assert [c["status"] for c in spec["criteria"]] == ["pass", "not applicable", "not applicable", "not applicable"]
    assert [c["identical"] for c in spec["cases"] if "identical" in c] == [True] * 4
    assert [c["draft_tokens"] > 0 for c in spec["cases"] if "draft_tokens" in c] == [True] * 2
    # The staging-copy count the device criterion reads works here too (no verify graphs on the CPU).
    assert [(c["most_staging_copies_per_step"], c["verify_fills"]) for c in spec["cases"] if "draft_tokens" in c] \
        == [(1, 0)] * 2
    assert "sync" in by_name["summary"]["not_applicable"]
    # Tensor parallelism needs two GPUs: not applicable here, never ok; its comparison
    # still ran over gloo on the CPU, and TP=2 matched one process.
    tp = by_name["tp"]
    assert tp["status"] == "not applicable" and not tp["ok"] and "tp" in by_name["summary"]["not_applicable"]
    assert {c["status"] for c in tp["criteria"]} == {"not applicable"}
    assert tp["cpu_gloo"] and all(r["greedy_equal"] and r["logprobs_ok"] for r in tp["cpu_gloo"].values())
    # The kill path ran over gloo too: the killed worker failed the step in time.
    assert tp["cpu_gloo_kill"]["ended"] == "error" and tp["cpu_gloo_kill"]["ok"], tp["cpu_gloo_kill"]
    assert by_name["sync"]["eager"]["beam_request_running"]
    # The checks measured something, against their oracles.
    assert all(c["ok"] for c in by_name["kernels"]["cases"]) and by_name["kernels"]["cases"]
    fid = by_name["fidelity"]["cases"][0]
    assert fid["max_rel_logit_err"] <= 1e-4 and fid["greedy_match_hf"] == {"eager": True}
    seed = by_name["seed"]["policies"]
    assert seed["paged"]["peak_concurrent"] == seed["paged"]["planner_predicts"] >= 2
    assert seed["reserve_max"]["peak_concurrent"] == 1
    assert by_name["sync"]["eager"]["note"].startswith("CPU dry run")
    quant = by_name["quant"]
    assert quant["status"] == "pass" and all(c["ok"] for c in quant["kernel"]) and quant["kernel"]
    assert all(m["greedy_match_hf"] == {"eager": True} for m in quant["models"].values())
    pools = by_name["pools"]
    assert pools["peak_concurrent"] == pools["planner_predicts"] and pools["cache_bytes"] <= pools["pool_bytes"]
