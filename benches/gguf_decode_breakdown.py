"""Where one-sequence decode time goes on a GGUF file, in process (issue 35's 1-sequence
target): per token, the wall and calling-thread CPU time and the call count of each
kernel the native decode step runs (the block GEMMs, the delta rule, conv, attention,
norms, ...) and of the Python layers around them (runner, model, native step,
QuantGemm, embedding, LM head). Each entry is wrapped with two clock reads, so the
Python layers' own figures include that wrapping; compare call counts and CPU times,
not wall times, on a shared machine.

    python benches/gguf_decode_breakdown.py FILE.gguf THREADS [TOKENS]

``STUB=1`` replaces every native kernel by a no-op (the step's host work alone; the
prefill still runs for real and is amortised into the per-token figures). ``CPROF=1``
adds a cProfile of one more run.
"""
import collections
import gc
import os
import sys
import time

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.model import native_decode as nd, quant_gemm as qg
from hybridserve.runner import model_runner as mr

FILE, THREADS = sys.argv[1], int(sys.argv[2])
NTOK = int(sys.argv[3]) if len(sys.argv) > 3 else 128
llm = LLM(FILE, max_num_seqs=1, cpu_threads=THREADS)
print("torch threads", torch.get_num_threads(), "load", os.getloadavg())
sp = SamplingParams(max_tokens=NTOK, temperature=0, ignore_eos=True)
prompt = "def fibonacci(n):\n    " * 8
llm.generate([prompt], sp)
stats = collections.defaultdict(lambda: [0, 0, 0])  # calls, wall ns, thread CPU ns


def timed(f, label):
    def w(*a, **k):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return f(*a, **k)
        finally:
            s = stats[label]
            s[0] += 1
            s[1] += time.perf_counter_ns() - t
            s[2] += time.thread_time_ns() - c
    return w


WRAPPED = ((nd.NativeDecodeStep, "run", "native.run"), (nd.NativeDecodeStep, "_lm_head", "native._lm_head"),
           (nd.NativeDecodeStep, "_attention_inputs", "native._attention_inputs"),
           (nd.NativeDecodeStep, "_embed", "native._embed"), (qg.QuantGemm, "__call__", "QuantGemm.__call__"),
           (mr.ModelRunner, "execute", "runner.execute"), (mr.ModelRunner, "build_batch", "runner.build_batch"),
           (mr.ModelRunner, "stage", "runner.stage"))
for owner, name, label in WRAPPED:
    setattr(owner, name, timed(getattr(owner, name), label))
step = next(o for o in gc.get_objects() if isinstance(o, nd.NativeDecodeStep))
stub = os.environ.get("STUB") == "1"
noop = lambda *a, **k: None  # noqa: E731
qm = noop if stub else timed(step._quant_matmul, "kernel quant_matmul")
gemms = [v for e in step._layers for v in e.values() if isinstance(v, qg.QuantGemm)] + [step.lm_head]
for g in gemms:
    g.quant_matmul = qm
for name in ("k_norm", "k_conv", "k_rule", "k_rope", "k_attn", "k_silu_mul", "k_write_kv"):
    setattr(step, name, noop if stub else timed(getattr(step, name), "kernel " + name))
runs = []
for r in range(3):
    stats.clear()
    t, c = time.perf_counter(), time.process_time()
    llm.generate([prompt], sp)
    runs.append((time.perf_counter() - t, time.process_time() - c, {k: list(v) for k, v in stats.items()}))
dt, dc, st = min(runs, key=lambda x: x[0])
per_run = [round(x[0] / NTOK * 1e3, 2) for x in runs]
print(f"threads {THREADS}{' (kernels stubbed)' if stub else ''}, per token over {NTOK} tokens (prefill included): "
      f"wall {dt / NTOK * 1e3:.2f} ms, process CPU {dc / NTOK * 1e3:.2f} ms (runs: {per_run})")
for k, (cnt, w, c) in sorted(st.items(), key=lambda kv: -kv[1][2]):
    print(f"  {k:28s} calls/tok {cnt / NTOK:6.1f}  wall ms/tok {w / NTOK / 1e6:7.3f}  "
          f"thread CPU ms/tok {c / NTOK / 1e6:7.3f}")
print("load", os.getloadavg())
if os.environ.get("CPROF") == "1":
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    llm.generate([prompt], sp)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(40)
