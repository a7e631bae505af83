"""The model side of MTP speculative decoding (issue 34), at one sequence on the CPU.

Side by side in one run, medians of interleaved repetitions, from the same cache state:

* ``decode``: a 1-token decode step (the native decode step where it applies);
* ``verify``: a speculative (k+1)-row step: DeltaNet state read, not written, rows
  recorded in the step's ring;
* ``commit a``: ``commit_speculative`` replaying ``a`` accepted rows (1..k+1); the
  first call after the verify forward apart (``(1st)``), then two more of the same
  replay (the state pages are rewritten with the same values);
* ``plain``: the same k+1 rows (all their logits, as verify) as an ordinary
  (non-speculative) chunk, which writes the state directly (what "all rows accepted may
  write directly" would cost instead of verify + commit(k+1));
* ``mtp``: one MTP draft pass (1 row) over the full vocabulary, ``mtp V``: over a reduced
  draft vocabulary of the first V token ids (``--draft-vocab``), and ``--k`` of each
  in total (the draft passes of one step);
* ``k passes``: the proposer's k passes of one step in one native call
  (``NativeDecodeStep.mtp_draft``, where the native step runs), full and reduced vocabulary.

``--model DIR`` times a checkpoint (the default model: ``--model $(python -c "from
hybridserve import default_model; print(default_model.path())")``) instead of a preset
with random weights.

Weights are random (timing only). Prints the ring's bytes per step. Besides wall time
each line gives the thread's CPU time (``time.thread_time``; one torch thread, and the
native kernels run on the calling thread at one thread): on a shared machine, waiting
for a core inflates wall times, not CPU time. Usage::

    OMP_NUM_THREADS=1 python benches/spec_commit.py --preset peer-0.8b --dtype bfloat16 --k 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridserve.config import ModelConfig
from hybridserve.model import ForwardBatch
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.model.tiny import text_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="peer-0.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-vocab", default="32768", help="comma-separated draft vocabulary sizes to time")
    ap.add_argument("--model", default=None, help="a checkpoint directory (e.g. the default model's, "
                    "hybridserve.default_model.path()) instead of a preset with random weights")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from hybridserve.kernels import native

    # The native kernels' own pool too (the engine sets it from cpu_threads): left at
    # the machine's core count, "1 thread" would time 2 kernel threads, and a busy
    # machine the wait for the second one.
    native.set_threads(a.threads)
    vocabs = [int(v) for v in a.draft_vocab.split(",") if v]
    torch.manual_seed(0)
    if a.model:
        from hybridserve.model import load_model

        model, config = load_model(a.model, dtype=a.dtype, progress=False, load_mtp=True)
        a.preset = os.path.basename(a.model.rstrip("/"))
    else:
        config = ModelConfig.from_dict(text_config(a.preset))
        model = Qwen3_5ForServing(config, dtype=a.dtype, mtp=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-3, 0.7)
                elif "norm" in name:
                    p.normal_(0, 0.1)
                else:
                    p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
    model.store_cpu_layout()
    block = 16
    n_ctx, k = a.context, a.k
    nb = -(-(n_ctx + k + 2) // block)
    cache = model.new_cache(nb + model.new_cache(1, block).state_pages, block)
    table, states = list(range(nb)), list(range(nb, cache.num_pages))
    ids = torch.randint(0, config.vocab_size, (n_ctx + k + 1,)).tolist()

    def batch(start, n, speculative=None, all_logits=True):
        return ForwardBatch.from_lists(
            input_ids=ids[start:start + n], positions=range(start, start + n),
            slot_mapping=[table[p // block] * block + p % block for p in range(start, start + n)],
            query_start_loc=[0, n], seq_lens=[start + n], block_tables=[table], state_pages=[states],
            has_initial_state=[start > 0], logits_indices=list(range(n)) if all_logits else [n - 1],
            speculative=speculative)

    model(batch(0, n_ctx, all_logits=False), cache)
    snapshot = cache.arena.clone()
    times: dict[str, list[float]] = {}

    cpu: dict[str, list[float]] = {}

    def timed(name, fn):
        cache.arena.copy_(snapshot)
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        cpu.setdefault(name, []).append(time.thread_time() - c0)
        return out

    ring_bytes = 0
    hidden = torch.zeros(1, config.hidden_size, dtype=model.dtype)
    for _ in range(a.reps):
        timed("decode", lambda: model(batch(n_ctx, 1, all_logits=False), cache))
        timed("plain", lambda: model(batch(n_ctx, k + 1), cache))
        v = batch(n_ctx, k + 1, [True])
        timed("verify", lambda: model(v, cache))
        ring_bytes = model.spec_ring_bytes(v)
        for acc in sorted({1, (k + 2) // 2, k + 1}):
            vb = batch(n_ctx, k + 1, [True])
            cache.arena.copy_(snapshot)
            model(vb, cache)
            ring = vb.spec_ring
            for _ in range(3):  # (the first replay after a forward is timed apart: caches are cold)
                c0, t0 = time.thread_time(), time.perf_counter()
                model.commit_speculative(vb, cache, [acc])
                name = f"commit {acc}" + ("" if _ else " (1st)")
                times.setdefault(name, []).append(time.perf_counter() - t0)
                cpu.setdefault(name, []).append(time.thread_time() - c0)
                vb.spec_ring = ring
        for v in [None] + vocabs:
            mb = batch(n_ctx, 1)
            timed("mtp" if v is None else f"mtp {v}", lambda: model.mtp_forward(hidden, mb.input_ids, mb, cache, v))
        fast = model._usable_native_step()
        if fast is not None:
            # The proposer's passes of one step in one native call (NativeDecodeStep.mtp_draft):
            # the MTP prefill of one committed row, then k - 1 chained passes.
            import numpy as np
            tab = np.asarray([table], dtype=np.int32)
            p0 = np.asarray([n_ctx])
            sl = np.asarray([table[n_ctx // block] * block + n_ctx % block])
            for v in [None] + vocabs:
                timed(f"{k} passes" + ("" if v is None else f" {v}"),
                      lambda: fast.mtp_draft(hidden, np.asarray(ids[n_ctx:n_ctx + 1]), p0, sl, tab, np.asarray([0]),
                                             k, cache, v))
    base = statistics.median(times["decode"])
    cbase = statistics.median(cpu["decode"])
    print(f"preset {a.preset} {a.dtype}, k={k}, context {n_ctx}, torch threads {torch.get_num_threads()}, "
          f"kernel threads {native.threads()}, "
          f"{a.reps} reps (medians); load average {os.getloadavg()[0]:.1f}")
    print(f"ring per step: {ring_bytes / 1024:.1f} KiB for {k + 1} rows "
          f"({ring_bytes / (k + 1) / 1024:.1f} KiB per row; arena state per sequence "
          f"{cache.layout.state_bytes / 2**20:.1f} MiB)")
    print(f"  {'':14s} {'wall':>11s} {'':13s} {'CPU':>11s}")
    for name, ts in times.items():
        m, c = statistics.median(ts), statistics.median(cpu[name])
        print(f"  {name:14s} {m * 1e3:8.2f} ms  {m / base:5.2f}x decode  {c * 1e3:8.2f} ms  {c / cbase:5.2f}x decode")
    for name in [n for n in times if n.startswith("mtp")]:
        m, c = statistics.median(times[name]), statistics.median(cpu[name])
        print(f"  {k} x {name:10s} {k * m * 1e3:8.2f} ms  {k * m / base:5.2f}x decode  {k * c * 1e3:8.2f} ms  "
              f"{k * c / cbase:5.2f}x decode (the k draft passes)")


if __name__ == "__main__":
    main()
