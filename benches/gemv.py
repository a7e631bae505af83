"""Decode-sized GEMMs at the llama.cpp peer shapes (issue 22, one-sequence decode): how
fast each layout and kernel streams the weight, side by side in one process.

At one row a decode step's GEMM does one multiply-add per weight element loaded, so
its speed is the rate the weight streams from memory: reported as GB/s of weight read
(bytes of the weight / time), next to a plain streaming read of the same bytes
(``torch.sum`` over the row-major weight: the machine's rate for one pass).

Variants, each on its own ring of weight copies larger than the last-level cache (as
in a model, where every projection's weight comes from memory):

* ``f32_colmajor``: the float32 few-row kernel on the transposed ``[in, out]`` weight
  in huge-page memory (the CPU layout before this change, ``native.linear_few_rows``).
* ``f32_rows``: the dot-product kernel on the ``[out, in]`` weight
  (``native.linear_rows``); ``f32_rows_huge``: the same weight in huge-page memory
  (the layout the loader now keeps).
* ``f32_mkl``: torch's ``F.linear`` on the ``[out, in]`` weight (MKL; what runs past
  the native kernel's row limit).
* ``bf16_rows``: the bfloat16 kernel (``native.linear_bf16``) on the ``[out, in]``
  bfloat16 weight in huge-page memory (``bf16_rows_plain``: in ordinary pages).
* with ``--baseline-core`` (another build's ``_core``, e.g. of the branch point) also
  ``bf16_rows_before`` and ``f32_rows_before``: that build's bfloat16 and float32
  row kernels on the same huge-page weights as ``bf16_rows`` / ``f32_rows_huge``.

Rounds alternate the variants; medians (and minima) over all calls are printed, with
torch's and the kernels' thread count and the load average. ``--variants`` keeps a
subset (on a shared machine: fewer variants, more rounds of the ones compared).

    python benches/gemv.py --threads 2
    python benches/gemv.py --threads 2 --rows 1,2,16,64,128 --shape 0.1b
    python benches/gemv.py --threads 2 --baseline-core /tmp/base22/target/release/lib_core.so
    python benches/gemv.py --threads 2 --rows 1,2 --variants bf16_rows,bf16_rows_before,f32_rows_huge \
        --baseline-core /tmp/base_bf16/target/release/lib_core.so
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hybridserve.kernels import native
from hybridserve.model.hugepages import huge_page_empty


# (name, out, in) per shape: the model's decode GEMMs (fused DeltaNet in_proj, its
# out_proj, attention's fused qkv and o_proj, the MLP's gate+up and down, the tied LM
# head), from python/hybridserve/model/tiny.py's peer-0.1b / peer-0.8b.
SHAPES = {
    "0.1b": [("deltanet in_proj", 3104, 768), ("deltanet out_proj", 768, 1024),
             ("attn qkv", 2048, 768), ("attn o_proj", 768, 768),
             ("mlp gate_up", 4096, 768), ("mlp down", 768, 2048), ("lm_head", 151_936, 768)],
    "0.8b": [("deltanet in_proj", 8224, 1024), ("deltanet out_proj", 1024, 2048),
             ("attn qkv", 5120, 1024), ("attn o_proj", 1024, 2048),
             ("mlp gate_up", 7168, 1024), ("mlp down", 1024, 3584), ("lm_head", 248_320, 1024)],
}


class Ring:
    """Copies of a weight used in turn, together larger than the last-level cache."""

    def __init__(self, make, nbytes: int):
        first = make()
        per = first.numel() * first.element_size()
        self.ws = [first] + [make() for _ in range(max(1, -(-nbytes // per)) - 1)]
        self.i = 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.ws)
        return self.ws[self.i]


class Rings(dict):
    """Rings by name, each made the first time it is asked for."""

    def __init__(self, makers):
        super().__init__()
        self.makers = makers

    def __missing__(self, name):
        self[name] = ring = self.makers[name]()
        return ring


def huge_copy(w: torch.Tensor) -> torch.Tensor:
    new = huge_page_empty(tuple(w.shape), w.dtype)
    if new is None:
        return w.clone()
    new.copy_(w)
    return new


def huge_transposed(w: torch.Tensor) -> torch.Tensor:
    new = huge_page_empty((w.shape[1], w.shape[0]), w.dtype)
    if new is None:
        return w.t().contiguous().t()
    new.copy_(w.t())
    return new.t()


def timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(shape: str, rows: list[int], rounds: int, ring_bytes: int, baseline, keep: set[str] | None) -> list[dict]:
    records = []
    for name, n, k in SHAPES[shape]:
        g = torch.Generator().manual_seed(n + k)
        base = 0.02 * torch.randn(n, k, generator=g)
        b16 = base.to(torch.bfloat16)
        # Built on first use: a subset of variants needs only its own copies.
        rings = Rings({
            "f32_colmajor": lambda: Ring(lambda: huge_transposed(base), ring_bytes),
            "f32_rows": lambda: Ring(lambda: base.clone(), ring_bytes),
            "f32_rows_huge": lambda: Ring(lambda: huge_copy(base), ring_bytes),
            "bf16_rows": lambda: Ring(lambda: huge_copy(b16), ring_bytes // 2),
            "bf16_rows_plain": lambda: Ring(lambda: b16.clone(), ring_bytes // 2),
        })
        for m in rows:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            fns = {
                "stream_f32": lambda: rings["f32_rows"]().sum(),
                "f32_colmajor": lambda: native.linear_few_rows(x, rings["f32_colmajor"]()),
                "f32_rows": lambda: native.linear_rows(x, rings["f32_rows"]()),
                "f32_rows_huge": lambda: native.linear_rows(x, rings["f32_rows_huge"]()),
                "f32_mkl": lambda: F.linear(x, rings["f32_rows"]()),
                "bf16_rows": lambda: native.linear_bf16(xb, rings["bf16_rows"]()),
                "bf16_rows_plain": lambda: native.linear_bf16(xb, rings["bf16_rows_plain"]()),
            }
            if baseline is not None:
                def before(x=xb):
                    w = rings["bf16_rows"]()
                    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
                    baseline.matmul_bf16(native._bits(x), native._bits(w), native._bits(out))
                fns["bf16_rows_before"] = before

                def f32_before(x=x):
                    w = rings["f32_rows_huge"]()
                    out = torch.empty(x.shape[0], w.shape[0])
                    baseline.matmul_rows(native._np(x), native._np(w), native._np(out))
                fns["f32_rows_before"] = f32_before
            if m > 2:
                fns.pop("stream_f32")
            if keep is not None:
                fns = {v: fn for v, fn in fns.items() if v in keep}
            reps = max(3, min(20, int(2e8 / (n * k * max(m, 4)))))
            samples: dict[str, list[float]] = {v: [] for v in fns}
            for _ in range(rounds):
                for v, fn in fns.items():
                    samples[v] += timed(fn, reps)
            for v, ts in samples.items():
                med, best = statistics.median(ts), min(ts)
                nbytes = n * k * (2 if v.startswith("bf16") else 4)
                rec = {"shape": shape, "gemm": name, "n": n, "k": k, "m": m, "variant": v,
                       "ms": med * 1e3, "min_ms": best * 1e3, "gb_s": nbytes / med / 1e9,
                       "best_gb_s": nbytes / best / 1e9}
                records.append(rec)
                print(f"{shape} {name:17s} [{n:6d} x {k:4d}] M={m:3d} {v:16s} {med * 1e3:9.3f} ms "
                      f"(min {best * 1e3:8.3f})  {rec['gb_s']:5.1f} GB/s (best {rec['best_gb_s']:5.1f})",
                      flush=True)
            med = {v: statistics.median(ts) for v, ts in samples.items()}
            if {"f32_colmajor", "f32_rows_huge", "f32_mkl"} <= med.keys():
                new = med["f32_rows_huge"]
                print(f"   f32 rows (huge pages) vs column-major: {med['f32_colmajor'] / new:.2f}x"
                      f"   vs MKL: {med['f32_mkl'] / new:.2f}x", flush=True)
            if {"f32_rows_huge", "f32_rows_before"} <= med.keys():
                print(f"   f32 rows (huge pages) vs the baseline build: "
                      f"{med['f32_rows_before'] / med['f32_rows_huge']:.2f}x", flush=True)
            if {"bf16_rows", "bf16_rows_before"} <= med.keys():
                print(f"   bf16 rows vs the baseline build: {med['bf16_rows_before'] / med['bf16_rows']:.2f}x",
                      flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="0.1b,0.8b")
    ap.add_argument("--rows", default="1,2,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ring-mib", type=int, default=96, help="bytes of weight copies per ring (> the L3)")
    ap.add_argument("--baseline-core", default=None, help="another build's _core (bf16_rows_before)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of: stream_f32, f32_colmajor, f32_rows, f32_rows_huge, f32_mkl, "
                         "bf16_rows, bf16_rows_plain, bf16_rows_before, f32_rows_before (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    baseline = None
    if args.baseline_core:
        from bf16_kernels import load_baseline  # benches/ is the script's folder
        baseline = load_baseline(args.baseline_core)
    print(f"torch threads {torch.get_num_threads()}, kernel threads {native.threads()} ({native.pool()}), "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    records = []
    for shape in args.shape.split(","):
        keep = set(args.variants.split(",")) if args.variants else None
        records += run(shape, [int(r) for r in args.rows.split(",")], args.rounds, args.ring_mib << 20, baseline, keep)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
