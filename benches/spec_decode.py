"""MTP speculative decoding end to end (issue 34): tokens per second with drafts against
without, in one run, on the same engine settings and the same requests.

    OMP_NUM_THREADS=2 python benches/spec_decode.py [--model DIR] [--ks 1,2,3,4] [--max-tokens 256]
                                                    [--batch 1] [--batch-large 32] [--reps 3]

Parts (one run prints them all; medians of ``--reps`` interleaved runs):

1. **Batch 1** on the trained default model (``hybridserve.default_model``, whose MTP
   layer was trained with it): one greedy request of ``--max-tokens`` output tokens, for
   speculation off and k = 1..4: decode tokens/s (output tokens after the first over
   the time after the first), the acceptance rate and the mean accepted length, and
   the ratio on/off. Target: >= 1.5x with the best k.
2. **Batch ``--batch-large``** (32): that many concurrent requests, off against the best
   k with the default adaptive switch (``disable_by_batch_size``): on/off >= 0.95x.

The model-side costs (a k+1-row verify step against a 1-token decode step, the draft
passes, the commit) at the 0.8B shape are ``benches/spec_commit.py``'s.
Greedy outputs are compared on/off in every run (they must be identical).

Each configuration's engine is built once, warmed up, and reused by every rep (reps
interleaved across configurations), as a server serves request after request; the
engine's stats (acceptance) are then over every rep. ``--fresh-engines`` builds a new
engine per rep instead, so its first calls and first touches of memory are timed too;
at batch 1 a request is short, and those costs then move the ratios from run to run
(benches/RESULTS.md, issue 34's "verify step's cost" section).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

from hybridserve import LLM, SamplingParams
from hybridserve import default_model


def _prompts(tok, n: int) -> list[list[int]]:
    texts = [
        "import os\nimport sys\n\n\ndef main(argv):\n    ",
        "class Queue:\n    \"\"\"A first-in first-out queue.\"\"\"\n\n    def __init__(self):\n        ",
        "def parse_args(args=None):\n    parser = argparse.ArgumentParser(",
        "    def __repr__(self):\n        return ",
    ]
    return [tok.encode(texts[i % len(texts)]) for i in range(n)]


_ENGINES: dict = {}
_REQUESTS = itertools.count()


def _engine(model: str, prompts, k: int | None, threads: int, draft_vocab: int | None, fresh: bool):
    """The engine of one configuration: built once and reused by every rep (a server's
    steady state), or built anew for each rep with ``fresh`` (every first-call cost and
    first touch of its memory inside the timed window)."""
    key = (k, len(prompts))
    llm = None if fresh else _ENGINES.get(key)
    if llm is None:
        kw = dict(dtype="auto", max_model_len=1024, cpu_threads=threads, max_num_seqs=max(len(prompts), 1))
        if k is not None:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
            if draft_vocab is not None:
                kw["speculative_config"]["draft_vocab_size"] = draft_vocab
        _ENGINES.pop(key, None)
        llm = LLM(model, **kw)
        # Warm-up (allocations, first-call paths), not timed.
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                       ignore_eos=True))
        if not fresh:
            _ENGINES[key] = llm
    return llm


def _run(model: str, prompts, max_tokens: int, k: int | None, threads: int,
         draft_vocab: int | None = None, fresh: bool = False) -> tuple[float, list, dict, float]:
    llm = _engine(model, prompts, k, threads, draft_vocab, fresh)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag = next(_REQUESTS)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}.{tag}", p, params)
    t_first = None
    done = {}
    # The engine's thread CPU time over the same steps as the wall clock: on a loaded
    # machine the wall time is mostly waiting for a core, the CPU time is the work.
    cpu = 0.0
    while eng.has_unfinished_requests():
        c0 = time.thread_time()
        outs = eng.step()
        if t_first is not None:
            cpu += time.thread_time() - c0
        for o in outs:
            if t_first is None and any(c.token_ids for c in o.outputs):
                t_first = time.perf_counter()
            if o.finished:
                done[o.request_id] = o
    t_end = time.perf_counter()
    toks = [done[f"r{i}.{tag}"].outputs[0].token_ids for i in range(len(prompts))]
    produced = sum(len(t) for t in toks) - len(prompts)
    return produced / (t_end - t_first), toks, eng.stats(), produced / max(cpu, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-large", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--fresh-engines", action="store_true",
                    help="build every configuration's engine anew for each rep (the first calls and the first "
                         "touch of its memory then fall inside the timed window); default: one engine per "
                         "configuration, reused by every rep, as a server runs")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="drafts from the first N token ids (speculative_config's draft_vocab_size; "
                         "default: the proposer's default for the vocabulary)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = a.model or default_model.path()
    from hybridserve.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    ks = [int(x) for x in a.ks.split(",")]
    from hybridserve.spec import proposer

    from hybridserve.config import ModelConfig

    vocab = ModelConfig.from_json(model).vocab_size
    dv = a.draft_vocab if a.draft_vocab is not None else proposer.default_draft_vocab_size(vocab)
    print(f"model {model}; torch threads {torch.get_num_threads()}; {a.reps} reps (medians); greedy, "
          f"{a.max_tokens} output tokens; draft vocabulary: first {min(dv, vocab)} of {vocab} ids; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    p1 = _prompts(tok, 1)
    rates: dict = {}
    cpu_rates: dict = {}
    stats: dict = {}
    ref = None
    for _ in range(a.reps):
        for k in [None] + ks:
            r, toks, st, rc = _run(model, p1, a.max_tokens, k, a.threads, a.draft_vocab, a.fresh_engines)
            rates.setdefault(k, []).append(r)
            cpu_rates.setdefault(k, []).append(rc)
            stats[k] = st
            if k is None:
                ref = toks
            elif toks != ref:
                sys.exit(f"greedy output with k={k} differs from speculation off")
    base = statistics.median(rates[None])
    base_cpu = statistics.median(cpu_rates[None])
    print("\nbatch 1 (wall tok/s and on/off; then per CPU second of the engine's thread):")
    print(f"  off      {base:8.1f} tok/s          CPU {base_cpu:8.1f} tok/s")
    best = None
    for k in ks:
        m = statistics.median(rates[k])
        st = stats[k]
        acc = st.get("spec_acceptance_rate")
        by = ", ".join("-" if x is None else f"{x:.2f}" for x in st.get("spec_acceptance_by_position") or [])
        mc = statistics.median(cpu_rates[k])
        print(f"  k={k}      {m:8.1f} tok/s  {m / base:5.2f}x   CPU {mc:8.1f} tok/s {mc / base_cpu:5.2f}x   acceptance {acc if acc is None else f'{acc:.3f}'}"
              f"  by position [{by}]  mean accepted length {st.get('spec_mean_accepted_length') or 0:.2f}")
        if best is None or m > statistics.median(rates[best]):
            best = k
    if a.skip_large:
        return
    pl = _prompts(tok, a.batch_large)
    large: dict = {}
    for _ in range(a.reps):
        for k in (None, best):
            r, toks, st, _ = _run(model, pl, a.max_tokens // 2, k, a.threads, a.draft_vocab, a.fresh_engines)
            large.setdefault(k, []).append(r)
            stats[("large", k)] = st
    lb = statistics.median(large[None])
    lo = statistics.median(large[best])
    print(f"\nbatch {a.batch_large}: off {lb:.1f} tok/s, k={best} {lo:.1f} tok/s: {lo / lb:.2f}x "
          f"(steps not drafting: {stats[('large', best)].get('spec_steps_not_drafting')})")


if __name__ == "__main__":
    main()
