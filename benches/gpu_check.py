#!/usr/bin/env python
"""The prepared device run: every GPU claim of hybridserve checked in one script.

    python benches/gpu_check.py                 # all checks, one CUDA device (< 6 min on an H200)
    python benches/gpu_check.py --quick         # the ~2-minute subset (no 27B seed scenario)
    python benches/gpu_check.py --device cpu --small   # dry run of every code path on the CPU
    python benches/gpu_check.py --only seed,sync       # some checks

One JSON line per check on stdout (human-readable progress goes to stderr); the exit
status is 1 when any check fails. Checks:

* ``kernels``: the Triton kernels against their plain-PyTorch references
  (:mod:`hybridserve.kernels.cuda_check`; timings exclude state-pool copies).
* ``gpu_tests``: the GPU-only pytest files in ``tests_gpu/`` (not collected by CI);
  on the device no test may be skipped.
* ``fidelity``: the model against HF ``Qwen3_5ForCausalLM`` on tiny checkpoints:
  float32 logits within 1e-4 (relative to the logits' scale), bfloat16 logits within
  ``BF16_LOGIT_TOL`` of HF's bfloat16 run, and the first 32 greedy tokens equal to
  HF's greedy tokens in the same dtype, through the engine with and without CUDA
  graphs (the two must produce identical tokens).
* ``sync``: decode steps (a beam request among sampled ones) under
  ``torch.cuda.set_sync_debug_mode("warn")``; every synchronising call must be the
  sampler's one device->host transfer of the tokens or the beam search's one transfer
  of all beam requests' candidates, at most one of each per step.
* ``e2e``: the engine on a ~1B-parameter random checkpoint (weights made on the
  device): throughput at 1/16/64/256 concurrent requests, TTFT and inter-token
  latency p50/p99, with and without CUDA graphs; fails unless CUDA graphs and eager
  give identical greedy tokens at every level and the graphs were replayed.
* ``pools``: on CUDA the engine sizes both pools from the free memory it measures
  after loading weights; with a utilization chosen to leave room for about 12
  sessions, the planner's prediction from the engine's own plan must be what live
  admission runs (prefill replaced as in ``seed``).
* ``seed``: the seed's comparison live on the 27B shape (random bfloat16 weights made
  on the device, no disk): a 23,859 MiB pool, 32,768-token sessions; paged admission
  must run 10 at once and ``reserve_max`` 1; decode step times at those batch sizes
  next to the memory-bandwidth floor; fails if the decode step at the paged batch size
  is slower than 2x that floor. Prefill is replaced by writing random K/V and
  DeltaNet state for the context (said in the output).
* ``tp``: ``LLM(model, tensor_parallel_size=2)`` on two GPUs (NCCL) against one GPU
  on tiny float32 checkpoints (dense with 1 KV head over 2 ranks, MoE): greedy tokens
  identical and top-5 logprobs within ``FP32_LOGIT_TOL``, eager and with CUDA graphs.
  "Not applicable" with fewer than two GPUs; the CPU dry run runs the comparison over
  gloo instead (reported, not counted).
* ``quant``: the Triton FP8 block-scaled and int4 GEMMs against the plain-PyTorch
  reference (timed beside torch's bfloat16 GEMM), and tiny FP8 and AWQ checkpoints
  served with their projections kept quantized against HF on the dequantized weights
  (float32 logits, greedy tokens eager and with CUDA graphs).
* ``spec``: speculative decoding with the MTP drafter (k = 3) on the trained default
  model and a random-weight tiny checkpoint, at batch 4 and 1: greedy tokens identical
  with speculation on and off, eager and with CUDA graphs, the verify steps
  replayed the verify graphs, and every step made one staging copy that carried the
  verify graphs' slot layout; wall times on and off reported.

Every check states its pass criteria (``criteria``: name, status, what was compared)
and its ``status`` follows from them: ``"fail"`` if any criterion failed, ``"pass"`` if
at least one was checked and none failed, ``"not applicable"`` if none could be
checked on this device. ``ok`` is true only for ``"pass"``; the run's exit status is 1
when any check failed (not-applicable checks are listed in the summary, never counted
as passed).

``--device cpu --small`` runs every check's code path at toy sizes (Triton kernels
under ``TRITON_INTERPRET=1``); criteria that only a CUDA device can decide (graphs vs
eager, the sync debug mode, the bandwidth floor, GPU-only tests) are "not applicable"
there, and a check made only of those is "not applicable" as a whole.
tests/test_gpu_check_dry_run.py runs it in CI so the script cannot rot.

Other checks register with :func:`register` (``@register("name", quick=True)``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpu_checks package beside this file

from gpu_checks.common import verdict, Ctx, PASS, FAIL, NA  # noqa: E402
from gpu_checks.kernels import check_kernels, check_gpu_tests  # noqa: E402
from gpu_checks.fidelity import check_fidelity  # noqa: E402
from gpu_checks.sync import check_sync  # noqa: E402
from gpu_checks.e2e import check_e2e  # noqa: E402
from gpu_checks.seed import check_seed  # noqa: E402
from gpu_checks.pools import check_pools  # noqa: E402
from gpu_checks.moe import check_moe  # noqa: E402
from gpu_checks.tp import check_tp  # noqa: E402
from gpu_checks.quant import check_quant  # noqa: E402
from gpu_checks.spec import check_spec  # noqa: E402

CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {}
QUICK: list[str] = []


def register(name: str, fn: Callable[[Ctx], dict[str, Any]] | None = None, *, quick: bool = True):
    """Adds a check (run in order of registration; ``quick``: also in ``--quick``). A
    check returns a dict with ``criteria`` (see :func:`criterion`) and any details.
    Usable as ``register("name", fn)`` or as a decorator ``@register("name")``."""
    def add(f: Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], dict[str, Any]]:
        if name in CHECKS:
            raise ValueError(f"check {name!r} is registered twice")
        CHECKS[name] = f
        if quick:
            QUICK.append(name)
        return f

    return add(fn) if fn is not None else add


register("kernels", check_kernels)
register("gpu_tests", check_gpu_tests)
register("fidelity", check_fidelity)
register("sync", check_sync)
register("seed", check_seed, quick=False)
register("e2e", check_e2e)
register("pools", check_pools)
register("moe", check_moe)
register("tp", check_tp)
register("quant", check_quant)
register("spec", check_spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--quick", action="store_true", help="the ~2-minute subset")
    p.add_argument("--only", default=None, help="comma-separated checks: " + ",".join(CHECKS))
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="checks not started within this many seconds are reported as not run (failed), "
                        "so a device session never runs out of time mid-check (default: %(default)s)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"check": "device", "ok": False, "error": "no CUDA device; use --device cpu --small"}))
        return 1
    ctx = Ctx(args)
    names = args.only.split(",") if args.only else (QUICK if args.quick else list(CHECKS))
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    info = {"check": "device", "ok": True, "device": str(ctx.device), "torch": torch.__version__,
            "small": args.small, "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if ctx.cuda:
        info["name"] = torch.cuda.get_device_name(ctx.device)
        info["memory_gib"] = round(torch.cuda.get_device_properties(ctx.device).total_memory / 2**30, 1)
    print(json.dumps(info), flush=True)
    failed, not_applicable = [], []
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        if t0 - t_all > args.budget_s:
            print(json.dumps({"check": name, "status": FAIL, "ok": False,
                              "error": f"not run: the {args.budget_s:.0f} s budget "
                              "was spent by the checks before it (rerun with --only)"}), flush=True)
            failed.append(name)
            continue
        try:
            rec = CHECKS[name](ctx)
            status = verdict(rec.get("criteria", []))
        except Exception as e:  # a crashing check is a failed check, reported as such
            rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            status = FAIL
        rec = {"check": name, "status": status, "ok": status == PASS, **rec,
               "seconds": round(time.perf_counter() - t0, 2)}
        print(json.dumps(rec, default=str), flush=True)
        if status == FAIL:
            failed.append(name)
        elif status == NA:
            not_applicable.append(name)
    # Passed means every check passed or could not be decided here (listed, never counted as passed).
    print(json.dumps({"check": "summary", "status": FAIL if failed else PASS, "ok": not failed, "failed": failed,
                      "not_applicable": not_applicable, "seconds": round(time.perf_counter() - t_all, 1)}),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
