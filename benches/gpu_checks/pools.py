"""Live admission against what the planner predicts for the pool."""

from __future__ import annotations

from typing import Any

from gpu_checks.common import criterion, Ctx, random_model_dir, random_weight_engine, make_engine, free_memory
from gpu_checks.e2e import _e2e_config
from gpu_checks.seed import _admission_run


def check_pools(ctx: Ctx) -> dict[str, Any]:
    """The engine sizes its pools from the device's measured free memory: ask for a
    utilization that leaves room for about 12 sessions, then check that the planner's
    prediction (from the engine's own pool plan) is what live admission runs."""
    import torch

    from hybridserve import planner
    from hybridserve.config import ModelConfig

    cfg = _e2e_config(ctx)
    d = random_model_dir(ctx.tmp, "pools", cfg)
    L, out_len = (1024, 8) if not ctx.small else (128, 2)
    dtype = "bfloat16" if ctx.cuda else "float32"
    kw = dict(dtype=dtype, max_num_seqs=32, max_num_batched_tokens=16 * L, max_model_len=L,
              enable_prefix_caching=False)
    import dataclasses

    from hybridserve.memory.layout import arena_layout

    config = dataclasses.replace(ModelConfig.from_json(d), torch_dtype=dtype, max_position_embeddings=L)
    layout = arena_layout(config, 16, dtype)
    # One session's pages (its state + its blocks); the CUDA-graph scratch state on top.
    session = layout.pages_for_sequence(L) * layout.page_bytes
    out: dict[str, Any] = {"session_bytes": session}
    if ctx.cuda:
        total = torch.cuda.mem_get_info(ctx.device)[1]
        # What the engine will see in use once its weights are loaded (measured on a
        # probe engine with a one-session pool), plus the runtime reserve, plus 12
        # sessions, as a fraction of the device.
        with random_weight_engine():
            probe = make_engine(d, ctx, **kw, kv_cache_memory_bytes=session, enforce_eager=True)
        torch.cuda.synchronize()
        in_use = torch.cuda.mem_get_info(ctx.device)[1] - torch.cuda.mem_get_info(ctx.device)[0]
        in_use -= probe.cache.memory_bytes()
        del probe
        free_memory()
        reserve = 2 << 30
        util = (in_use + reserve + 12 * session + layout.state_pages * layout.page_bytes) / total
        kw.update(gpu_memory_utilization=min(util, 1.0), runtime_reserve_bytes=reserve)
        out["gpu_memory_utilization"] = util
    else:
        kw.update(cpu_pool_bytes=12 * session)
        out["note"] = "CPU dry run: the pool comes from cpu_pool_bytes; the CUDA path measures free memory"
    with random_weight_engine():
        eng = make_engine(d, ctx, **kw)
    predicted = eng.arena_plan.sessions(L).sessions
    run = _admission_run(eng, predicted + 1, L - out_len, out_len, "pools")
    out.update({"pool_bytes": eng.arena_plan.budget_bytes,
                "cache_bytes": eng.cache.memory_bytes(), "planner_predicts": predicted,
                "peak_concurrent": run["peak"], "outputs_well_formed": run["shapes_ok"],
                "cuda_graphs": eng.runner.graphs is not None})
    if ctx.cuda:
        out["free_after_engine_mib"] = round(torch.cuda.mem_get_info(ctx.device)[0] / 2**20, 1)
    out["criteria"] = [
        criterion("live admission runs what the planner predicts", run["peak"] == predicted,
                  peak=run["peak"], predicted=predicted),
        criterion("the pool holds about 12 sessions (6..32)", 6 <= predicted <= 32, predicted=predicted),
        criterion("every session finished with all its tokens", run["shapes_ok"]),
    ]
    del eng
    free_memory()
    return out
