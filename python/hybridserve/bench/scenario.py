"""``--seed-scenario``: the seed's paged-vs-reserved comparison, live, scaled to the model.

The seed's table: a 23,859 MiB pool holds 10 sessions of 32,768 tokens when KV is
paged (2,192 MiB each) and 1 when each session reserves the native maximum of
262,144 tokens. Scaled to the model at hand, keeping both proportions:

* session length L = ``max_position_embeddings / 8`` (32,768 / 262,144), unless given;
* the engine's maximum length (what reserve-max reserves) is 8 L;
* the pool is 23,859 / 2,192 sessions' worth of one paged L-token session of *this*
  model (its KV blocks and its DeltaNet state pages).

``2 x`` the paged capacity of sessions (prompt L - output, then output tokens, all
arriving at once) run under each admission policy on that same arena (one page pool
for KV blocks and DeltaNet state: L tokens paged, or the maximum reserved, as
``hybridserve plan`` counts them); the report
gives peak concurrent sessions and throughput under each, and the ratio next to
what ``hybridserve plan`` predicts for that pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridserve import planner
from hybridserve.bench.engine_runner import run_engine
from hybridserve.bench.report import build_report
from hybridserve.bench.workload import RequestClass, generate_workload
from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError

SEED_POOL_MIB = 23_859
SEED_SESSION_MIB = 2_192
SEED_CONTEXT = 32_768
SEED_NATIVE_MAX = 262_144


def scenario_pool(config: ModelConfig, context_len: int, block_size: int, kv_dtype: str) -> int:
    """Bytes of a pool sized like the seed's, for sessions of ``context_len`` tokens."""
    per_session = planner.paged_sequence_bytes(config, context_len, block_size, kv_dtype)
    return per_session * SEED_POOL_MIB // SEED_SESSION_MIB


def run_seed_scenario(
    model_dir: str,
    *,
    dtype_name: str,
    engine_kwargs: dict[str, Any],
    context_len: int | None,
    output_len: int | None,
    num_sessions: int | None,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    from hybridserve import LLM

    base = ModelConfig.from_json(model_dir)
    L = context_len or base.max_position_embeddings * SEED_CONTEXT // SEED_NATIVE_MAX
    max_len = L * SEED_NATIVE_MAX // SEED_CONTEXT
    if max_len > base.max_position_embeddings:
        raise ConfigError(
            f"a {L}-token session scaled like the seed's needs a {max_len}-token maximum, beyond the model's "
            f"{base.max_position_embeddings}; give --scenario-context of at most {base.max_position_embeddings // 8}"
        )
    block_size = engine_kwargs.get("block_size", 16)
    config = dataclasses.replace(base, torch_dtype=dtype_name, max_position_embeddings=max_len)
    pool = scenario_pool(config, L, block_size, dtype_name)
    plan = planner.capacity_report(config, context_len=L, pool_bytes=pool, block_size=block_size)
    out = output_len or max(1, L // 8)
    if out >= L:
        raise ConfigError(f"--scenario-output {out} must be shorter than the {L}-token session")
    k = num_sessions or 2 * max(plan.sessions_paged, 1)
    workload = generate_workload(
        num_prompts=k, seed=seed, classes=[RequestClass("session", (L - out, L - out), (out, out))],
    )
    runs: dict[str, Any] = {}
    for policy in ("paged", "reserve_max"):
        # Both policies on the same one arena of `pool` bytes.
        kw = {**engine_kwargs, "kv_cache_memory_bytes": pool,
              "max_model_len": max_len, "admission_policy": policy,
              "max_num_seqs": max(k, engine_kwargs.get("max_num_seqs", 1))}
        kw.pop("num_pages", None)
        kw.pop("num_gpu_blocks", None)
        kw.pop("num_state_slots", None)
        llm = LLM(model_dir, **kw)
        records, server, timeline, duration = run_engine(llm.engine, workload, progress=progress)
        rep = build_report(records, duration=duration, class_names=["session"], mode=f"seed-scenario {policy}",
                           config={}, server=server, timeline=[])
        runs[policy] = {
            "peak_concurrent_sessions": server["peak_running"],
            "engine_predicts": (llm.engine.arena_plan.sessions(L).sessions if policy == "paged"
                                else llm.engine.arena_plan.sessions_reserved_max().sessions),
            "completed": rep["overall"]["completed"],
            "failed": rep["overall"]["failed"],
            "wall_s": duration,
            "output_throughput_tok_s": rep["overall"]["output_throughput_tok_s"],
            "e2e_s": rep["overall"]["e2e_s"],
            "ttft_s": rep["overall"]["ttft_s"],
            "kv_blocks_total": server["kv_blocks_total"],
            "arena_pages_total": server["arena_pages_total"],
            "peak_kv_blocks_used": server["peak_kv_blocks_used"],
            "preemptions": server["preemptions"],
        }
        del llm
    paged, reserved = runs["paged"], runs["reserve_max"]
    measured = paged["peak_concurrent_sessions"] / max(reserved["peak_concurrent_sessions"], 1)
    predicted = plan.sessions_paged / max(plan.sessions_reserved_max, 1)
    return {
        "session_tokens": L,
        "prompt_tokens": L - out,
        "output_tokens": out,
        "max_model_len": max_len,
        "sessions": k,
        "pool_bytes": pool,
        "pool_mib": pool / planner.MiB,
        # planner.capacity_report is what `hybridserve plan` prints; the pool is given
        # in bytes here because the scaled pool is not a whole number of MiB.
        "plan": {"sessions_paged": plan.sessions_paged, "sessions_reserved_max": plan.sessions_reserved_max,
                 "source": f"planner.capacity_report (hybridserve plan) for this pool, --context {L}, "
                           f"max length {max_len}, {dtype_name}"},
        "policies": runs,
        "concurrency_ratio": measured,
        "plan_ratio": predicted,
        "ratio_matches_plan": paged["peak_concurrent_sessions"] == plan.sessions_paged
        and reserved["peak_concurrent_sessions"] == plan.sessions_reserved_max,
        "throughput_ratio": paged["output_throughput_tok_s"] / max(reserved["output_throughput_tok_s"], 1e-9),
    }


def render_scenario(s: dict[str, Any]) -> str:
    lines = [
        f"seed scenario: {s['sessions']} sessions of {s['session_tokens']} tokens ({s['prompt_tokens']} prompt + "
        f"{s['output_tokens']} output), max length {s['max_model_len']}, pool {s['pool_mib']:.2f} MiB "
        "(the seed's 23,859 MiB / 2,192 MiB per session, scaled)",
    ]
    head = ["policy", "peak sessions", "plan predicts", "out tok/s", "wall s", "e2e p50 ms", "preemptions"]
    rows = [head]
    pred = {"paged": s["plan"]["sessions_paged"], "reserve_max": s["plan"]["sessions_reserved_max"]}
    for name, r in s["policies"].items():
        rows.append([name, str(r["peak_concurrent_sessions"]), str(pred[name]),
                     f"{r['output_throughput_tok_s']:.1f}", f"{r['wall_s']:.2f}",
                     "-" if r["e2e_s"]["p50"] is None else f"{1e3 * r['e2e_s']['p50']:.0f}", str(r["preemptions"])])
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.rjust(x) if i else c.ljust(x) for i, (c, x) in enumerate(zip(r, w))) for r in rows]
    lines.append(
        f"paged / reserve_max: {s['concurrency_ratio']:.1f}x sessions at once (plan: {s['plan_ratio']:.1f}x, "
        f"{'matches' if s['ratio_matches_plan'] else 'DOES NOT match'}), {s['throughput_ratio']:.2f}x throughput"
    )
    return "\n".join(lines)
