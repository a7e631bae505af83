"""Tensor parallelism on two GPUs (NCCL) against the single-GPU engine."""

from __future__ import annotations

import random
from typing import Any

from gpu_checks.common import FP32_LOGIT_TOL, criterion, log, Ctx, free_memory

# Tiny shapes that exercise the sharding rules at 2 ranks: 1 KV head over 2 ranks
# (replicated) with 3 value heads per DeltaNet key head; a MoE with a shared expert.
CONFIGS = {
    "dense-kv1": dict(preset="test-a", num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6),
    "moe": dict(preset="moe-a"),
}
TOP_LOGPROBS = 5


def _run(path: str, device: str, tp: int, prompts: list[list[int]], n_tokens: int, eager: bool) -> list[Any]:
    """Greedy completions with their top-5 logprobs from ``LLM(path, tensor_parallel_size=tp)``;
    the engine (and its workers) are shut down before returning."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=tp, device=device, dtype="float32", max_num_seqs=8,
              num_pages=256, enforce_eager=eager, cpu_threads=1 if device == "cpu" else None)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True,
                                                    logprobs=TOP_LOGPROBS))
        return [o.outputs[0] for o in outs]
    finally:
        parallel = getattr(llm.engine, "parallel", None)
        if parallel is not None:
            parallel.close()  # workers gone (and their GPU memory) before the next engine starts
        del llm
        free_memory()


def _logprob_error(a: list[Any], b: list[Any]) -> float:
    """Largest difference between two runs' logprobs of the same tokens (top-5 of each
    position, the tokens both runs list), relative to the logprobs' scale (>= 1)."""
    worst = 0.0
    for x, y in zip(a, b):
        for pa, pb in zip(x.logprobs, y.logprobs):
            common = set(pa) & set(pb)
            scale = max([1.0] + [abs(pa[t].logprob) for t in common])
            for t in common:
                worst = max(worst, abs(pa[t].logprob - pb[t].logprob) / scale)
    return worst


def _compare(ctx: Ctx, device: str, names: list[str], n_tokens: int, modes: list[bool]) -> dict[str, Any]:
    """For each config and mode (eager / CUDA graphs): TP=2's greedy tokens and logprobs
    against one device's."""
    from hybridserve.model.tiny import write_tiny_checkpoint

    rng = random.Random(7)
    prompts = [[rng.randrange(259) for _ in range(n)] for n in ((9, 21) if ctx.small else (7, 33, 100))]
    res: dict[str, Any] = {}
    for name in names:
        kw = dict(CONFIGS[name])
        path = write_tiny_checkpoint(ctx.tmp / f"tp-{name}", seed=11, **kw)
        for eager in modes:
            mode = "eager" if eager else "graphs"
            one = _run(path, device, 1, prompts, n_tokens, eager)
            two = _run(path, device, 2, prompts, n_tokens, eager)
            rec = {
                "greedy_equal": [o.token_ids for o in two] == [o.token_ids for o in one],
                "max_rel_logprob_err": _logprob_error(two, one),
                "tokens": n_tokens, "prompts": len(prompts),
            }
            rec["logprobs_ok"] = rec["max_rel_logprob_err"] <= FP32_LOGIT_TOL
            res[f"{name} {mode}"] = rec
            log("tp", name, mode, rec)
    return res


def check_tp(ctx: Ctx) -> dict[str, Any]:
    """Issue 19's GPU path: ``LLM(model, tensor_parallel_size=2)`` on two GPUs (NCCL)
    against the same engine on one GPU, tiny float32 checkpoints (dense with 1 KV head
    over 2 ranks and 3 value heads per key head; MoE with a shared expert): greedy
    tokens identical and every generated position's top-5 logprobs within
    ``FP32_LOGIT_TOL`` (relative), eager and with CUDA graphs (which capture the
    all-reduces). With fewer than two GPUs every criterion is "not applicable"; the CPU
    dry run still runs the comparison over gloo on the CPU (the check's code path, so
    it cannot rot), reported under ``cpu_gloo`` and not counted as a pass."""
    import torch

    gpus = torch.cuda.device_count() if ctx.cuda else 0
    out: dict[str, Any] = {"cuda_devices": gpus, "configs": CONFIGS, "tol": FP32_LOGIT_TOL}
    names = list(CONFIGS)
    if ctx.cuda and gpus >= 2:
        res = _compare(ctx, "cuda", names, 4 if ctx.small else 24, [True, False])
        out["cuda"] = res
    else:
        why = (f"needs 2 CUDA devices, this machine has {gpus}" if ctx.cuda
               else "CPU dry run: NCCL on two GPUs cannot be checked here")
        out["not_applicable"] = why
        if not ctx.cuda:
            out["cpu_gloo"] = _compare(ctx, "cpu", names, 3, [True])
        res = {f"{n} {m}": None for n in names for m in ("eager", "graphs")}
    crit = []
    for key, rec in res.items():
        crit += [
            criterion(f"{key}: TP=2 greedy tokens equal one GPU's", None if rec is None else rec["greedy_equal"]),
            criterion(f"{key}: TP=2 logprobs within {FP32_LOGIT_TOL:g} of one GPU's",
                      None if rec is None else rec["logprobs_ok"],
                      **({} if rec is None else {"err": rec["max_rel_logprob_err"]})),
        ]
    out["criteria"] = crit
    return out
