"""Per-call time of the bfloat16 few-row GEMM (hybridserve._core.matmul_bf16) at the
default model's projection shapes, 1/2/4/5 rows, one thread: the median over
batches of thread CPU time per call, and each row count's ratio to 1 row measured
side by side in the same batch loop (the machine is shared, so wall time is noisy)."""
import os
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYBRIDSERVE_THREADS", "1")
import argparse, statistics, time
import numpy as np
import torch
from hybridserve._core import kernels as _k
from hybridserve.kernels import native

SHAPES = [  # (N, K, name) of python/hybridserve/default_model
    (128, 192, "k/v_proj"), (256, 192, "in_proj_z"), (512, 192, "q/qkv/gate/up"),
    (784, 192, "in_proj fused"), (1024, 192, "gate_up"), (192, 256, "o/out_proj"),
    (192, 512, "down"), (8192, 192, "lm head"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rows", default="1,2,4,5")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    torch.set_num_threads(1)
    native.set_threads(1)
    print(f"torch threads {torch.get_num_threads()}, batches {a.batches} x {a.calls} calls")
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':>22} " + " ".join(f"{m:>4}r us" for m in rows) + "  " + " ".join(f"{m}r/1r" for m in rows[1:]))
    for n, k, name in SHAPES:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16).view(torch.uint16).numpy()
        xs = {m: torch.randn(m, k, generator=g).to(torch.bfloat16).view(torch.uint16).numpy() for m in rows}
        outs = {m: np.empty((m, n), np.float32) for m in rows}
        calls = max(20, a.calls * 192 * 512 // (n * k))
        per = {m: [] for m in rows}
        for _ in range(a.batches):
            for m in rows:
                x, o = xs[m], outs[m]
                t0 = time.thread_time_ns()
                for _ in range(calls):
                    _k.matmul_bf16(x, w, o)
                per[m].append((time.thread_time_ns() - t0) / calls / 1e3)
        med = {m: statistics.median(per[m]) for m in rows}
        ratio = {m: statistics.median(p / q for p, q in zip(per[m], per[rows[0]])) for m in rows[1:]}
        print(f"{n:>5}x{k:<4} {name:>12} " + " ".join(f"{med[m]:7.2f}" for m in rows) + "  "
              + " ".join(f"{ratio[m]:5.2f}" for m in rows[1:]))


if __name__ == "__main__":
    main()
