"""End-to-end offline throughput and where each step's time goes.

Runs ``LLM.generate`` on a tiny checkpoint (default: the ~10M-parameter ``bench``
preset, written to a temporary folder) with N concurrent requests and prints one
JSON object per configuration: tokens per second, steps, and the share of wall time
spent in the Rust scheduler (``schedule()`` + ``update()``), in the model runner and
in the sampler. The scheduler share is the number the Rust core exists to keep small.

    python benches/engine_throughput.py --requests 8,32 --prompt-len 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from hybridserve import LLM, SamplingParams
from hybridserve.model.tiny import write_tiny_checkpoint


class Timed:
    """Wraps a callable and accumulates its wall time."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class TimedScheduler:
    def __init__(self, inner):
        self._inner = inner
        self.schedule = Timed(inner.schedule)
        self.update = Timed(inner.update)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run(model_dir: str, n: int, prompt_len: int, max_tokens: int, device: str) -> dict:
    llm = LLM(model_dir, dtype="float32" if device == "cpu" else "auto", device=device,
              max_num_seqs=max(n, 1), max_num_batched_tokens=max(2048, n),
              num_gpu_blocks=n * (-(-(prompt_len + max_tokens) // 16)) + 16, num_state_slots=n)
    engine = llm.engine
    engine.scheduler = TimedScheduler(engine.scheduler)
    engine.runner.execute = Timed(engine.runner.execute)
    engine.sampler = Timed(engine.sampler)
    prompts = [[(i * 31 + j * 7) % 250 + 3 for j in range(prompt_len)] for i in range(n)]
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    sched = engine.scheduler.schedule.seconds + engine.scheduler.update.seconds
    return {
        "requests": n,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "device": device,
        "wall_s": round(wall, 4),
        "generated_tokens": generated,
        "output_tokens_per_s": round(generated / wall, 1),
        "steps": engine.scheduler.schedule.calls,
        "scheduler_share": round(sched / wall, 5),
        "scheduler_us_per_step": round(1e6 * sched / max(engine.scheduler.schedule.calls, 1), 2),
        "runner_share": round(engine.runner.execute.seconds / wall, 4),
        "sampler_share": round(engine.sampler.seconds / wall, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: tiny 'bench' preset)")
    ap.add_argument("--requests", default="8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_checkpoint(f"{tmp}/bench", preset="bench", seed=0)
        for n in (int(x) for x in args.requests.split(",")):
            print(json.dumps(run(model, n, args.prompt_len, args.max_tokens, args.device)), flush=True)


if __name__ == "__main__":
    main()
