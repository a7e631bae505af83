"""Where hybridserve's time goes on the side-by-side workload, in process (no HTTP).

The same requests through :class:`hybridserve.LLM` (greedy, EOS ignored), with every
forward timed and sorted by what the step held: prefill tokens (with or without
decodes riding along) or decodes only; and, with ``ops``, torch's profiler over the
whole run (self CPU time by op; the native kernels appear as their Python wrappers'
callers' time). Also the GEMM ceiling: ``torch.matmul`` of the model's largest
prefill projection shapes at the same thread count, for the fraction reached.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def gemm_ceiling(hidden: int, out: int, rows: int, dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of ``[rows, hidden] @ [hidden, out]`` (median of ``reps``)."""
    a = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(out, hidden, dtype=dtype)
    torch.nn.functional.linear(a, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 2 * rows * hidden * out / ts[len(ts) // 2] / 1e9


def profile(hf_dir: Path, prompts: list[list[int]], outputs: list[int], *, dtype: str, parallel: int,
            threads: int, budget: int | None, ops: bool) -> dict[str, Any]:
    from hybridserve import LLM
    from hybridserve.sampling import SamplingParams

    kw: dict[str, Any] = {"dtype": dtype, "max_num_seqs": parallel, "cpu_threads": threads,
                          "kv_cache_memory_bytes": 2 << 30}
    if budget:
        kw["max_num_batched_tokens"] = budget
    llm = LLM(str(hf_dir), **kw)
    runner = llm.engine.runner
    model = runner.model
    calls: list[tuple[int, int, float]] = []  # (tokens, sequences, seconds)
    inner = model.forward

    def timed(batch: Any, cache: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(batch, cache)
        n_tok = int(batch.input_ids.shape[0])
        n_seq = int(batch.query_start_loc.shape[0]) - 1
        calls.append((n_tok, n_seq, time.perf_counter() - t0))
        return out

    model.forward = timed
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
    calls.clear()
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outputs]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if ops else None
    t0 = time.perf_counter()
    if prof:
        with prof:
            llm.generate(prompts, params)
    else:
        llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for n_tok, n_seq, sec in calls:
        kind = "decode-only" if n_tok == n_seq else "with-prefill"
        k = kinds[kind]
        k[0] += 1
        k[1] += n_tok
        k[2] += sec
    res: dict[str, Any] = {
        "wall_s": wall, "forward_s": sum(c[2] for c in calls), "steps": len(calls),
        "output_tokens": sum(outputs),
        "by_kind": {kind: {"steps": int(v[0]), "tokens": int(v[1]), "seconds": round(v[2], 3),
                           "ms_per_step": round(1e3 * v[2] / max(v[0], 1), 1),
                           "tokens_per_s": round(v[1] / max(v[2], 1e-9), 1)} for kind, v in kinds.items()},
    }
    # Each step that carried prefill tokens: (tokens, sequences, ms), in order.
    res["prefill_steps"] = [(t, q, round(1e3 * sec)) for t, q, sec in calls if t != q]
    if prof:
        res["top_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return res
