"""The sampler's host cost per row at the host_overhead bench's shape, this tree against
the sampler of an earlier git revision, in one process.

256 keyed rows of the ``bench`` model's vocabulary (272), every row seeded
``temperature=0.8, top_p=0.9, top_k=50`` with presence, frequency and repetition
penalties (host_overhead's seeded mode), or greedy; the rows' outputs grow step by
step, as in a decode batch. Each step runs ``Sampler.plan`` + ``Sampler.sample_planned``
(what the engine calls) on both samplers with the same logits, alternating which goes
first; the cost is the thread's CPU time (on a shared machine wall time also counts
the waits for a core), the median over the steps, in microseconds per row. Both must
draw the same tokens at every step (asserted).

The earlier sampler is ``python/hybridserve/sampler/`` as of ``--before`` (the
package split, 96b5551 or later), extracted to a temporary folder and imported under
another name.

    python benches/sampler_host.py --before c2505d0
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODES = {
    "greedy": dict(temperature=0.0),
    "seeded top-p/top-k + penalties": dict(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.3,
                                            frequency_penalty=0.2, repetition_penalty=1.1),
}


def load_before(rev: str, tmp: str):
    """The sampler package as of ``rev``, importable as ``sampler_before``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = os.path.join(tmp, "sampler_before")
    os.makedirs(pkg)
    names = subprocess.run(["git", "-C", root, "ls-tree", "--name-only", rev, "python/hybridserve/sampler/"],
                           check=True, capture_output=True, text=True).stdout.split()
    for path in names:
        text = subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
        with open(os.path.join(pkg, os.path.basename(path)), "w") as f:
            f.write(text.replace("hybridserve.sampler", "sampler_before"))
    sys.path.insert(0, tmp)
    return importlib.import_module("sampler_before")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="REV")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=272)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    import hybridserve.sampler as after
    from hybridserve.sampling import SamplingParams

    tmp = tempfile.mkdtemp(prefix="sampler-before-")
    try:
        before = load_before(args.before, tmp)
        print(f"torch intra-op threads: 1; {args.rows} rows, vocabulary {args.vocab}; CPU us per row per step "
              f"(plan + sample_planned), median of {args.steps} steps")
        print(f"| sampling | before ({args.before}) | after | after / before |")
        print("|---|---|---|---|")
        for mode in args.modes:
            params = SamplingParams(seed=1, max_tokens=10**6, ignore_eos=True, **MODES[mode])
            sides = {}
            for name, mod in (("before", before), ("after", after)):
                rows = [mod.SamplingRow(params=params, prompt_token_ids=tuple((7 * i + j) % 250 + 1 for j in range(30)),
                                        output_token_ids=[], generator=mod.make_generator(1, i), key=(i, 0))
                        for i in range(args.rows)]
                sides[name] = (rows, mod.Sampler(), [])
            g = torch.Generator().manual_seed(0)
            for step in range(args.steps + 3):
                logits = torch.randn(args.rows, args.vocab, generator=g) * 3
                tokens = {}
                for name in (("before", "after") if step % 2 else ("after", "before")):
                    rows, sampler, times = sides[name]
                    c0 = time.thread_time()
                    prep = sampler.plan(rows, args.vocab, "cpu")
                    out = sampler.sample_planned(logits, prep)
                    if step >= 3:  # the first steps build the rows' state
                        times.append(time.thread_time() - c0)
                    for r, t in zip(rows, out.token_ids):
                        r.output_token_ids.append(t)
                    tokens[name] = out.token_ids
                assert tokens["before"] == tokens["after"], f"{mode}: the samplers drew different tokens at step {step}"
            b, a = (statistics.median(sides[k][2]) * 1e6 / args.rows for k in ("before", "after"))
            print(f"| {mode} | {b:.2f} | {a:.2f} | {a / b:.2f}x |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
