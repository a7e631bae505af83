"""Beam search inside the engine vs W independent copies, on the CPU.

Workload: 16 prompts (seeded random ids, 64 tokens), 32 new tokens, EOS ignored.

A. beam search, W = 4: 16 beam requests (64 beams), one request per prompt; the
   beams of a prompt share its blocks and fork DeltaNet state every step.
B. 16 x 4 independent greedy requests: each prompt 4 times, nothing shared.

Prefix caching is off in both, so B's copies do not share through the cache and
A's sharing is the forks' alone. Reported: KV blocks in use (peak and mean over
steps) and the sharing ratio A / B; median step time of the steps where all 64
sequences decode, A / B (the extra work of beams: log-softmax of 64 rows, top-k,
re-parenting tables and state copies). One process; the two runs are stepped
alternately (one step of A, one step of B) so that load from other jobs hits both
alike; the
embedded ~10M-parameter ``bench`` model (float32), a fixed torch thread count
(printed).

    python benches/beam_search.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from hybridserve.beam_search import BeamSearchParams
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.sampling import SamplingParams


def make_engine(model: str, threads: int) -> LLMEngine:
    return LLMEngine(EngineArgs(
        model=model, dtype="float32", device="cpu", block_size=16, max_num_seqs=64,
        # 512 KV blocks + 64 DeltaNet states of 8 pages (the bench preset at 16-token blocks).
        max_num_batched_tokens=4096, num_pages=512 + 64 * 8,
        enable_prefix_caching=False, cpu_threads=threads,
    ))


class Run:
    def __init__(self, engine: LLMEngine, add, seqs: int) -> None:
        self.engine, self.seqs = engine, seqs
        add(engine)
        self.used: list[int] = []
        self.times: list[float] = []
        self.decode_times: list[float] = []

    def step(self) -> None:
        e = self.engine
        if not e.has_unfinished_requests():
            return
        t0 = time.perf_counter()
        e.step()
        dt = time.perf_counter() - t0
        self.used.append(e.stats()["used_blocks"])
        self.times.append(dt)
        if e.last_step_stats["num_batched_tokens"] == self.seqs:  # every sequence decoding
            self.decode_times.append(dt)

    def summary(self) -> dict:
        st = self.engine.stats()
        return {"steps": len(self.times), "peak_blocks": max(self.used), "mean_blocks": statistics.mean(self.used),
                "median_decode_step_s": statistics.median(self.decode_times),
                "decode_steps": len(self.decode_times), "cow_copies": st["cow_copies"],
                "state_fork_copies": st["state_fork_copies"], "shared_blocks_end": st["shared_blocks"],
                "total_s": sum(self.times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        model = str(write_tiny_checkpoint(d + "/m", preset="bench", seed=0))
        prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        beam = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

        def add_beams(e):
            for i, p in enumerate(prompts):
                e.add_beam_request(f"b{i}", p, beam)

        def add_copies(e):
            for i, p in enumerate(prompts):
                for j in range(args.width):
                    e.add_request(f"g{i}-{j}", p, greedy)

        seqs = args.prompts * args.width
        ra = Run(make_engine(model, args.threads), add_beams, seqs)
        rb = Run(make_engine(model, args.threads), add_copies, seqs)
        while ra.engine.has_unfinished_requests() or rb.engine.has_unfinished_requests():
            ra.step()
            rb.step()
        a, b = ra.summary(), rb.summary()
    print(f"torch threads: {torch.get_num_threads()}")
    print(json.dumps({"beam_search": a, "independent_greedy": b}, indent=1))
    print(f"| | beam search W={args.width} | {args.prompts}x{args.width} independent greedy | ratio |")
    print("|---|---|---|---|")
    print(f"| peak KV blocks in use | {a['peak_blocks']} | {b['peak_blocks']} | "
          f"{a['peak_blocks'] / b['peak_blocks']:.2f} |")
    print(f"| mean KV blocks in use | {a['mean_blocks']:.1f} | {b['mean_blocks']:.1f} | "
          f"{a['mean_blocks'] / b['mean_blocks']:.2f} |")
    print(f"| median step, all {args.prompts * args.width} decoding (ms) | {a['median_decode_step_s'] * 1e3:.1f} | "
          f"{b['median_decode_step_s'] * 1e3:.1f} | {a['median_decode_step_s'] / b['median_decode_step_s']:.2f} |")


if __name__ == "__main__":
    main()
