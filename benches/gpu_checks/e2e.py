"""End to end: CUDA graphs against eager, throughput under load."""

from __future__ import annotations

import time
from typing import Any

from gpu_checks.common import criterion, log, pct, Ctx, random_model_dir, random_weight_engine, make_engine, free_memory


def _e2e_config(ctx: Ctx) -> dict[str, Any]:
    from hybridserve.model.tiny import text_config

    if ctx.small:
        return {**text_config("bench", vocab_size=512), "architectures": ["Qwen3_5ForCausalLM"]}
    # ~1.1B parameters in the Qwen3.5 layout (every 4th layer full attention).
    lin, full = "linear_attention", "full_attention"
    cfg = text_config(
        "bench", vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
        layer_types=[lin, lin, lin, full] * 4, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192,
    )
    return {**cfg, "architectures": ["Qwen3_5ForCausalLM"]}


def _run_load(eng, n: int, prompt_len: int, out_len: int, seed: int) -> dict[str, Any]:
    import random

    from hybridserve.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    t0 = time.perf_counter()
    arrival: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    for i in range(n):
        rid = f"r{seed}-{i}"
        eng.add_request(rid, [rng.randrange(1, min(vocab, 250)) for _ in range(prompt_len)],
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        arrival[rid] = time.perf_counter()
        times[rid] = []
    tokens: dict[str, list[int]] = {}
    eng.emit_unfinished = True
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            # Running requests report their new tokens (deltas), the finished one all.
            got = len(o.outputs[0].token_ids) + (len(times[o.request_id]) if o.delta else 0)
            while len(times[o.request_id]) < got:
                times[o.request_id].append(now)
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    ttft = [times[r][0] - arrival[r] for r in times if times[r]]
    itl = [b - a for r in times for a, b in zip(times[r], times[r][1:])]
    total = sum(len(t) for t in tokens.values())
    well_formed = len(tokens) == n and all(len(t) == out_len and all(0 <= x < vocab for x in t)
                                           for t in tokens.values())
    return {"outputs_well_formed": well_formed,
        "concurrency": n, "prompt_tokens": prompt_len, "output_tokens": out_len, "wall_s": round(wall, 3),
        "output_tok_s": round(total / wall, 1),
        "ttft_ms_p50": 1e3 * pct(ttft, 50), "ttft_ms_p99": 1e3 * pct(ttft, 99),
        "itl_ms_p50": 1e3 * pct(itl, 50) if itl else None, "itl_ms_p99": 1e3 * pct(itl, 99) if itl else None,
        "_tokens": [tokens[f"r{seed}-{i}"] for i in range(n)],
    }


def check_e2e(ctx: Ctx) -> dict[str, Any]:
    levels = [1, 4] if ctx.small else ([1, 16] if ctx.quick else [1, 16, 64, 256])
    prompt_len, out_len = (8, 4) if ctx.small else (128, 64)
    cfg = _e2e_config(ctx)
    d = random_model_dir(ctx.tmp, "e2e", cfg)
    out: dict[str, Any] = {"levels": levels, "weights": "random, drawn on the device", "modes": {}}
    token_sets = {}
    for eager in ([False, True] if ctx.cuda else [True]):
        mode = "eager" if eager else "graphs"
        with random_weight_engine():
            t0 = time.perf_counter()
            eng = make_engine(d, ctx, dtype="bfloat16" if ctx.cuda else "float32", max_num_seqs=max(levels),
                              max_num_batched_tokens=8192, max_model_len=1024,
                              kv_cache_memory_bytes=(8 << 30) if ctx.cuda else (64 << 20),
                              enable_prefix_caching=False, enforce_eager=eager)
            startup = time.perf_counter() - t0
        params = sum(p.numel() for p in eng.model.parameters())
        out["params"] = params
        runs = []
        _run_load(eng, 1, prompt_len, 2, seed=99)  # warm-up (compilation) outside the numbers
        for n in levels:
            r = _run_load(eng, n, prompt_len, out_len, seed=n)
            token_sets[(mode, n)] = r.pop("_tokens")
            runs.append(r)
            log(f"e2e {mode} {r}")
        g = eng.runner.graphs
        out["modes"][mode] = {
            "startup_s": round(startup, 2), "runs": runs,
            "graph_capture_s": round(g.capture_seconds, 2) if g else None,
            "graph_capture_mib": round(g.capture_bytes / 2**20, 1) if g else None,
            "graph_replays": g.replays if g else 0,
        }
        del eng, g
        free_memory()
    crit = [criterion("every request finished with all its tokens, ids in the vocabulary",
                      all(r["outputs_well_formed"] for m in out["modes"].values() for r in m["runs"]))]
    if ctx.cuda:
        same = [token_sets[("graphs", n)] == token_sets[("eager", n)] for n in levels]
        agree = []
        for n in levels:
            a = [t for seq in token_sets[("graphs", n)] for t in seq]
            b = [t for seq in token_sets[("eager", n)] for t in seq]
            agree.append(sum(x == y for x, y in zip(a, b)) / max(len(a), 1))
        out["graphs_vs_eager_identical"] = dict(zip(map(str, levels), same))
        out["graphs_vs_eager_token_agreement"] = dict(zip(map(str, levels), agree))
        replays = out["modes"]["graphs"]["graph_replays"]
    else:
        same, replays = None, None
        out["note"] = "CPU dry run: CUDA graphs do not exist here; eager only"
    crit += [
        criterion("CUDA graphs and eager give identical greedy tokens at every level",
                  all(same) if same is not None else None),
        criterion("decode steps replayed CUDA graphs", replays > 0 if replays is not None else None,
                  replays=replays),
    ]
    out["criteria"] = crit
    return out
