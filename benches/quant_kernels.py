"""Native kernels on llama.cpp's quantized blocks (issue 35) against the native bfloat16
GEMM, at the projection shapes of the llama.cpp side-by-side bench's presets.

1. **Few-row GEMMs** (decode: 1 and 16 rows) at ``peer-0.1b`` / ``peer-0.8b``'s shapes
   (fused DeltaNet ``in_proj_qkvz``, MLP ``gate_up`` and ``down``, the tied LM head):
   ``hybridserve.kernels.quant.matmul`` per GGML type against ``native.linear_bf16`` on
   the bfloat16 weight, bfloat16 activations both. Reported: milliseconds, GB/s of
   weight bytes read (the decode bound), and the speed-up over bfloat16.
2. **Crossover** (``--only crossover``): for the prefill path, the few-row native GEMM
   and the many-row int8 GEMM (``quant.matmul_prefill``) against dequantized tiles into
   torch's GEMM as rows grow, per type; sets ``hybridserve.quant.tiles.NATIVE_MAX_ROWS``
   and ``hybridserve.quant.ggml.PREFILL_INT8_ISAS``.

Every weight is used from a ring of copies larger than the last-level cache (a model's
weights come from memory); ratios are measured in one run, rounds alternated, medians
reported; torch's and the kernels' thread count fixed (``--threads``) and printed.
Weights are random valid blocks (the kernels' time does not depend on the values).

    python benches/quant_kernels.py --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from hybridserve.kernels import native
from hybridserve.kernels import quant as qk
from hybridserve.quant.ggml import GGML_TYPES, GGMLWeight

SHAPES = {
    "peer-0.1b": {"in_proj_qkvz": (3072, 768), "gate_up": (4096, 768), "down": (768, 2048),
                  "lm_head": (151_936, 768)},
    "peer-0.8b": {"in_proj_qkvz": (8192, 1024), "gate_up": (7168, 1024), "down": (1024, 3584),
                  "lm_head": (248_320, 1024)},
}
RING_BYTES = 96 << 20


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random quant bytes (any bit pattern is a valid block) with small float16 scales."""
    t = GGML_TYPES[qtype]
    data = rng.integers(0, 256, (n * k // t.block_size, t.block_bytes), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    at = {"q8_0": [0], "q4_0": [0], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}[qtype]
    for a in at:
        data[:, a:a + 2] = half
    if qtype == "q8_0":
        data[:, 2:][data[:, 2:] == 0x80] = 0x81   # llama.cpp writes |q| <= 127
    return torch.from_numpy(data.reshape(n, -1))


class Ring:
    def __init__(self, make, nbytes_each: int):
        self.items = [make() for _ in range(max(1, -(-RING_BYTES // nbytes_each)))]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


# Wall-clock time, or with ``--clock thread`` this thread's CPU time: at one thread the
# kernels and torch run on the calling thread, and on a machine other jobs load the time
# spent descheduled then does not count.
CLOCK = time.perf_counter


def timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        out.append(CLOCK() - t0)
    return out


def alternate(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k] += timed(fn, reps)
    return {k: statistics.median(v) for k, v in samples.items()}


def gemm_table(threads: list[int], presets: list[str], types: list[str], rows_list: list[int],
               rounds: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    print("| preset | projection | N x K | threads | rows | kernel | ms | weight GB/s | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in presets:
        for name, (n, k) in SHAPES[preset].items():
            wb = Ring(lambda: (torch.randn(n, k) * 0.02).to(torch.bfloat16), n * k * 2)
            wq = {t: Ring(lambda t=t: random_blocks(t, n, k, rng), n * k * GGML_TYPES[t].block_bytes
                          // GGML_TYPES[t].block_size) for t in types}
            for th in threads:
                torch.set_num_threads(th)
                native.set_threads(th)
                for rows in rows_list:
                    x = torch.randn(rows, k).to(torch.bfloat16)
                    fns = {"bf16": lambda: native.linear_bf16(x, wb.next())}
                    for t in types:
                        gid = GGML_TYPES[t].ggml_id
                        fns[t] = lambda t=t, gid=gid: qk.matmul(x, wq[t].next(), gid)
                    med = alternate(fns, rounds, reps)
                    for kname, sec in med.items():
                        nbytes = n * k * 2 if kname == "bf16" else wq[kname].items[0].numel()
                        print(f"| {preset} | {name} | {n} x {k} | {th} | {rows} | {kname} | {sec * 1e3:.3f} | "
                              f"{nbytes / sec / 1e9:.1f} | {med['bf16'] / sec:.2f}x |", flush=True)
            del wb, wq


def crossover(threads: list[int], types: list[str], rows_list: list[int], rounds: int, reps: int) -> None:
    from hybridserve.quant import tiles

    rng = np.random.default_rng(1)
    n, k = SHAPES["peer-0.1b"]["gate_up"]
    print("\n| type | threads | rows | few-row GEMM ms | int8 prefill GEMM ms | dequantized tiles + torch ms "
          "| few-row / tiles | int8 prefill / tiles |")
    print("|---|---|---|---|---|---|---|---|")
    for t in types:
        w = GGMLWeight(t, random_blocks(t, n, k, rng), (n, k))
        for th in threads:
            torch.set_num_threads(th)
            native.set_threads(th)
            for rows in rows_list:
                x = torch.randn(rows, k).to(torch.bfloat16)

                def tiles_path():
                    from hybridserve.quant import ggml as g
                    old = tiles.NATIVE_MAX_ROWS.get(t), g.PREFILL_INT8_ISAS
                    tiles.NATIVE_MAX_ROWS[t], g.PREFILL_INT8_ISAS = 0, ()
                    try:
                        return w.linear(x)
                    finally:
                        tiles.NATIVE_MAX_ROWS[t], g.PREFILL_INT8_ISAS = old
                med = alternate({"native": lambda: qk.matmul(x, w.data, w.type.ggml_id),
                                 "int8": lambda: qk.matmul_prefill(x, w.data, w.type.ggml_id),
                                 "tiles": tiles_path}, rounds, reps)
                print(f"| {t} | {th} | {rows} | {med['native'] * 1e3:.2f} | {med['int8'] * 1e3:.2f} | "
                      f"{med['tiles'] * 1e3:.2f} | {med['native'] / med['tiles']:.2f} | "
                      f"{med['int8'] / med['tiles']:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--presets", nargs="+", default=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=list(GGML_TYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--cross-rows", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=["gemm", "crossover"])
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    a = ap.parse_args()
    if a.clock == "thread":
        if a.threads != [1]:
            raise SystemExit("--clock thread measures one thread: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    if not qk.available():
        raise SystemExit("the extension lacks the quantized kernels: rebuild (pip install -e .)")
    print(f"torch threads: {a.threads}; quant ISA: {qk.isa()}; bf16 ISA: {native.bf16_isa()}; "
          f"torch {torch.__version__}; clock: {a.clock}; load average: {os.getloadavg()}")
    if a.only != "crossover":
        gemm_table(a.threads, a.presets, a.types, a.rows, a.rounds, a.reps)
    if a.only != "gemm":
        crossover(a.threads, a.types, a.cross_rows, a.rounds, a.reps)


if __name__ == "__main__":
    main()
