"""The MoE layer of two builds of the native extension in one process (issue 18).

Between processes the MoE layer's time moves more than most kernel changes do (where
each process's 300 MB of expert weights land decides a run; see benches/RESULTS.md,
"Issue 18: the MoE layer at 8-64 tokens"), so a before/after from two runs of
``benches/moe_layer.py`` shows little. This loads a second build of
``hybridserve._core`` (``--before``: the ``.so`` of another tree) beside the installed
one and times both on ``benches/moe_layer.py``'s layers (``moe-bench``, 8 layers
cycled) and the dense MLP in alternating rounds: thread CPU ms per layer, medians,
torch and kernel threads 1. Both builds must take the same ``moe_block`` arguments;
their outputs are checked to agree before timing.

    mkdir -p /tmp/before && git archive <commit> | tar -x -C /tmp/before
    (cd /tmp/before && maturin build --release -q -m rust/python/Cargo.toml -o wheel)
    unzip -j -o /tmp/before/wheel/*.whl 'hybridserve/_core*.so' -d /tmp/before
    python benches/moe_layer_ab.py --before /tmp/before/_core.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # noqa: E402  (this folder's bench: the layers and the dense side)
from bf16_kernels import load_baseline  # noqa: E402  (another build's kernels beside this one)

from hybridserve.kernels import native  # noqa: E402
from hybridserve.kernels.native import _np, _weight_view  # noqa: E402


def moe_call(k, m, x: torch.Tensor) -> torch.Tensor:
    """``SparseMoeBlock.forward``'s native path through the build ``k``."""
    t = x.shape[0]
    out = torch.empty(t, x.shape[1])
    ids = torch.empty(t, m.top_k, dtype=torch.int64)
    w = torch.empty(t, m.top_k)
    fused = t <= m.SHARED_NATIVE_MAX_ROWS
    opt = {}
    if fused:
        opt = dict(shared_w13=_weight_view(m.shared_expert.gate_up_proj.weight),
                   shared_w2=_weight_view(m.shared_expert.down_proj.weight),
                   shared_gate=_np(m.shared_expert_gate.weight.reshape(-1)))
    k.moe_block(_np(x), _weight_view(m.gate.weight), _np(m.experts.w13), _np(m.experts.w2), int(m.top_k),
                _np(out), ids.numpy(), _np(w), **opt)
    if not fused:
        out.addcmul_(torch.sigmoid(m.shared_expert_gate(x)), m.shared_expert(x))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="path of the other build's _core*.so")
    ap.add_argument("--tokens", default="1,8,16,32,64,256")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    before, after = load_baseline(a.before), native._k
    torch.set_num_threads(1)
    native.set_threads(1)
    before.set_kernel_threads(1)
    print(f"torch threads {torch.get_num_threads()}, kernel threads {after.kernel_threads()} (installed) / "
          f"{before.kernel_threads()} (--before), pool {native.pool()}; load average {os.getloadavg()[0]:.1f}")
    moes, denses, h = moe_layer.build("moe-bench", 8)
    print(f"{'tokens':>7} {'dense':>8} {'before':>8} {'after':>8} {'after/before':>13} "
          f"{'before/dense':>13} {'after/dense':>12}   (thread CPU ms per layer)")
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            got = [torch.cat([moe_call(k, m, x) for m in moes]) for k in (after, before)]
            if not torch.allclose(got[0], got[1], rtol=1e-4, atol=1e-5):
                raise SystemExit(f"{t} tokens: the two builds disagree by {(got[0] - got[1]).abs().max():.3g}")
            fns = [lambda: [d(x) for d in denses],
                   lambda: [moe_call(before, m, x) for m in moes],
                   lambda: [moe_call(after, m, x) for m in moes]]
            times = [[] for _ in fns]
            reps = max(1, min(8, 200 // t))
            for f in fns:
                f()
            for _ in range(a.rounds):
                for i, f in enumerate(fns):
                    for _ in range(reps):
                        c0 = time.thread_time()
                        f()
                        times[i].append((time.thread_time() - c0) * 1e3 / len(moes))
        d, bf, af = (statistics.median(v) for v in times)
        print(f"{t:>7} {d:>8.3f} {bf:>8.3f} {af:>8.3f} {af / bf:>13.3f} {bf / d:>13.2f} {af / d:>12.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
