"""Prefix caching on the hybrid model, on the CPU: issue 8's workloads, caching on vs off.

1. Shared system prompt: two warm-up requests with the system prompt, then 32
   requests (system prompt + a 64-token user part each) arriving together. Time to
   first token p50/p90 of the 32 and the prefill tokens the model computed for them.
2. Two-turn chat: 8 conversations; their first turns run together, then their
   second turns (first prompt + first answer + 64 new tokens) arrive together.
   Time to first token of the second turns.

One process, both settings side by side (``--repeat R``: R alternating rounds, the
summary line takes medians over them: on a shared machine single steps can stall),
on the embedded ~10M-parameter ``bench`` model (float32), with a fixed torch thread
count (printed). Prompts are seeded
random token ids; greedy, EOS ignored. The greedy outputs of the two settings are
compared (they must be identical).

    python benches/prefix_cache.py                      # the issue's sizes
    python benches/prefix_cache.py --system-len 512     # smaller, faster
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import numpy as np
import torch

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.sampling import SamplingParams


def make_engine(model: str, caching: bool, threads: int, num_blocks: int, slots: int) -> LLMEngine:
    """An engine whose one arena holds ``num_blocks`` KV blocks and ``slots`` DeltaNet
    states (sequences' and checkpoints')."""
    from hybridserve.config import ModelConfig
    from hybridserve.memory.layout import arena_layout

    state = arena_layout(ModelConfig.from_json(model), 16, "float32").state_pages
    return LLMEngine(EngineArgs(
        model=model, dtype="float32", device="cpu", block_size=16, max_num_seqs=64,
        max_num_batched_tokens=2048, num_pages=num_blocks + slots * state,
        enable_prefix_caching=caching, cpu_threads=threads,
    ))


class PrefillCounter:
    """Counts the prompt tokens the model is fed (prefill entries of each plan)."""

    def __init__(self, engine: LLMEngine):
        self.tokens = 0
        inner = engine.runner.execute

        def execute(plan):
            n = np.asarray(plan.num_scheduled_tokens)[plan.num_decodes:]
            self.tokens += int(n.sum())
            return inner(plan)

        engine.runner.execute = execute


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Adds all prompts at once, steps to the end; per-request TTFT (s) and outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    ttft: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            m = o.metrics
            if o.request_id not in ttft and m is not None and m.first_token_time is not None:
                ttft[o.request_id] = m.first_token_time - m.arrival_time
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return [ttft[i] for i in ids], [outs[i] for i in ids]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def shared_prompt(model: str, caching: bool, a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    system = [rng.randrange(3, 250) for _ in range(a.system_len)]
    users = [[rng.randrange(3, 250) for _ in range(a.user_len)] for _ in range(a.requests + 2)]
    ctx = a.system_len + a.user_len + a.max_tokens
    engine = make_engine(model, caching, a.threads, (a.requests + 4) * (ctx // 16 + 2), a.requests + 8)
    counter = PrefillCounter(engine)
    for u in users[:2]:  # warm-up: one after the other
        run_batch(engine, [system + u], a.max_tokens)
    counter.tokens = 0
    t0 = time.perf_counter()
    ttft, outs = run_batch(engine, [system + u for u in users[2:]], a.max_tokens)
    wall = time.perf_counter() - t0
    st = engine.stats()
    return {
        "workload": "shared_system_prompt", "prefix_caching": caching, "requests": a.requests,
        "system_len": a.system_len, "user_len": a.user_len,
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "prefill_tokens": counter.tokens,
        "wall_s": wall, "checkpoint_hits": st["checkpoint_hits"],
        "prefix_skipped_tokens": st["prefix_skipped_tokens"], "prefix_lost_tokens": st["prefix_lost_tokens"],
        "outputs": outs,
    }


def two_turn(model: str, caching: bool, a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed + 1)
    firsts = [[rng.randrange(3, 250) for _ in range(a.turn1_len)] for _ in range(a.chats)]
    ctx = a.turn1_len + a.turn1_answer + a.user_len + a.max_tokens
    engine = make_engine(model, caching, a.threads, 2 * a.chats * (ctx // 16 + 2), 2 * a.chats + 4)
    counter = PrefillCounter(engine)
    ttft1, answers = run_batch(engine, firsts, a.turn1_answer)
    seconds = [f + ans + [rng.randrange(3, 250) for _ in range(a.user_len)] for f, ans in zip(firsts, answers)]
    counter.tokens = 0
    ttft2, outs = run_batch(engine, seconds, a.max_tokens)
    return {
        "workload": "two_turn_chat", "prefix_caching": caching, "chats": a.chats, "turn1_len": a.turn1_len,
        "turn1_ttft_p50_s": pct(ttft1, 50),
        "turn2_ttft_p50_s": pct(ttft2, 50), "turn2_ttft_p90_s": pct(ttft2, 90),
        "turn2_prefill_tokens": counter.tokens, "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turn1-len", type=int, default=1024)
    ap.add_argument("--turn1-answer", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", choices=["shared", "chat"], default=None)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="hs-bench-"), preset="bench", seed=0)
    torch.set_num_threads(a.threads)
    print(f"# torch threads: {torch.get_num_threads()}  (bench model, float32, block 16)", flush=True)
    results = []
    for name, fn in (("shared", shared_prompt), ("chat", two_turn)):
        if a.skip == name:
            continue
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(a.repeat):
            for caching in (False, True):
                r = fn(model, caching, a)
                runs[caching].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
        same = all(x["outputs"] == runs[False][0]["outputs"] for x in runs[False] + runs[True])
        pair = {c: {k: (float(np.median([x[k] for x in rs])) if isinstance(rs[0][k], float) else rs[0][k])
                    for k in rs[0]} for c, rs in runs.items()}
        if name == "shared":
            off, on = pair[False], pair[True]
            line = (f"shared system prompt: TTFT p50 {off['ttft_p50_s']:.3f}s -> {on['ttft_p50_s']:.3f}s "
                    f"({off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x), p90 {off['ttft_p90_s']:.3f}s -> "
                    f"{on['ttft_p90_s']:.3f}s ({off['ttft_p90_s'] / on['ttft_p90_s']:.1f}x), prefill tokens "
                    f"{off['prefill_tokens']} -> {on['prefill_tokens']} "
                    f"({off['prefill_tokens'] / max(on['prefill_tokens'], 1):.1f}x fewer)")
        else:
            off, on = pair[False], pair[True]
            line = (f"two-turn chat: second-turn TTFT p50 {off['turn2_ttft_p50_s']:.3f}s -> "
                    f"{on['turn2_ttft_p50_s']:.3f}s ({off['turn2_ttft_p50_s'] / on['turn2_ttft_p50_s']:.1f}x), "
                    f"p90 {off['turn2_ttft_p90_s']:.3f}s -> {on['turn2_ttft_p90_s']:.3f}s, prefill tokens "
                    f"{off['turn2_prefill_tokens']} -> {on['turn2_prefill_tokens']}")
        print(f"# {line}; greedy outputs identical: {same}", flush=True)
        results.append(same)
    if not all(results):
        raise SystemExit("greedy outputs differ between prefix caching on and off")


if __name__ == "__main__":
    main()
