"""The CPU sampler's two paths side by side in one process: the torch chain
(``Sampler()``) against the native kernel with the engine's steady-batch route
(``Sampler(native=True, steady_rows=True)``), at the host_overhead bench's shape and
at a real vocabulary.

Each case steps keyed rows whose outputs grow by their drawn token every step, as a
decode batch does (the same row list every step, which is what the engine passes for
a steady batch). Every step runs ``Sampler.plan`` + ``Sampler.sample_planned`` (what
the engine calls) on both sides with the same logits, alternating which goes first;
both must draw the same tokens (asserted: every row is seeded or greedy). The cost is
the median over the steps of the thread's CPU time (``cpu``) and of the wall time
(``wall``), in microseconds per row. ``--evict-mb`` writes that many MiB between steps
(a long forward's traffic evicts the caches the host work reads); the host_overhead
bench's growth with context came from such misses.

torch runs on one thread (the engine's host work does), printed with the load average.

    python benches/sampler_native.py
    python benches/sampler_native.py --evict-mb 64 --steps 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from hybridserve.sampler import Sampler, SamplingRow, make_generator
from hybridserve.sampling import SamplingParams

MODES = {
    "greedy": dict(temperature=0.0),
    "seeded top-p/top-k + penalties": dict(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.3,
                                            frequency_penalty=0.2, repetition_penalty=1.1),
}


def side(sampler: Sampler, n: int, vocab: int, params: SamplingParams):
    prompts = [list(np.random.default_rng(i).integers(0, vocab, 100)) for i in range(n)]
    outs = [[] for _ in range(n)]
    rows = [SamplingRow(params=params, prompt_token_ids=prompts[i], output_token_ids=outs[i],
                        generator=make_generator(params.seed, 0) if params.seed is not None else None,
                        key=("r", i)) for i in range(n)]
    return sampler, rows, outs


def run_case(n: int, vocab: int, mode: str, steps: int, evict_mb: int) -> dict:
    params = SamplingParams(seed=1 if mode != "greedy" else None, **MODES[mode])
    sides = {"torch": side(Sampler(), n, vocab, params),
             "native": side(Sampler(native=True, steady_rows=True), n, vocab, params)}
    times = {name: ([], []) for name in sides}
    g = torch.Generator().manual_seed(0)
    junk = np.zeros(evict_mb << 18, dtype=np.float32) if evict_mb else None
    device = torch.device("cpu")
    for step in range(steps + 2):
        logits = torch.randn(n, vocab, generator=g) * 3
        order = ("torch", "native") if step % 2 == 0 else ("native", "torch")
        tokens = {}
        for name in order:
            if junk is not None:
                junk += 1.0  # evict: a long forward's memory traffic
            sampler, rows, outs = sides[name]
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            prep = sampler.plan(rows, vocab, device)
            out = sampler.sample_planned(logits, prep).token_ids
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            for o, tok in zip(outs, out):
                o.append(tok)
            tokens[name] = out
            if step >= 2:  # the first steps build the tables and the steady plan
                times[name][0].append((c1 - c0) / 1e3 / n)
                times[name][1].append((w1 - w0) / 1e3 / n)
        assert tokens["torch"] == tokens["native"], (n, vocab, mode, step)
    return {name: (statistics.median(c), statistics.median(w)) for name, (c, w) in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--evict-mb", type=int, default=0)
    ap.add_argument("--cases", default="256x272,16x151936,64x151936",
                    help="comma-separated ROWSxVOCAB")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}, evict {args.evict_mb} MiB, "
          f"{args.steps} steps; us per row (median): cpu / wall")
    print(f"{'rows x vocab':>14}  {'mode':<32} {'torch cpu':>10} {'native cpu':>10} {'ratio':>6}   "
          f"{'torch wall':>10} {'native wall':>11}")
    for case in args.cases.split(","):
        n, vocab = (int(v) for v in case.split("x"))
        for mode in MODES:
            steps = args.steps if vocab < 10000 else max(6, args.steps // 3)
            r = run_case(n, vocab, mode, steps, args.evict_mb)
            (tc, tw), (nc, nw) = r["torch"], r["native"]
            print(f"{case:>14}  {mode:<32} {tc:10.2f} {nc:10.2f} {tc / nc:5.1f}x   {tw:10.2f} {nw:11.2f}",
                  flush=True)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
