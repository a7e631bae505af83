"""The bfloat16 MoE block on packed experts against HF's layout, in one process (issue 18).

Two sets of ``benches/moe_layer.py``'s ``moe-bench`` layers (8 per set, the same seeds,
so the same weights): one as the model runs it (``SparseMoeBlock.PACK_BF16``: the experts
packed in place at the first call, the native block at every token count), one with
``PACK_BF16`` off on the instance (HF's layout: the native block up to
``NATIVE_MAX_TOKENS_BF16`` tokens with the shared expert in the call up to
``SHARED_NATIVE_MAX_ROWS_BF16`` rows, torch's grouped GEMMs past that; the previous
round's paths). Alternating rounds, thread CPU ms per layer, medians; torch and kernel
threads 1; the outputs' largest difference relative to their scale (GEMM summation
order only).

    python benches/moe_bf16_pack_ab.py --tokens 1,8,16,32,64,256,768,2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # noqa: E402  (this folder's bench: the layers)

from hybridserve.kernels import native  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,16,32,64,256,768,2048")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    native.set_threads(1)
    packed, _, _ = moe_layer.build("moe-bench", 8, torch.bfloat16)
    plain, _, _ = moe_layer.build("moe-bench", 8, torch.bfloat16)
    for m in plain:
        m.PACK_BF16 = False
    print(f"torch threads 1, kernel threads 1, bfloat16 ISA {native.bf16_isa()}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'tokens':>6} {'packed ms':>10} {'HF layout ms':>13} {'speedup':>8} {'max rel diff':>13}")
    for t in [int(v) for v in a.tokens.split(",")]:
        x = [torch.randn(t, 256, generator=torch.Generator().manual_seed(j)).to(torch.bfloat16) for j in range(8)]
        res = {"packed": [], "plain": []}
        reps = max(2, 100 // t)
        for _ in range(a.rounds):
            for side, layers in (("packed", packed), ("plain", plain)):
                t0 = time.thread_time()
                for _ in range(reps):
                    for j, m in enumerate(layers):
                        m(x[j])
                res[side].append((time.thread_time() - t0) / reps / len(layers) * 1e3)
        with torch.no_grad():
            diff = max(float((p(x[0]).float() - q(x[0]).float()).abs().max() / q(x[0]).float().abs().max())
                       for p, q in zip(packed, plain))
        p, q = statistics.median(res["packed"]), statistics.median(res["plain"])
        print(f"{t:>6} {p:>10.3f} {q:>13.3f} {q / p:>7.2f}x {diff:>13.4f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
