"""Scheduler step latency through the PyO3 API: what the engine pays per step.

Same workload as the Rust bench (benches/scheduler.rs): N decoding sequences with
distinct 1024-token prompts, block size 16, prefix caching on, a pool large
enough that nothing is preempted; one `schedule()` + `update(sampled)` per step,
reading the plan fields the engine reads. `churn`: every request lives 100 steps
(1%/step finish) and as many new 1024-token requests arrive each step (their
add_request is inside the timed step). Prints one JSON object per line.

    python benches/scheduler_py.py --ns 64,256,1024 --steps 200

Target (issue 3): <= 1 us per sequence per step at N = 1024 steady.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hybridserve._core import Scheduler

LIFE = 100
PROMPT = 1024


class Workload:
    def __init__(self, n: int, churn: bool, steps: int):
        growth = LIFE if churn else steps + 64
        per_seq = -(-(PROMPT + growth) // 16) + 2
        blocks = n * per_seq * (2 if churn else 1) + 1024
        # One arena: the blocks plus a one-page DeltaNet state per sequence.
        self.s = Scheduler(blocks + n + 8, 16, 1, n, n + 16384, PROMPT + growth + 16,
                           enable_prefix_caching=True, max_finished_retained=1024)
        self.churn = churn
        self.next = 0
        for i in range(n):
            self.add(2 + i % LIFE if churn else growth)
        prefill_steps = -(-n * PROMPT // 16384) + 5
        for k in range(10**6):
            out = self.s.schedule()
            all_decode = out.num_decodes == len(out.request_ids) == n
            self._update(out)
            if (not churn and all_decode) or (churn and k >= prefill_steps):
                break

    def add(self, max_tokens: int) -> None:
        r = self.next
        self.next += 1
        base = (r * 7919) % 150_000
        prompt = (np.arange(PROMPT, dtype=np.int64) + base) % 150_000 + 10
        self.s.add_request(f"req-{r}", prompt.astype(np.int32), max_tokens=max_tokens)

    def _update(self, out) -> int:
        sampled = np.ones(int(out.num_samples.sum()), dtype=np.int32)
        upd = self.s.update(sampled)
        return len(upd.finished_request_ids)

    def step(self) -> None:
        out = self.s.schedule()
        # What the runner reads each step (attribute access is part of the cost).
        _ = (out.input_ids, out.positions, out.slot_mapping, out.query_start_loc, out.seq_lens,
             out.state_table_update_values, out.checkpoint_positions, out.block_table_rows, out.block_table_update_rows,
             out.block_table_update_cols, out.block_table_update_values, out.block_copies, out.state_copies)
        finished = self._update(out)
        if self.churn:
            for _ in range(finished):
                self.add(LIFE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="steady,churn")
    args = ap.parse_args()
    for variant in args.variants.split(","):
        for n in (int(x) for x in args.ns.split(",")):
            w = Workload(n, variant == "churn", args.steps)
            for _ in range(10):  # warm-up
                w.step()
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter_ns()
                w.step()
                ts.append((time.perf_counter_ns() - t0) / 1000.0)
            med = statistics.median(ts)
            print(json.dumps({
                "variant": variant, "N": n, "steps": args.steps,
                "median_us": round(med, 2), "p90_us": round(float(np.percentile(ts, 90)), 2),
                "mean_us": round(statistics.fmean(ts), 2), "median_us_per_seq": round(med / n, 4),
            }), flush=True)


if __name__ == "__main__":
    main()
