"""Where a speculative step's CPU time goes at batch 1 (issue 34): thread CPU time per
engine step and per phase, speculation off against k drafts, one process.

    OMP_NUM_THREADS=1 python benches/spec_phases.py [--k 3] [--rounds 3] [--max-tokens 256]
                                                    [--no-python-drafter]

One engine per configuration (off; k with the drafter in one native call; k with the
drafter's Python passes, ``NativeDecodeStep.fused_mtp`` off), the trained default
model, one greedy request of ``--max-tokens`` tokens per round, rounds interleaved.
Each phase is the thread CPU time (``time.thread_time_ns``) inside the named call,
summed over a round and divided by its engine steps; the wrappers themselves add a
few microseconds per call. Cells are medians over the rounds. Greedy outputs must
agree across the configurations (the script exits otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from hybridserve import LLM, SamplingParams, default_model
from hybridserve.engine import core
from hybridserve.model import native_decode, qwen3_5
from hybridserve.runner import model_runner
from hybridserve.sampler import batch_sampler
from hybridserve.spec import decoder

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "

_acc: dict[str, int] = defaultdict(int)
_calls: dict[str, int] = defaultdict(int)
_fused = [True]


def _wrap(owner, name: str, label: str, static: bool = False) -> None:
    fn = getattr(owner, name)
    if static:
        fn = fn.__func__ if hasattr(fn, "__func__") else fn
    clock = time.thread_time_ns

    def timed(*a, **kw):
        t0 = clock()
        try:
            return fn(*a, **kw)
        finally:
            _acc[label] += clock() - t0
            _calls[label] += 1

    setattr(owner, name, staticmethod(timed) if static else timed)


def _install() -> None:
    _wrap(native_decode.NativeDecodeStep, "run", "forward (NativeDecodeStep.run)")
    _wrap(native_decode.NativeDecodeStep, "mtp_draft", "drafts (mtp_draft)")
    _wrap(decoder.SpecDecoder, "_draft", "drafting, all (SpecDecoder._draft)")
    _wrap(model_runner.ModelRunner, "commit_speculative", "commit (runner.commit_speculative)")
    _wrap(decoder, "accept", "acceptance (spec.acceptance.accept)")
    _wrap(qwen3_5.Qwen3_5ForServing, "_open_ring", "_open_ring", static=True)
    _wrap(model_runner.ModelRunner, "execute", "runner.execute (inputs + forward)")
    _wrap(model_runner.ModelRunner, "stage", "runner.stage (host inputs)")
    _wrap(core.EngineCore, "_after_forward", "after the forward (sampling, spec, update, outputs)")
    _wrap(decoder.SpecDecoder, "after_sampling", "SpecDecoder.after_sampling")
    _wrap(batch_sampler.Sampler, "sample_planned", "sampler (sample_planned)")
    _wrap(batch_sampler.Sampler, "plan", "sampler.plan")
    orig = native_decode.NativeDecodeStep._fused_plan

    def plan(self, cache):
        return orig(self, cache) if _fused[0] else None

    native_decode.NativeDecodeStep._fused_plan = plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-python-drafter", action="store_true", help="skip the Python-passes configuration")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, kernel threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.1f}")
    _install()
    model = default_model.path()
    configs = [("off", None, True), (f"k={args.k}", args.k, True)]
    if not args.no_python_drafter:
        configs.append((f"k={args.k}, Python drafter", args.k, False))
    engines = {}
    for name, k, _ in configs:
        kw = dict(dtype="auto", max_model_len=1024, cpu_threads=args.threads, max_num_seqs=1)
        if k is not None:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        engines[name] = LLM(model, **kw)
    tok = engines["off"].engine.tokenizer
    prompt = tok.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows: dict[str, list[dict]] = defaultdict(list)
    outs: dict[str, list] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, k, fused in configs:
            _fused[0] = fused
            eng = engines[name].engine
            eng.add_request(f"r{r}", prompt, params)
            _acc.clear()
            _calls.clear()
            steps = 0
            t0 = time.thread_time_ns()
            done = []
            while eng.has_unfinished_requests():
                done += eng.step()
                steps += 1
            whole = time.thread_time_ns() - t0
            outs[name] = [o.outputs[0].token_ids for o in done if o.finished]
            if r == 0:
                continue
            row = {"steps": steps, "whole step": whole / steps / 1e3}
            row.update({lab: v / steps / 1e3 for lab, v in _acc.items()})
            row.update({f"calls/step {lab}": c / steps for lab, c in _calls.items()})
            rows[name].append(row)
    ref = outs["off"]
    for name in outs:
        if outs[name] != ref:
            sys.exit(f"greedy output differs between off and {name}")
    labels = sorted({lab for rs in rows.values() for row in rs for lab in row if not lab.startswith("calls")},
                    key=lambda s: (s != "steps", s != "whole step", s))
    print("| us per engine step (median of %d rounds) | " % args.rounds + " | ".join(n for n, _, _ in configs) + " |")
    print("|---|" + "---:|" * len(configs))
    for lab in labels:
        cells = []
        for name, _, _ in configs:
            vals = [row[lab] for row in rows[name] if lab in row]
            cells.append(f"{statistics.median(vals):.0f}" if vals else "")
        print(f"| {lab} | " + " | ".join(cells) + " |")
    off = statistics.median(row["whole step"] for row in rows["off"])
    off_steps = rows["off"][0]["steps"]
    for name, _, _ in configs[1:]:
        st = statistics.median(row["whole step"] for row in rows[name])
        n = rows[name][0]["steps"]
        print(f"{name}: step / off step {st / off:.2f}x; CPU tok/s on/off {off * off_steps / (st * n):.2f}x "
              f"({n} steps against {off_steps})")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
