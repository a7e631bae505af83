"""FP8 and int4 (AWQ) safetensors weights on the CPU's native few-row kernels, against
the bfloat16 native GEMM on the same shapes (issue 35).

The projections of the ``peer-0.8b`` preset (Qwen3.5-0.8B's text shape): the fused
DeltaNet in_proj, its out_proj, attention's fused qkv and o_proj, the MLP's fused
gate+up and down. For 1 and 16 rows of bfloat16 activations: the native bfloat16 kernel
on a bfloat16 weight (``native.linear_bf16``, what a dequantized-at-load checkpoint
runs), the FP8 kernel on the e4m3 bytes and block scales, and the int4 kernel on the
packed nibbles (group size 128). Weight bytes read per call are printed beside the
times; the ratio is bf16 time / quantized time (above 1: the quantized kernel is faster).

Rounds alternate the kernels; medians of this thread's CPU time; one kernel thread and
one torch thread (fixed and printed).

    python benches/quant_safetensors.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridserve.kernels import native
from hybridserve.model.tiny import text_config
from hybridserve.quant.awq import AWQWeight
from hybridserve.quant.fp8 import FP8BlockWeight
from hybridserve.quant.tiny import awq_quantize, fp8_quantize


def shapes(preset: str) -> list[tuple[str, int, int]]:
    c = text_config(preset)
    h, i = c["hidden_size"], c["intermediate_size"]
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    conv = 2 * nk * kd + nv * vd
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    # The fused DeltaNet in_proj without its two per-head rows (a / b stay bfloat16 in
    # Qwen's quantized checkpoints).
    return [("deltanet.in_proj(qkv|z)", conv + nv * vd, h), ("deltanet.out_proj", h, nv * vd),
            ("attn.qkv_proj", 2 * q + 2 * kv, h), ("attn.o_proj", h, q),
            ("mlp.gate_up_proj", 2 * i, h), ("mlp.down_proj", h, i)]


# This thread's CPU time: the machine is shared, and the kernels run on this one thread
# (one kernel thread), so CPU time is what each took without the waits other
# processes impose (cache and memory contention remain).
CLOCK = time.thread_time


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = CLOCK()
        fn()
        out.append(CLOCK() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="peer-0.8b")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    native.set_threads(1)
    from hybridserve._core import kernels as k
    print(f"torch threads {torch.get_num_threads()}, kernel threads {native.threads()}, "
          f"bf16 isa {native.bf16_isa()}, quant isa {k.fp8_awq_isa()}, preset {a.preset}")
    print(f"{'projection':26s} {'[out, in]':>13s} {'rows':>4s} {'bf16 us':>9s} {'fp8 us':>9s} {'int4 us':>9s} "
          f"{'bf16/fp8':>8s} {'bf16/int4':>9s}  MB bf16/fp8/int4")
    gen = torch.Generator().manual_seed(0)
    totals: dict[int, list[float]] = {}
    for name, n, kk in shapes(a.preset):
        w = torch.randn(n, kk, generator=gen) * 0.02
        wb = w.to(torch.bfloat16).contiguous()
        q, s, _ = fp8_quantize(w)
        f8 = FP8BlockWeight(q, s)
        qw, qz, sc, _ = awq_quantize(w, 128)
        i4 = AWQWeight.from_awq(qw, qz, sc, 128)
        mb = (wb.numel() * 2 / 1e6, f8.nbytes / 1e6, i4.nbytes / 1e6)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, kk, generator=gen).to(torch.bfloat16)
            fns = {"bf16": lambda: native.linear_bf16(x, wb), "fp8": lambda: f8.native(x),
                   "int4": lambda: i4.native(x)}
            for fn in fns.values():
                assert fn() is not None
            t = {key: [] for key in fns}
            for _ in range(a.rounds):
                for key, fn in fns.items():
                    t[key].append(statistics.median(timed(fn, a.reps)))
            med = {key: statistics.median(v) * 1e6 for key, v in t.items()}
            tot = totals.setdefault(m, [0.0, 0.0, 0.0])
            for idx, key in enumerate(("bf16", "fp8", "int4")):
                tot[idx] += med[key]
            print(f"{name:26s} {str([n, kk]):>13s} {m:4d} {med['bf16']:9.1f} {med['fp8']:9.1f} {med['int4']:9.1f} "
                  f"{med['bf16'] / med['fp8']:8.2f} {med['bf16'] / med['int4']:9.2f}  "
                  f"{mb[0]:.1f}/{mb[1]:.1f}/{mb[2]:.1f}")
    for m, (b, f, i) in totals.items():
        print(f"all six, {m} rows: bf16 {b:.0f} us, fp8 {f:.0f} us ({b / f:.2f}x), int4 {i:.0f} us ({b / i:.2f}x)")


if __name__ == "__main__":
    main()
