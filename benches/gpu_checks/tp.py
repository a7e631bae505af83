"""Tensor parallelism on two GPUs (NCCL) against the single-GPU engine."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from gpu_checks.common import FP32_LOGIT_TOL, criterion, log, Ctx, free_memory

# Tiny shapes that exercise the sharding rules at 2 ranks: 1 KV head over 2 ranks
# (replicated) with 3 value heads per DeltaNet key head; a MoE with a shared expert.
CONFIGS = {
    "dense-kv1": dict(preset="test-a", num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6),
    "moe": dict(preset="moe-a"),
}
TOP_LOGPROBS = 5
# A killed worker must fail the step (TensorParallelError) or end the process within
# the step limit plus the watchdog's grace (at most 5 s) plus slack for a loaded host.
KILL_STEP_TIMEOUT_S = 10
KILL_DEADLINE_S = KILL_STEP_TIMEOUT_S + 5 + 10

# Run in a child process: TP=2 on `device`, graphs mode unless `eager`; the worker is
# SIGKILLed after 3 decode steps. Prints JSON lines: the kill time, then how it ended.
_KILL_CHILD = r"""
import json, os, signal, sys, time
from hybridserve import LLM, SamplingParams
from hybridserve.parallel import TensorParallelError
path, device, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
llm = LLM(path, tensor_parallel_size=2, device=device, dtype="float32", max_num_seqs=8, num_pages=256,
          enforce_eager=eager, cpu_threads=1 if device == "cpu" else None)
eng = llm.engine
worker = eng.parallel.launcher.procs[1]
eng.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
steps = 0
try:
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 3:
            g = eng.runner.graphs
            print(json.dumps({"killed_at": time.time(), "replays_before_kill": g.replays if g else 0}), flush=True)
            os.kill(worker.pid, signal.SIGKILL)
    print(json.dumps({"ended": "finished", "at": time.time()}), flush=True)
except TensorParallelError as e:
    print(json.dumps({"ended": "error", "at": time.time(), "message": str(e)}), flush=True)
"""


def _run(path: str, device: str, tp: int, prompts: list[list[int]], n_tokens: int, eager: bool,
         replays: list[int] | None = None) -> list[Any]:
    """Greedy completions with their top-5 logprobs from ``LLM(path, tensor_parallel_size=tp)``;
    the engine (and its workers) are shut down before returning. ``replays`` gets the
    driver's CUDA graph replays."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=tp, device=device, dtype="float32", max_num_seqs=8,
              num_pages=256, enforce_eager=eager, cpu_threads=1 if device == "cpu" else None)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True,
                                                    logprobs=TOP_LOGPROBS))
        if replays is not None:
            g = llm.engine.runner.graphs
            replays.append(g.replays if g else 0)
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
            replays: list[int] = []
            two = _run(path, device, 2, prompts, n_tokens, eager, replays)
            rec = {
                "greedy_equal": [o.token_ids for o in two] == [o.token_ids for o in one],
                "max_rel_logprob_err": _logprob_error(two, one),
                "tokens": n_tokens, "prompts": len(prompts),
                "graph_replays": replays[0],
            }
            rec["logprobs_ok"] = rec["max_rel_logprob_err"] <= FP32_LOGIT_TOL
            res[f"{name} {mode}"] = rec
            log("tp", name, mode, rec)
    return res


def _kill_worker(ctx: Ctx, device: str, eager: bool) -> dict[str, Any]:
    """TP=2 (graphs mode unless ``eager``) in a child process whose worker is killed
    mid-generation: seconds from the kill to the step's TensorParallelError or the
    process's exit."""
    from hybridserve.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(ctx.tmp / "tp-kill", seed=11, **CONFIGS["dense-kv1"])
    env = dict(os.environ, HYBRIDSERVE_TP_TIMEOUT=str(KILL_STEP_TIMEOUT_S))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path), device, "1" if eager else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rec: dict[str, Any] = {"deadline_s": KILL_DEADLINE_S}
    try:
        first = proc.stdout.readline()
        if not first:
            proc.wait(timeout=60)
            rec.update(failed_before_kill=True, exit_code=proc.returncode, stderr=proc.stderr.read()[-2000:])
            return rec
        killed = json.loads(first)
        rec["replays_before_kill"] = killed["replays_before_kill"]
        try:
            proc.wait(timeout=KILL_DEADLINE_S + 30)
        except subprocess.TimeoutExpired:
            rec.update(ended="hung", seconds=None)
            return rec
        ended_at = time.time()
        tail = [json.loads(x) for x in proc.stdout.read().splitlines() if x.strip().startswith("{")]
        rec["exit_code"] = proc.returncode
        if tail and tail[-1].get("ended") == "error":
            rec.update(ended="error", seconds=tail[-1]["at"] - killed["killed_at"], message=tail[-1]["message"])
        elif tail and tail[-1].get("ended") == "finished":
            rec.update(ended="finished", seconds=None)  # generation went on without its worker: a failure
        else:
            rec.update(ended=f"exit {proc.returncode}", seconds=ended_at - killed["killed_at"],
                       stderr=proc.stderr.read()[-1000:])
        rec["ok"] = rec["ended"] != "finished" and rec["seconds"] is not None and rec["seconds"] <= KILL_DEADLINE_S
        return rec
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        free_memory()


def check_tp(ctx: Ctx) -> dict[str, Any]:
    """Issue 19's GPU path: ``LLM(model, tensor_parallel_size=2)`` on two GPUs (NCCL)
    against the same engine on one GPU, tiny float32 checkpoints (dense with 1 KV head
    over 2 ranks and 3 value heads per key head; MoE with a shared expert): greedy
    tokens identical and every generated position's top-5 logprobs within
    ``FP32_LOGIT_TOL`` (relative), eager and with CUDA graphs (which capture the
    all-reduces), the graphs mode having replayed graphs on the driver; and a worker
    killed mid-generation in graphs mode (NCCL's watchdog does not see replayed
    collectives) fails the step or ends the process within ``KILL_DEADLINE_S``. With
    fewer than two GPUs every criterion is "not applicable"; the CPU dry run still
    runs the comparison and the kill over gloo on the CPU (the check's code path, so
    it cannot rot), reported under ``cpu_gloo`` / ``cpu_gloo_kill`` and not counted
    as a pass."""
    import torch

    gpus = torch.cuda.device_count() if ctx.cuda else 0
    out: dict[str, Any] = {"cuda_devices": gpus, "configs": CONFIGS, "tol": FP32_LOGIT_TOL}
    names = list(CONFIGS)
    kill: dict[str, Any] | None = None
    if ctx.cuda and gpus >= 2:
        res = _compare(ctx, "cuda", names, 4 if ctx.small else 24, [True, False])
        out["cuda"] = res
        kill = out["cuda_kill"] = _kill_worker(ctx, "cuda", eager=False)
        log("tp kill", kill)
    else:
        why = (f"needs 2 CUDA devices, this machine has {gpus}" if ctx.cuda
               else "CPU dry run: NCCL on two GPUs cannot be checked here")
        out["not_applicable"] = why
        if not ctx.cuda:
            out["cpu_gloo"] = _compare(ctx, "cpu", names, 3, [True])
            out["cpu_gloo_kill"] = _kill_worker(ctx, "cpu", eager=True)
        res = {f"{n} {m}": None for n in names for m in ("eager", "graphs")}
    crit = []
    for key, rec in res.items():
        crit += [
            criterion(f"{key}: TP=2 greedy tokens equal one GPU's", None if rec is None else rec["greedy_equal"]),
            criterion(f"{key}: TP=2 logprobs within {FP32_LOGIT_TOL:g} of one GPU's",
                      None if rec is None else rec["logprobs_ok"],
                      **({} if rec is None else {"err": rec["max_rel_logprob_err"]})),
        ]
        if key.endswith("graphs"):
            crit.append(criterion(f"{key}: TP=2 replayed CUDA graphs", None if rec is None else rec["graph_replays"] > 0,
                                  **({} if rec is None else {"replays": rec["graph_replays"]})))
    crit.append(criterion(f"graphs mode: a worker killed mid-generation fails the step or ends the process "
                          f"within {KILL_DEADLINE_S}s",
                          None if kill is None else bool(kill.get("ok")) and kill.get("replays_before_kill", 0) > 0,
                          **({} if kill is None else {"seconds": kill.get("seconds"), "ended": kill.get("ended")})))
    out["criteria"] = crit
    return out
