"""Host work per decode step, per sequence, at short and long contexts (issue 20).

256 sequences of the ~10M-parameter ``bench`` model decode together through the
:class:`AsyncEngine` (the server's path: the engine on its thread, one asyncio
consumer per request reading its outputs). For each context length and sampling
mode the pure-decode steps are timed from outside the engine, the same way for any
version of the package:

* ``schedule``  - ``Scheduler.schedule`` (Rust) wall time;
* ``prepare``   - ``ModelRunner.execute`` minus the model call (staging, tables, batch);
* ``forward``   - the model call;
* ``sample``    - the sampler call (this tree: its ``plan`` before forward and its
  ``sample_planned`` after);
* ``rest``      - everything else in ``LLMEngine.step`` (sampling rows, scheduler
  update, detokenization, stop strings, outputs);
* ``handoff``   - from the end of one step to the start of the next on the engine
  thread (delivery to the clients' queues, metrics, commands);

``host = step + handoff - forward`` is everything but forward (wall time on the
engine thread, so it includes the engine thread's waits for the GIL, in whichever phase
they fall). Two CPU-time columns say whose work it is: ``host_cpu``, the engine
thread's CPU time in the step outside the model call, and ``frontend_cpu``, the event
loop thread's CPU time per step (the consumers' work, which shares the GIL with the
engine thread). Medians over the measured steps, reported in microseconds per
sequence per step. Prompts share a
prefix (cached, with a DeltaNet checkpoint at its end) so that long contexts do not
cost a long prefill per sequence; each prompt ends in its own tokens.

``--isolated`` (it reads the engine's own phase timers) measures the same steps on
the synchronous engine with the model call replaced by a replay of its first output,
so that nothing but host work runs and the model's threads and cache traffic do not
disturb it: the host cost as such, per phase (wall time), plus ``host_cpu`` (the
step's CPU time on the engine thread, the replayed forward included, which is next to
nothing) and ``sample_cpu`` (the sampler's CPU time, its plan and its draw): on a
machine shared with other work, CPU time leaves out the waits for a core.

``--gpu-like-forward-ms MS`` (async engine) replaces each full-batch decode step's
model call by a replay of its first logits after ``MS`` ms of sleep: the engine thread
waits without the GIL and without a core, as it does for a GPU, so that the event
loop's work can overlap the forward as it would on a device, and ``forward`` no longer
competes with the host work for this machine's cores.

With ``--isolated`` the same option makes the replayed forward sleep too: the
synchronous engine's host work after the same idle wait (caches and clocks as the
server's path finds them), the control for the async engine's numbers.

``--before REV`` also runs the script against the package as of git revision REV
(extracted to a temporary folder, with the current build of the Rust extension) and
prints both side by side: every case in its own process, the two trees alternating
case by case, ``--rounds`` times (cells: medians over the rounds), so that a change
in the machine's load lands on both. With ``--isolated``, REV must have the engine's
phase timers (issue 20's first round, 301109f or later).

    python benches/host_overhead.py --threads 2 --before 6c663d6
    python benches/host_overhead.py --threads 1 --isolated --before 96b5551 --rounds 3
    python benches/host_overhead.py --threads 2 --gpu-like-forward-ms 10 --before 0b8e705 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

BLOCK = 16
MODES = {
    "greedy": dict(temperature=0.0),
    "seeded top-p/top-k + penalties": dict(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.3,
                                            frequency_penalty=0.2, repetition_penalty=1.1),
}


class _Clock:
    """Accumulates the wall time of calls to ``fn``."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0


class _TimedScheduler:
    def __init__(self, inner):
        self._inner = inner
        self.schedule = _Clock(inner.schedule)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _TimedModel(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def forward(self, *a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.inner(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.thread_time() - c0


def _engine(model_dir: str, context: int, seqs: int, threads: int = 2):
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine

    prefix = (context // BLOCK) * BLOCK - BLOCK
    blocks = prefix // BLOCK + seqs * (BLOCK * 2 + context - prefix + 64) // BLOCK + 64
    args = EngineArgs(model=model_dir, dtype="float32", device="cpu", block_size=BLOCK, num_gpu_blocks=blocks,
                      num_state_slots=seqs + 8, max_num_seqs=seqs, max_num_batched_tokens=4096,
                      max_model_len=context + 256, prefix_checkpoint_interval=prefix,
                      enable_prefix_caching=True, cpu_threads=threads)
    return LLMEngine(args), prefix


class _Replay(torch.nn.Module):
    """The model's first output, returned again at every later call."""

    def __init__(self, inner, sleep_s: float = 0.0):
        super().__init__()
        self.inner = inner
        self.out = None
        self.sleep_s = sleep_s

    def forward(self, *a, **k):
        if self.out is None:
            self.out = self.inner(*a, **k)
        elif self.sleep_s:
            time.sleep(self.sleep_s)
        return self.out


class _GpuLikeForward(torch.nn.Module):
    """A full-batch decode step's model call as on a GPU: the first one's logits,
    returned after ``seconds`` of sleep (the engine thread waits without the GIL and
    without a core, as it waits for the device). Any other batch runs the model."""

    def __init__(self, inner, seqs: int, seconds: float):
        super().__init__()
        self.inner, self.seqs, self.seconds = inner, seqs, seconds
        self.out = None

    def forward(self, batch, *a, **k):
        if batch.input_ids.shape[0] != self.seqs:
            return self.inner(batch, *a, **k)
        if self.out is None:
            self.out = self.inner(batch, *a, **k)
        else:
            time.sleep(self.seconds)
        return self.out


def _run_isolated(model_dir: str, context: int, seqs: int, mode: str, steps: int, threads: int,
                  sleep_ms: float | None = None) -> dict:
    import gc

    from hybridserve.sampling import SamplingParams

    engine, prefix = _engine(model_dir, context, seqs, threads)
    shared = [(7 * i) % 250 + 1 for i in range(prefix)]
    engine.add_request("warm", shared + [3] * (context - prefix), SamplingParams(temperature=0.0, max_tokens=1,
                                                                               ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, seed=1, **MODES[mode])
    for i in range(seqs):
        engine.add_request(f"s{i}", shared + [(11 * i + j) % 250 + 1 for j in range(context - prefix)], params)
    while engine.last_step_stats.get("num_batched_tokens") != seqs:
        engine.step()
    engine.runner.model = _Replay(engine.runner.model, (sleep_ms or 0.0) / 1000)
    engine.step()  # the model runs once more here; later steps replay its logits
    gc_seconds, t = [0.0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - t[0]

    # CPU time of this thread (torch runs its ops on it with one intra-op thread): on
    # a machine shared with other work, wall time also counts the waits for a core.
    sampler = engine.sampler
    sample_cpu = [0.0]

    def cpu_timed(fn):
        def run(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                sample_cpu[0] += time.thread_time() - c0
        return run

    sampler.plan, sampler.sample_planned = cpu_timed(sampler.plan), cpu_timed(sampler.sample_planned)
    gc.callbacks.append(on_gc)
    rows = []
    try:
        for _ in range(steps):
            c0, s0 = time.thread_time(), sample_cpu[0]
            engine.step()
            assert engine.last_step_stats["num_batched_tokens"] == seqs
            rows.append(dict(engine.last_step_stats["phase_seconds"], host_cpu=time.thread_time() - c0,
                             sample_cpu=sample_cpu[0] - s0))
    finally:
        gc.callbacks.remove(on_gc)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["host"] = statistics.median(sum(v for k, v in r.items() if k not in ("forward", "host_cpu", "sample_cpu"))
                                    for r in rows)
    med["gc"] = gc_seconds[0] / steps
    return {"context": context, "mode": mode, "steps": len(rows),
            "us_per_seq": {k: round(1e6 * v / seqs, 2) for k, v in med.items()}}


def _run_case(model_dir: str, context: int, seqs: int, mode: str, steps: int, threads: int = 2,
              gpu_like_ms: float | None = None) -> dict:
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.sampling import SamplingParams

    try:
        engine, prefix = _engine(model_dir, context, seqs, threads)
    except TypeError:  # a tree whose EngineArgs has no cpu_threads
        engine, prefix = _engine(model_dir, context, seqs)
    vocab = engine.model_config.vocab_size
    shared = [(7 * i) % 250 + 1 for i in range(prefix)]
    # Prefill the shared prefix once, so the sequences below start from its checkpoint.
    warm = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("warm", shared + [3] * (context - prefix), warm)
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler = _TimedScheduler(engine.scheduler)
    runner_exec = engine.runner.execute = _Clock(engine.runner.execute)
    if gpu_like_ms:
        engine.runner.model = _GpuLikeForward(engine.runner.model, seqs, gpu_like_ms / 1000)
    model = engine.runner.model = _TimedModel(engine.runner.model)
    if hasattr(engine.sampler, "sample_planned"):
        # This tree's engine plans the sampler's rows before forward (they ride in the
        # runner's staging copy): time both halves on the instance, keeping its type.
        s = engine.sampler
        plan_clock, draw_clock = _Clock(s.plan), _Clock(s.sample_planned)
        s.plan, s.sample_planned = plan_clock, draw_clock

        class _Both:
            @property
            def seconds(self):
                return plan_clock.seconds + draw_clock.seconds

        sampler = _Both()
    else:
        sampler = engine.sampler = _Clock(engine.sampler)
    inner_step = engine.step
    samples: list[dict] = []
    last_end = [None]

    loop_clock = [None]  # the event loop thread's CPU clock (set by the first consumer)
    last_loop_cpu = [None]

    def loop_cpu() -> float | None:
        return time.clock_gettime(loop_clock[0]) if loop_clock[0] is not None else None

    def step():
        t0 = time.perf_counter()
        handoff = t0 - last_end[0] if last_end[0] is not None else None
        l0 = loop_cpu()
        frontend = l0 - last_loop_cpu[0] if l0 is not None and last_loop_cpu[0] is not None else None
        last_loop_cpu[0] = l0
        c0 = (sched.schedule.seconds, runner_exec.seconds, model.seconds, sampler.seconds)
        cpu0, fcpu0 = time.thread_time(), model.cpu_seconds
        out = inner_step()
        t1 = time.perf_counter()
        engine_cpu = time.thread_time() - cpu0 - (model.cpu_seconds - fcpu0)
        last_end[0] = t1
        st = engine.last_step_stats
        if st["num_batched_tokens"] == seqs and st["num_scheduled_seqs"] == seqs:  # pure decode
            s, e, m, sa = (sched.schedule.seconds - c0[0], runner_exec.seconds - c0[1],
                           model.seconds - c0[2], sampler.seconds - c0[3])
            samples.append({"schedule": s, "prepare": e - m, "forward": m, "sample": sa,
                            "rest": (t1 - t0) - s - e - sa, "handoff": handoff, "frontend_cpu": frontend,
                            "host_cpu": engine_cpu,
                            "phases": dict(st.get("phase_seconds", {}))})
        return out

    engine.step = step
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=steps + 3, ignore_eos=True, seed=1, **MODES[mode])

    async def consume(i: int) -> int:
        if loop_clock[0] is None:
            loop_clock[0] = time.pthread_getcpuclockid(threading.get_ident())
        prompt = shared + [(11 * i + j) % (vocab - 20) + 1 for j in range(context - prefix)]
        stream = await aengine.generate(f"s{i}", prompt, params)
        n = 0
        try:
            async for out in stream:
                n += sum(len(c.token_ids) for c in out.outputs)
        finally:
            stream.close()
        return n

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(seqs)))

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    # The first decode step follows a prefill step (its hand-off is not a decode's).
    rows = [r for r in samples if r["handoff"] is not None and r["frontend_cpu"] is not None][1:]
    if not rows:
        raise RuntimeError("no pure-decode step was measured; raise --steps")
    med = {k: statistics.median(r[k] for r in rows) for k in ("schedule", "prepare", "forward", "sample",
                                                                "rest", "handoff", "frontend_cpu",
                                                                "host_cpu")}
    med["host"] = statistics.median(r["schedule"] + r["prepare"] + r["sample"] + r["rest"] + r["handoff"]
                                    for r in rows)
    phases = {}
    if rows[0]["phases"]:
        phases = {k: statistics.median(r["phases"][k] for r in rows) for k in rows[0]["phases"]}
    us = lambda d: {k: round(1e6 * v / seqs, 2) for k, v in d.items()}  # noqa: E731
    return {"context": context, "mode": mode, "steps": len(rows), "us_per_seq": us(med),
            "engine_phases_us_per_seq": us(phases)}


def measure(args) -> list[dict]:
    from hybridserve.model.tiny import write_tiny_checkpoint

    torch.set_num_threads(args.threads)
    from hybridserve.kernels import native

    if native.available():
        native.set_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="host-overhead-")
    try:
        model_dir = write_tiny_checkpoint(os.path.join(tmp, "bench"), preset="bench", seed=0,
                                          max_position_embeddings=max(args.contexts) + 1024)
        results = []
        for context in args.contexts:
            for mode in args.modes:
                if args.isolated:
                    results.append(_run_isolated(model_dir, context, args.seqs, mode, args.steps, args.threads,
                                                 args.gpu_like_forward_ms))
                else:
                    results.append(_run_case(model_dir, context, args.seqs, mode, args.steps, args.threads,
                                             args.gpu_like_forward_ms))
                gc.collect()
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure_each_in_own_process(args) -> list[dict]:
    """One child process per (context, mode) case.

    In one process every case ran slower than the one before it, whatever its context
    (on a quiet machine, 16,000 tokens greedy: 9.1 us per sequence as the first case,
    17.0 us as the third), which read as host work growing with context."""
    if args.single or len(args.contexts) * len(args.modes) == 1:
        return measure(args)
    results = []
    for context in args.contexts:
        for mode in args.modes:
            out = subprocess.run(_case_cmd(args, context, mode, args.expect_root), check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            results.extend(json.loads(out.strip().splitlines()[-1]))
    return results


def _case_cmd(args, context: int, mode: str, expect_root: str | None) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--json", "--single", "--threads", str(args.threads),
            "--seqs", str(args.seqs), "--steps", str(args.steps), "--contexts", str(context), "--modes", mode,
            *(["--isolated"] if args.isolated else []), *(["--expect-root", expect_root] if expect_root else []),
            *(["--gpu-like-forward-ms", str(args.gpu_like_forward_ms)] if args.gpu_like_forward_ms else [])]


def _median_rows(runs: list[dict]) -> dict:
    """One case's rounds -> one row: the median of each cell over the rounds."""
    row = dict(runs[0])
    for key in ("us_per_seq", "engine_phases_us_per_seq"):
        if key in row and row[key]:
            row[key] = {k: round(statistics.median(r[key][k] for r in runs), 2) for k in row[key]}
    row["rounds"] = len(runs)
    return row


def side_by_side(rev: str, args) -> tuple[list[dict], list[dict]]:
    """Before (the package as of ``rev``) and after, each case in its own process,
    the two trees alternating case by case for ``--rounds`` rounds (so a change in
    the machine's load lands on both), cells the medians over the rounds."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="hybridserve-before-")
    try:
        archive = subprocess.run(["git", "-C", root, "archive", rev, "python/hybridserve"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        pkg = os.path.join(tmp, "python", "hybridserve")
        for so in glob.glob(os.path.join(root, "python", "hybridserve", "_core*.so")):
            shutil.copy(so, pkg)
        before_env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "python"))
        before, after = [], []
        for context in args.contexts:
            for mode in args.modes:
                b_runs, a_runs = [], []
                for r in range(args.rounds):
                    # Alternate which tree goes first, so neither always follows the other.
                    order = (("b", before_env), ("a", None)) if r % 2 == 0 else (("a", None), ("b", before_env))
                    for which, env in order:
                        expect = os.path.join(tmp, "python") if which == "b" else args.expect_root
                        out = subprocess.run(_case_cmd(args, context, mode, expect), env=env, check=True,
                                             stdout=subprocess.PIPE, text=True).stdout
                        (b_runs if which == "b" else a_runs).extend(json.loads(out.strip().splitlines()[-1]))
                before.append(_median_rows(b_runs))
                after.append(_median_rows(a_runs))
                print(json.dumps({"before": before[-1], "after": after[-1]}), file=sys.stderr, flush=True)
        return before, after
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per case (the first is not counted)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 4000, 16000])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--before", metavar="REV", help="also measure the package as of this git revision")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --before: rounds of each case, the two trees alternating case by case (medians)")
    ap.add_argument("--isolated", action="store_true",
                    help="synchronous engine, model output replayed: host work alone, by the engine's phase timers")
    ap.add_argument("--gpu-like-forward-ms", type=float, metavar="MS",
                    help="each full-batch decode step's model call replays the first one's logits after MS ms "
                         "of sleep (the engine thread waits without the GIL or a core, as for a GPU), so that "
                         "host work alone is timed and the event loop's work can overlap the forward as it "
                         "would on a device; with --isolated, the synchronous engine's replay sleeps the same")
    ap.add_argument("--json", action="store_true", help="print one JSON list (used by --before)")
    ap.add_argument("--expect-root", help=argparse.SUPPRESS)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # every case in this process
    args = ap.parse_args()
    if args.expect_root:
        import hybridserve

        assert os.path.abspath(hybridserve.__file__).startswith(args.expect_root), hybridserve.__file__
    if args.before:
        before, after = side_by_side(args.before, args)
    else:
        before, after = None, measure_each_in_own_process(args)
    if args.json:
        print(json.dumps(after))
        return
    if args.isolated:
        print(f"torch intra-op threads: {args.threads}; {args.seqs} sequences decoding; synchronous "
              "engine, model output replayed; medians, us per sequence per step (gc: mean)")
        keys = list(after[0]["us_per_seq"])
        print("| context | sampling | " + " | ".join(f"{k} before / after" if before else k for k in keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for i, row in enumerate(after):
            cells = [f"{before[i]['us_per_seq'][k]} / {row['us_per_seq'][k]}" if before else str(row["us_per_seq"][k])
                     for k in keys]
            print(f"| {row['context']} | {row['mode']} | " + " | ".join(cells) + " |")
        for mode in args.modes:
            rs = [r for r in after if r["mode"] == mode]
            lo, hi = min(rs, key=lambda r: r["context"]), max(rs, key=lambda r: r["context"])
            print(f"{mode}: host at context {hi['context']} / {lo['context']}: "
                  f"{hi['us_per_seq']['host'] / lo['us_per_seq']['host']:.2f}x")
        return
    print(f"torch intra-op threads: {args.threads}; {args.seqs} sequences decoding; "
          "medians, us per sequence per step")
    keys = ("schedule", "prepare", "sample", "rest", "handoff", "host", "host_cpu", "frontend_cpu", "forward")
    print("| context | sampling | " + " | ".join(f"{k} before / after" if before else k for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for i, row in enumerate(after):
        cells = [str(row["context"]), row["mode"]]
        for k in keys:
            a = row["us_per_seq"][k]
            cells.append(f"{before[i]['us_per_seq'][k]} / {a}" if before else f"{a}")
        print("| " + " | ".join(cells) + " |")
    if after and after[0]["engine_phases_us_per_seq"]:
        print("\nengine's own phase timers (after), us per sequence per step:")
        for row in after:
            print(f"  context {row['context']}, {row['mode']}: {row['engine_phases_us_per_seq']}")
    for mode in args.modes:
        rs = [r for r in after if r["mode"] == mode]
        lo, hi = min(rs, key=lambda r: r["context"]), max(rs, key=lambda r: r["context"])
        if lo is not hi:
            print(f"{mode}: host at context {hi['context']} / {lo['context']}: "
                  f"{hi['us_per_seq']['host'] / lo['us_per_seq']['host']:.2f}x")


if __name__ == "__main__":
    main()
