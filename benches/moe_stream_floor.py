"""The MoE layer against the time to merely read the weights it must read (CPU).

At a few tokens per expert the routed experts are bound by streaming their weights
from memory once per step; this puts the MoE layer (``benches/moe_layer.py``'s
``moe-bench`` shape, the same 8 layers of weights cycled) beside two reads of the
same memory on the same thread, in interleaved rounds: a ``sum`` over each active
expert's two tensors plus the shared expert's (the bytes the layer must read, one
torch call per tensor, so it carries ~100 small calls of Python overhead), and a
``sum`` over all experts' tensors of the layer in two calls (the machine's streaming
rate on that memory). Times are the calling thread's CPU time per layer (every op
runs inline on it with one thread), medians.

    python benches/moe_stream_floor.py --tokens 16,32
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--min-s", type=float, default=1.0)
    a = ap.parse_args(argv)
    from hybridserve.kernels import native

    torch.set_num_threads(1)
    native.set_threads(1)
    moes, _, h = moe_layer.build("moe-bench", a.layers)
    _, e, k, i, si = moe_layer.SHAPES["moe-bench"]
    nl = len(moes)
    print(f"torch threads {torch.get_num_threads()}, native kernel threads {native.threads()}; "
          f"load average {os.getloadavg()[0]:.1f}; thread CPU ms per layer, medians")
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t))
        active = [torch.topk(x @ m.gate.weight.t(), k).indices.reshape(-1).unique().tolist() for m in moes]

        def moe():
            for m in moes:
                m(x)

        def read_active():
            for m, ids in zip(moes, active):
                for j in ids:
                    m.experts.w13[j].sum()
                    m.experts.w2[j].sum()
                m.shared_expert.gate_up_proj.weight.sum()
                m.shared_expert.down_proj.weight.sum()

        def read_all():
            for m in moes:
                m.experts.w13.sum()
                m.experts.w2.sum()

        with torch.no_grad():
            res = moe_layer._interleaved([moe, read_active, read_all], 14, a.min_s, rounds=7)
        n_act = sum(len(ids) for ids in active) / nl
        mb_act = (n_act * 3 * h * i + 3 * h * si) * 4 / 1e6
        mb_all = e * 3 * h * i * 4 / 1e6
        (_, mc), (_, ac), (_, lc) = res
        print(f"{t:>5} tokens: MoE layer {mc / nl:.3f} | read active experts + shared ({n_act:.0f} experts, "
              f"{mb_act:.1f} MB) {ac / nl:.3f} | read all experts ({mb_all:.1f} MB) {lc / nl:.3f} "
              f"-> at that rate the active bytes take {lc / nl * mb_act / mb_all:.3f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
