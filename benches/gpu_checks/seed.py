"""The seed's numbers on the device: decode step against the bandwidth floor, admission."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

from gpu_checks.common import criterion, log, Ctx, random_model_dir, random_weight_engine, make_engine, sync, free_memory


def _seed_config(ctx: Ctx) -> dict[str, Any]:
    from hybridserve.presets import preset_path

    with open(preset_path("qwen3.5-27b")) as f:
        cfg = json.load(f)
    if ctx.small:
        from hybridserve.model.tiny import text_config

        cfg = {**text_config("test-a", vocab_size=300, max_position_embeddings=2048),
               "architectures": ["Qwen3_5ForCausalLM"]}
    return cfg


def _fake_prefill(eng) -> Callable:
    """Wrap the runner so that steps with prefill rows write random K/V at their slots
    and random DeltaNet state into their slots instead of running the model (their
    sampling rows get random logits); pure-decode steps run the model."""
    import torch

    from hybridserve.runner.model_runner import StepLogits

    runner = eng.runner
    real = runner.execute
    cache = runner.cache
    gen = torch.Generator(device=cache.device).manual_seed(7)

    def execute(plan, *a):
        n_tok, n_seq = len(plan.input_ids), len(plan.seq_lens)
        if n_tok == 0 or n_tok == n_seq or a:
            return real(plan, *a)
        with torch.inference_mode():
            runner.stage(plan)
            runner.apply_block_table_updates(plan)
            runner.apply_copies(plan)
            s = runner._staged
            _, sampling, num_samples = runner._host
            slots = s["slot_mapping"]
            slots = slots[slots >= 0]
            bs = cache.block_size
            for kc in (*cache.k_caches, *cache.v_caches):  # strided views of the arena's pages
                kc[slots // bs, slots % bs] = torch.randn(len(slots), kc.shape[2], kc.shape[3], device=kc.device,
                                                          generator=gen).to(kc.dtype)
            # Every state page of the step's sequences (their state page table rows).
            table = runner.state_table_buf.index_select(0, s["block_table_rows"]).long()
            rec, conv = table[:, :cache.layout.recurrent_pages].reshape(-1), table[:, cache.layout.recurrent_pages:]
            for pool, pages in ((cache.recurrent_pool, rec), (cache.conv_pool, conv.reshape(-1))):
                pool[pages] = (0.1 * torch.randn(len(pages), *pool.shape[1:], device=pool.device,
                                                 generator=gen)).to(pool.dtype)
            logits = torch.randn(len(sampling), eng.model_config.vocab_size, device=cache.device, generator=gen)
        return StepLogits(logits=logits, batch_index=sampling, num_samples=num_samples)

    return execute


def _copy_bandwidth(ctx: Ctx) -> float:
    import torch

    n = (2 << 30) if ctx.cuda else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(ctx)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(ctx)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n / statistics.median(times)  # bytes read + written per second


def _admission_run(eng, n_req: int, prompt_len: int, out_len: int, tag: str) -> dict[str, Any]:
    """Submit ``n_req`` sessions at once (prefill replaced, see :func:`_fake_prefill`);
    the peak number scheduled together, per-batch-size pure-decode step times, and
    whether every output has the right length and ids in the vocabulary."""
    from hybridserve.sampling import SamplingParams

    eng.runner.execute = _fake_prefill(eng)
    vocab = eng.model_config.vocab_size
    for i in range(n_req):
        eng.add_request(f"{tag}-{i}", [(7 * i + j) % 200 + 1 for j in range(prompt_len)],
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    peak, decode_times, shapes_ok, steps, done = 0, {}, True, 0, 0
    while eng.has_unfinished_requests() and steps < 20_000:
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        steps += 1
        st = eng.last_step_stats
        peak = max(peak, st["num_scheduled_seqs"])
        if st["num_scheduled_seqs"] and st["num_batched_tokens"] == st["num_scheduled_seqs"]:
            decode_times.setdefault(st["num_scheduled_seqs"], []).append(dt)
        for o in outs:
            if o.finished:
                done += 1
                shapes_ok &= len(o.outputs[0].token_ids) == out_len and all(
                    0 <= t < vocab for t in o.outputs[0].token_ids)
    return {"peak": peak, "decode_times": decode_times, "shapes_ok": shapes_ok and done == n_req,
            "finished": done, "steps": steps}


def check_seed(ctx: Ctx) -> dict[str, Any]:
    import torch

    from hybridserve import planner
    from hybridserve.bench.scenario import SEED_CONTEXT, SEED_NATIVE_MAX, SEED_POOL_MIB, scenario_pool
    from hybridserve.config import ModelConfig

    cfg = _seed_config(ctx)
    d = random_model_dir(ctx.tmp, "seed", cfg)
    dtype = "bfloat16" if ctx.cuda else "float32"
    native = cfg["max_position_embeddings"]
    L = SEED_CONTEXT if not ctx.small else native * SEED_CONTEXT // SEED_NATIVE_MAX
    if ctx.small:
        import dataclasses

        config = dataclasses.replace(ModelConfig.from_json(d), torch_dtype=dtype)
        pool = scenario_pool(config, L, 16, dtype)
    else:
        pool = SEED_POOL_MIB * planner.MiB
    # All sessions' prefill fits in a few steps (4 sessions' tokens per step), so the
    # early ones are still decoding when the last one joins: the paged run reaches its
    # full batch in pure-decode steps.
    out_len = 16 if not ctx.small else 8
    budget = 4 * L
    bw = _copy_bandwidth(ctx)
    out: dict[str, Any] = {
        "shape": "qwen3.5-27b preset (= ../shared/fixtures/qwen3_5_27b_shape.config.json)" if not ctx.small
        else "test-a (dry run)", "pool_mib": pool / planner.MiB, "session_tokens": L, "output_tokens": out_len,
        "prefill": "replaced: random K/V and DeltaNet state written at the scheduled slots, random logits "
                   "for the rows sampled in steps with prefill; pure-decode steps run the model",
        "copy_bandwidth_gb_s": round(bw / 1e9, 1), "policies": {},
    }
    want = {"paged": 10, "reserve_max": 1}
    crit: list[dict[str, Any]] = []
    for policy in ("paged", "reserve_max"):
        with random_weight_engine():
            eng = make_engine(
                d, ctx, dtype=dtype, max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=native,
                kv_cache_memory_bytes=pool, admission_policy=policy, enable_prefix_caching=False,
            )
        # One arena for both policies (issue 17): the plan the engine sized it by.
        predicted = (eng.arena_plan.sessions(L).sessions if policy == "paged"
                     else eng.arena_plan.sessions_reserved_max().sessions)
        target = want[policy] if not ctx.small else predicted
        run = _admission_run(eng, target + 1, L - out_len, out_len, policy)
        # The memory a decode step of B sessions must move: weights (less the unread
        # embedding rows), each session's K/V, DeltaNet state read and written.
        c = eng.model_config
        el = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        weights -= eng.model.embed_tokens.weight.numel() * el
        kv_per_token = 2 * c.num_full_attention_layers * c.num_key_value_heads * c.head_dim * el
        state = planner.state_slot_bytes(c)
        floors = {}
        for b, ts in sorted(run["decode_times"].items()):
            bytes_moved = weights + b * (L * kv_per_token + 2 * state)
            floors[str(b)] = {"median_step_ms": round(1e3 * statistics.median(ts), 3), "steps": len(ts),
                              "floor_ms": round(1e3 * bytes_moved / bw, 3),
                              "bytes_per_step_gib": round(bytes_moved / 2**30, 3)}
        res = {"sessions_submitted": target + 1, "peak_concurrent": run["peak"], "planner_predicts": predicted,
               "expected": target, "outputs_well_formed": run["shapes_ok"], "decode": floors,
               "arena_pages": eng.num_pages, "state_pages": eng.state_pages,
               "params": sum(p.numel() for p in eng.model.parameters()),
               "cuda_graphs": eng.runner.graphs is not None}
        at = floors.get(str(target))
        crit += [
            criterion(f"{policy}: {target} sessions run at once, as the planner predicts",
                      run["peak"] == target == predicted, peak=run["peak"], predicted=predicted),
            criterion(f"{policy}: every session finished with all its tokens", run["shapes_ok"]),
            criterion(f"{policy}: decode steps at the full batch of {target} were timed", at is not None),
        ]
        if policy == "paged":
            # The memory-bound claim, on a GPU only: a CPU step is not bandwidth-bound.
            crit.append(criterion(
                f"paged: decode step at batch {target} within 2x the bandwidth floor",
                (at["median_step_ms"] <= 2 * at["floor_ms"]) if (ctx.cuda and at is not None) else None,
                step_ms=at and at["median_step_ms"], floor_ms=at and at["floor_ms"]))
        out["policies"][policy] = res
        log(f"seed {policy}: {res}")
        del eng
        free_memory()
    out["criteria"] = crit
    return out
