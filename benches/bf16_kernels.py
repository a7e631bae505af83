"""bfloat16 on the native CPU path (issue 22): GEMMs and a whole decode step, side by side.

1. **Few-row GEMMs** at a model's projection shapes (fused DeltaNet in_proj, MLP gate+up
   and down, LM head) for decode-sized row counts: the native bfloat16 kernel
   (``native.linear_bf16``, ``vdpbf16ps`` where the CPU has AVX-512 BF16), torch's
   bfloat16 GEMM (oneDNN) on the same ``[out, in]`` weight, and the float32 path (the
   native few-row kernel on the column-major weight).
2. **Prefill GEMMs**: the bfloat16 model runs prefill-sized chunks through
   ``F.linear`` on the ``[out, in]`` weight; its time against the machine's ceiling
   for the shape, a plain ``torch.matmul`` of contiguous bfloat16 operands (oneDNN),
   and the native kernel's for reference.
3. **Decode step** of a random-weight model (16 sequences, one token each, after a
   prefill): float32, bfloat16 as before issue 22 (column-major bfloat16 weights,
   torch GEMMs, the DeltaNet recurrence as PyTorch ops) and bfloat16 now.

Every ratio is measured in one run, rounds alternated, medians reported; torch's
thread count is fixed (``--threads``) and printed.

    python benches/bf16_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hybridserve.kernels import native


def _timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


MINS: dict[str, float] = {}


def _alternate(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median seconds of each fn over ``rounds`` alternated rounds of ``reps`` calls (the
    minimum is kept in ``MINS``: on a shared machine it is the less disturbed figure)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k] += _timed(fn, reps)
    MINS.clear()
    MINS.update({k: min(v) for k, v in samples.items()})
    return {k: statistics.median(v) for k, v in samples.items()}


class _Ring:
    """Copies of a weight used in turn, together larger than the last-level cache: in a
    model every projection's weight comes from memory, not from a cache a benchmark
    loop would keep it in."""

    def __init__(self, w: torch.Tensor, nbytes: int = 96 << 20):
        self.ws = [w.clone() for _ in range(max(1, -(-nbytes // (w.numel() * w.element_size()))))]
        self.i = 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.ws)
        return self.ws[self.i]


def gemm_shapes(hidden: int, inter: int, vocab: int, lin_conv: int, lin_value: int, heads: int):
    return {
        "deltanet in_proj": (lin_conv + lin_value + 2 * heads, hidden),
        "mlp gate_up": (2 * inter, hidden),
        "mlp down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def bench_gemms(shapes, rows: list[int], rounds: int) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        g = torch.Generator().manual_seed(n + k)
        w = (0.02 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
        w16 = _Ring(w)
        w32 = _Ring(w.float().t().contiguous().t())  # the float32 path's column-major weight
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            x32 = x.float()
            fns = {
                "native_bf16": lambda: native.linear_bf16(x, w16()),
                "torch_bf16": lambda: F.linear(x, w16()),
                "native_f32": lambda: native.linear_few_rows(x32, w32()),
            }
            reps = 3 if n * k * m > 2e8 else 10
            t = _alternate(fns, rounds, reps)
            mins = dict(MINS)
            rec = {"gemm": name, "m": m, "n": n, "k": k, **{f"{a}_ms": v * 1e3 for a, v in t.items()},
                   **{f"{a}_min_ms": v * 1e3 for a, v in mins.items()},
                   "native_bf16_gflops": 2 * m * n * k / t["native_bf16"] / 1e9}
            out.append(rec)
            print(f"{name:17s} M={m:4d} N={n:6d} K={k:5d} median (min) ms: native bf16 {rec['native_bf16_ms']:.3f} "
                  f"({rec['native_bf16_min_ms']:.3f}), torch bf16 {rec['torch_bf16_ms']:.3f} "
                  f"({rec['torch_bf16_min_ms']:.3f}), native f32 {rec['native_f32_ms']:.3f} ({rec['native_f32_min_ms']:.3f})"
                  f" | f32/bf16 {t['native_f32'] / t['native_bf16']:.2f}x ({mins['native_f32'] / mins['native_bf16']:.2f}x)"
                  f"  torch/native bf16 {t['torch_bf16'] / t['native_bf16']:.2f}x "
                  f"({mins['torch_bf16'] / mins['native_bf16']:.2f}x)", flush=True)
    return out


def bench_prefill(shapes, m: int, rounds: int) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        if name == "lm_head":  # prefill computes the LM head for the sampled rows only
            continue
        g = torch.Generator().manual_seed(n * k)
        w = (0.02 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
        wt = w.t().contiguous()
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        fns = {
            "ceiling_matmul": lambda: torch.matmul(x, wt),
            "model_linear": lambda: F.linear(x, w),
            "native_bf16": lambda: native.linear_bf16(x, w),
        }
        t = _alternate(fns, rounds, 2)
        rec = {"gemm": name, "m": m, "n": n, "k": k, **{f"{a}_ms": v * 1e3 for a, v in t.items()},
               "ceiling_gflops": 2 * m * n * k / t["ceiling_matmul"] / 1e9,
               "model_fraction": t["ceiling_matmul"] / t["model_linear"],
               "native_fraction": t["ceiling_matmul"] / t["native_bf16"]}
        out.append(rec)
        print(f"prefill {name:17s} M={m} N={n} K={k}: ceiling (torch.matmul bf16) {rec['ceiling_matmul_ms']:.2f} ms "
              f"({rec['ceiling_gflops']:.1f} GF/s); model's F.linear {rec['model_linear_ms']:.2f} ms = "
              f"{rec['model_fraction']:.2f} of it; native kernel {rec['native_bf16_ms']:.2f} ms = "
              f"{rec['native_fraction']:.2f}", flush=True)
    return out


def _model(cfg, dtype, before: bool):
    from hybridserve.model.qwen3_5 import Qwen3_5ForServing

    torch.manual_seed(0)
    m = Qwen3_5ForServing(cfg, dtype=dtype)
    for p in m.parameters():
        p.data.normal_(0, 0.02)
    m.store_projections_column_major()
    if before and dtype == torch.bfloat16:  # the pre-issue-22 CPU layout: every projection column-major
        tied = m.embed_tokens.weight
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight is not tied:
                mod.weight.data = mod.weight.data.t().contiguous().t()
    return m


def bench_decode(cfg, seqs: int, ctx: int, rounds: int) -> dict:
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model.batch import ForwardBatch
    from hybridserve.model.cache import dtype_name
    from hybridserve.model.qwen3_5 import Projection

    variants = {"float32": (torch.float32, False), "bf16_before": (torch.bfloat16, True),
                "bf16_native": (torch.bfloat16, False)}
    steps = {}
    bs = 16
    nb = (ctx + rounds * 8 + 8) // bs + 1
    for name, (dt, before) in variants.items():
        model = _model(cfg, dt, before)
        sp = arena_layout(cfg, bs, dtype_name(dt)).state_pages
        cache = model.new_cache(seqs * (nb + sp), bs)
        bt = [list(range(b * nb, (b + 1) * nb)) for b in range(seqs)]
        st = [list(range(seqs * nb + b * sp, seqs * nb + (b + 1) * sp)) for b in range(seqs)]
        ids, pos, slots, qsl = [], [], [], [0]
        for b in range(seqs):
            ids += [(b * 7 + i) % 200 for i in range(ctx)]
            pos += list(range(ctx))
            slots += [b * nb * bs + i for i in range(ctx)]
            qsl.append(qsl[-1] + ctx)
        model(ForwardBatch.from_lists(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl,
                                      seq_lens=[ctx] * seqs, block_tables=bt, state_pages=st,
                                      has_initial_state=[False] * seqs, logits_indices=[q - 1 for q in qsl[1:]],
                                      device="cpu"), cache)
        dec = ForwardBatch.from_lists(
            input_ids=list(range(seqs)), positions=[ctx] * seqs, slot_mapping=[b * nb * bs + ctx for b in range(seqs)],
            query_start_loc=list(range(seqs + 1)), seq_lens=[ctx + 1] * seqs, block_tables=bt, state_pages=st,
            has_initial_state=[True] * seqs, logits_indices=list(range(seqs)), device="cpu")
        steps[name] = (model, cache, dec, before)

    def run(name):
        model, cache, dec, before = steps[name]
        if not before:
            return lambda: model(dec, cache)

        def f():
            saved = (Projection.NATIVE_MAX_ROWS_BF16, native.usable_bf16)
            Projection.NATIVE_MAX_ROWS_BF16, native.usable_bf16 = -1, (lambda *a: False)
            try:
                model(dec, cache)
            finally:
                Projection.NATIVE_MAX_ROWS_BF16, native.usable_bf16 = saved
        return f

    t = _alternate({k: run(k) for k in steps}, rounds, 3)
    rec = {f"{k}_ms": v * 1e3 for k, v in t.items()}
    rec.update({f"{k}_min_ms": v * 1e3 for k, v in MINS.items()})
    rec["f32_over_bf16_native"] = t["float32"] / t["bf16_native"]
    rec["bf16_before_over_native"] = t["bf16_before"] / t["bf16_native"]
    print(f"decode step, {seqs} sequences at ~{ctx} tokens: float32 {rec['float32_ms']:.1f} ms, bf16 before "
          f"{rec['bf16_before_ms']:.1f} ms, bf16 native {rec['bf16_native_ms']:.1f} ms  "
          f"(float32/bf16 {rec['f32_over_bf16_native']:.2f}x, before/now {rec['bf16_before_over_native']:.2f}x); "
          f"min: float32 {rec['float32_min_ms']:.1f}, before {rec['bf16_before_min_ms']:.1f}, "
          f"native {rec['bf16_native_min_ms']:.1f} ms", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", choices=["0.1b", "0.8b"], default="0.1b",
                    help="the issue's ~0.1B (hidden 768, 152K vocab) or ~0.8B (hidden 1024, 248K vocab) shapes")
    ap.add_argument("--layers", type=int, default=4, help="layers of the decode-step model (default 4)")
    ap.add_argument("--prefill-rows", type=int, default=1024)
    ap.add_argument("--only", choices=["all", "gemm", "prefill", "decode"], default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    from hybridserve.config import ModelConfig
    from hybridserve.model.tiny import FULL, LIN, text_config

    hidden, inter, vocab = (768, 3072, 151_936) if args.shape == "0.1b" else (1024, 3584, 248_320)
    heads, khd = 16, 128
    cfg = ModelConfig.from_dict(text_config(
        "bench", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=args.layers,
        layer_types=([LIN, LIN, LIN, FULL] * args.layers)[:args.layers], num_attention_heads=8,
        num_key_value_heads=2, head_dim=256 if args.shape == "0.8b" else 64, linear_num_key_heads=heads,
        linear_num_value_heads=heads, linear_key_head_dim=khd, linear_value_head_dim=khd, vocab_size=vocab))
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, kernel threads {native.threads()} "
          f"({native.pool()}), bf16 isa {native.bf16_isa()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    shapes = gemm_shapes(hidden, inter, vocab, cfg.linear_conv_dim, cfg.linear_value_dim, heads)
    if args.only in ("all", "gemm"):
        bench_gemms(shapes, [1, 16, 64], args.rounds)
    if args.only in ("all", "prefill"):
        bench_prefill(shapes, args.prefill_rows, max(2, args.rounds // 2))
    if args.only in ("all", "decode"):
        bench_decode(cfg, 16, 64, args.rounds)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
