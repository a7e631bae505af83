"""Tensor parallelism on the CPU: 2 ranks x 1 thread against 1 process x 2 threads
(and, for scale, the same process on 1 thread).

Both engines load the same checkpoint (the ``bench`` preset by default, ~10M
parameters; ``--preset moe-bench`` for the MoE one) and are alive at once; rounds
alternate between them (A, B, A, B, ...) on the same greedy workload, and the
medians are reported: generated tokens per second, and for the TP engine, per step,
the driver's time inside collectives and the bytes they move:

* ``plan``: the step's plan broadcast (header + payload, host tensors, gloo);
* ``embedding`` / ``mixer`` / ``mlp``: the all-reduces of the forward (hidden-size
  rows, one per mixer and one per MLP/MoE block);
* ``gather_logits``: the LM head's vocabulary shards gathered on the driver.

The collective times are wall time on the driver, so they include waiting for the
other rank to reach the same collective (its compute skew), not only the transport:
on this 2-core machine shared with other work that is most of it. Both tokens must be
identical across the two engines (checked).

``--comm-only`` measures the other half of the issue's question, the per-step cost of
the extra process *excluding the model's arithmetic*: two gloo processes (1 thread
each) run exactly one step's communication back to back, with nothing between the
collectives to wait for: the plan's two broadcasts, the embedding's and the
2 x layers all-reduces of ``[tokens, hidden]`` float32, and the gather of the sampled
rows' ``[rows, vocab / 2]`` logits, at decode (8 tokens) and prefill (512, 2048
tokens) sizes.

    python benches/tp.py --rounds 5
    python benches/tp.py --comm-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch


def _workload(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (prompt_len,), generator=g).tolist() for _ in range(n)]


def _round(llm, prompts, max_tokens: int) -> tuple[float, int, list[list[int]], int]:
    from hybridserve import SamplingParams

    steps0 = llm.engine.step_count
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return dt, sum(len(t) for t in toks), toks, llm.engine.step_count - steps0


def _comm_rank(rank: int, port: int, shapes, reps: int, out) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name, (tokens, hidden, layers, rows, vocab, plan_len) in shapes.items():
        x = torch.randn(tokens, hidden)
        logits = torch.randn(rows, vocab // 2)
        header, plan = torch.zeros(20, dtype=torch.int64), torch.zeros(plan_len, dtype=torch.int64)
        times = []
        for i in range(reps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(header, 0)
            dist.broadcast(plan, 0)
            for _ in range(1 + 2 * layers):
                dist.all_reduce(x)
            parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
            dist.gather(logits, parts, dst=0)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        nbytes = (header.numel() + plan.numel()) * 8 + (1 + 2 * layers) * x.numel() * 4 + logits.numel() * 4
        results[name] = (statistics.median(times), nbytes, 2 + 1 + 2 * layers + 1)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def comm_only(reps: int) -> None:
    """One step's communication alone, between two gloo processes (see the docstring)."""
    import torch.multiprocessing as mp

    from hybridserve.model.tiny import PRESETS, _BASE
    from hybridserve.parallel.launcher import free_port

    c = PRESETS["bench"]
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], _BASE["vocab_size"]
    # name -> tokens, hidden, layers, sampled rows, vocab, plan payload (int64s: ~12 per token + per seq)
    shapes = {"decode, 8 seqs": (8, h, layers, 8, vocab, 8 * 14),
              "prefill 512 tokens": (512, h, layers, 1, vocab, 512 * 4 + 20),
              "prefill 2048 tokens": (2048, h, layers, 1, vocab, 2048 * 4 + 20)}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_comm_rank, args=(r, port, shapes, reps, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    res = q.get(timeout=300)
    for pr in procs:
        pr.join()
    print(f"one step's communication alone, 2 gloo ranks x 1 thread, bench shape (hidden {h}, {layers} "
          f"layers, vocab {vocab}), median of {reps}")
    print("| step | ms | KiB | collectives |\n| --- | --- | --- | --- |")
    for name, (sec, nbytes, calls) in res.items():
        print(f"| {name} | {sec * 1e3:.2f} | {nbytes / 1024:.1f} | {calls} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench", help="tiny preset of the checkpoint (default: bench)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--comm-only", action="store_true", help="time one step's communication alone")
    a = p.parse_args(argv)
    if a.comm_only:
        comm_only(reps=50)
        return 0

    from hybridserve import LLM
    from hybridserve.engine.device import set_cpu_threads
    from hybridserve.model.tiny import write_tiny_checkpoint

    tmp = tempfile.mkdtemp(prefix="tp-bench-")
    model = write_tiny_checkpoint(os.path.join(tmp, a.preset), preset=a.preset, seed=0)
    common = dict(dtype="float32", device="cpu", num_pages=512, max_num_seqs=a.prompts)
    one = LLM(model, cpu_threads=2, **common)
    print(f"1 process: torch intra-op threads {torch.get_num_threads()}", file=sys.stderr)
    tp = LLM(model, cpu_threads=1, tensor_parallel_size=2, **common)
    print(f"2 ranks: torch intra-op threads per rank {tp.engine.cpu_threads}", file=sys.stderr)
    group = tp.engine.parallel.group
    prompts = _workload(a.prompts, a.prompt_len, 0)
    _round(one, prompts[:2], 4), _round(tp, prompts[:2], 4)  # warm-up

    rates = {"1 process x 2 threads": [], "1 process x 1 thread": [], "2 ranks x 1 thread": []}
    per_step: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(a.rounds):
        # Thread counts (torch's and the native kernels' pool) are process-wide: each
        # engine's own setting, set before its round.
        set_cpu_threads(2)
        dt, n, toks_one, _ = _round(one, prompts, a.max_tokens)
        rates["1 process x 2 threads"].append(n / dt)
        set_cpu_threads(1)  # the same engine on one thread: what each rank has
        dt, n, _, _ = _round(one, prompts, a.max_tokens)
        rates["1 process x 1 thread"].append(n / dt)
        set_cpu_threads(1)
        group.stats.reset()
        group.measure = True
        dt, n, toks_tp, steps = _round(tp, prompts, a.max_tokens)
        group.measure = False
        rates["2 ranks x 1 thread"].append(n / dt)
        assert toks_tp == toks_one, "TP tokens differ from the single process's"
        for kind, (sec, nbytes, calls) in group.stats.by_kind.items():
            per_step.setdefault(kind, []).append((sec / steps, nbytes / steps, calls / steps))
        per_step.setdefault("all", []).append((group.stats.seconds / steps, group.stats.bytes / steps,
                                               group.stats.calls / steps))
        per_step.setdefault("step", []).append((dt / steps, 0, 1))

    print(f"workload: {a.prompts} prompts x {a.prompt_len} tokens, {a.max_tokens} generated (greedy), "
          f"preset {a.preset}, {a.rounds} alternated rounds, medians")
    print("| engine | tokens/s |\n| --- | --- |")
    for k, v in rates.items():
        print(f"| {k} | {statistics.median(v):.1f} |")
    print("\nTP driver, per step (median over rounds of the round's mean):")
    print("| collective | ms / step | KiB / step | calls / step |\n| --- | --- | --- | --- |")
    for kind, vals in per_step.items():
        sec = statistics.median(v[0] for v in vals)
        kib = statistics.median(v[1] for v in vals) / 1024
        calls = statistics.median(v[2] for v in vals)
        print(f"| {kind} | {sec * 1e3:.2f} | {kib:.1f} | {calls:.0f} |")
    del tp
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
