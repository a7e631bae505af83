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
   torch GEMMs, the DeltaNet recurrence as PyTorch ops), bfloat16 as after issue 22's
   first round (``bf16_round1``: the DeltaNet mixer on float32 copies of its inputs,
   SDPA on float32 copies; with ``--baseline-core``, that build's kernels too) and
   bfloat16 now. **Prefill step** (4 prompts of 256 tokens): the same variants but
   the pre-issue-22 one.
4. **Delta rule** alone (``--only deltarule``): the bfloat16 mixer reading its
   inputs in place against the first round's float32 copies, at decode and prefill
   sizes; with ``--baseline-core`` also the float32 kernel of this build against
   that build's (the float32 path must not slow down).
5. **Prefill attention** alone (``--only attention``): SDPA groups on the gathered
   bfloat16 blocks against SDPA on float32 copies of them (the first round).
6. **conv1d and RMSNorm** (``--only convnorm``, needs ``--baseline-core``): this
   build's kernels (one loop over ``Elem`` for both precisions) against that build's
   (separate float32 and bfloat16 files), float32 and bfloat16.

``--baseline-core PATH``: another build's ``_core`` extension (e.g. of the branch
point: ``git archive <commit> Cargo.toml Cargo.lock rust | tar -x -C /tmp/base`` then
``cargo build --release -p hybridserve-py --features pyo3/extension-module`` there,
``PATH`` = its ``target/release/lib_core.so``), loaded beside this one.

Every ratio is measured in one run, rounds alternated, medians reported; torch's
thread count is fixed (``--threads``) and printed.

    python benches/bf16_kernels.py --threads 2
    python benches/bf16_kernels.py --threads 2 --only deltarule --baseline-core /tmp/base/target/release/lib_core.so
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hybridserve.kernels import native


CLOCK = time.perf_counter  # --cpu-time: time.thread_time (this thread's CPU time; meaningful at 1 thread)


def _timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        out.append(CLOCK() - t0)
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


BASELINE = None  # another build's kernels module (--baseline-core), or None


def load_baseline(path: str):
    """Load another build's ``_core`` extension beside this one and hand it torch's
    OpenMP workers and the thread count, as ``hybridserve.kernels.native`` does."""
    import ctypes
    import importlib.machinery
    import importlib.util
    import re

    name = "hybridserve_baseline._core"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(mod)
    k = mod.kernels
    if native.pool() == "openmp":
        with open("/proc/self/maps") as f:
            lib = ctypes.CDLL(sorted(set(re.findall(r"(/\S*libgomp[^/\s]*\.so[^/\s]*)", f.read())))[0])
        k._use_openmp(ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value,
                      ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value)
    k.set_kernel_threads(native.threads())
    return k


def mixer_round1(q, k, v, a, b, A_log, dt_bias, z, norm_weight, norm_eps, state, query_start_loc, state_pages,
                 has_initial_state, scale, *, key_heads, value_heads, item_base, checkpoint_positions=None,
                 checkpoint_pages=None, plans=None):
    """The first round's bfloat16 DeltaNet mixer: the float32 kernel on float32 copies."""
    from hybridserve.kernels import ops

    varlen = ops._varlen(plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions,
                         checkpoint_pages)
    o = native.gated_delta_rule(
        q.float(), k.float(), v.float(), state, varlen, key_heads=key_heads, value_heads=value_heads, scale=scale,
        a=a.float(), b=b.float(), A_log=A_log.float(), dt_bias=dt_bias.float(), z=z.float(),
        norm_weight=norm_weight.float(), norm_eps=norm_eps, item_base=item_base)
    return o.to(q.dtype)


def attention_round1(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, plan):
    """The first round's CPU attention: decodes native, SDPA groups on float32 copies."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    if plan.decode is not None:
        native.paged_attention_decode(q, k_cache, v_cache, *plan.decode, scale, out)
    qf = q.float()
    for grp in plan.groups:
        n, ql, length, tables = grp["n"], grp["q"], grp["len"], grp["tables"]
        nb = tables.shape[1]
        qg = qf.index_select(0, grp["rows"]).view(n, ql, hq, d).transpose(1, 2)
        flat = tables.reshape(-1)
        kg = k_cache.index_select(0, flat).view(n, nb * block_size, hkv, d)[:, :length].transpose(1, 2)
        vg = v_cache.index_select(0, flat).view(n, nb * block_size, hkv, d)[:, :length].transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg.float(), vg.float(), attn_mask=grp["mask"],
                                            is_causal=grp["causal"], scale=scale, enable_gqa=hq != hkv)
        og = og.transpose(1, 2).reshape(n * ql, hq, d)
        if grp["out_pos"] is not None:
            og = og.index_select(0, grp["out_pos"])
        out.index_copy_(0, grp["out_rows"], og.to(out.dtype))
    return out


class _Round1:
    """Context: the model runs as after issue 22's first round (mixer and SDPA on
    float32 copies; the baseline build's kernels when one is loaded)."""

    def __enter__(self):
        from hybridserve.kernels import ops

        self.saved = (ops.gated_delta_net_mixer, ops.paged_attention_cpu, native._k)
        ops.gated_delta_net_mixer, ops.paged_attention_cpu = mixer_round1, attention_round1
        if BASELINE is not None:
            native._k = BASELINE

    def __exit__(self, *exc):
        from hybridserve.kernels import ops

        ops.gated_delta_net_mixer, ops.paged_attention_cpu, native._k = self.saved


def _model(cfg, dtype, before: bool):
    from hybridserve.model.qwen3_5 import Qwen3_5ForServing

    torch.manual_seed(0)
    m = Qwen3_5ForServing(cfg, dtype=dtype)
    for p in m.parameters():
        p.data.normal_(0, 0.02)
    m.store_cpu_layout()
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
                "bf16_round1": (torch.bfloat16, "round1"), "bf16_native": (torch.bfloat16, False)}
    steps = {}
    bs = 16
    nb = (ctx + rounds * 8 + 8) // bs + 1
    for name, (dt, before) in variants.items():
        model = _model(cfg, dt, before is True)
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
        if before == "round1":
            def r1():
                with _Round1():
                    model(dec, cache)
            return r1

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
    rec["bf16_round1_over_native"] = t["bf16_round1"] / t["bf16_native"]
    print(f"decode step, {seqs} sequences at ~{ctx} tokens: float32 {rec['float32_ms']:.1f} ms, bf16 before "
          f"{rec['bf16_before_ms']:.1f} ms, bf16 round 1 {rec['bf16_round1_ms']:.1f} ms, bf16 native "
          f"{rec['bf16_native_ms']:.1f} ms  (float32/bf16 {rec['f32_over_bf16_native']:.2f}x, before/now "
          f"{rec['bf16_before_over_native']:.2f}x, round 1/now {rec['bf16_round1_over_native']:.2f}x); "
          f"min: float32 {rec['float32_min_ms']:.1f}, before {rec['bf16_before_min_ms']:.1f}, round 1 "
          f"{rec['bf16_round1_min_ms']:.1f}, native {rec['bf16_native_min_ms']:.1f} ms", flush=True)
    return rec


def bench_prefill_step(cfg, seqs: int, length: int, rounds: int) -> dict:
    """One prefill step of ``seqs`` fresh prompts of ``length`` tokens: float32, bfloat16
    as after the first round (``_Round1``) and bfloat16 now."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model.batch import ForwardBatch
    from hybridserve.model.cache import dtype_name

    bs = 16
    nb = -(-length // bs)
    steps = {}
    for name, dt in {"float32": torch.float32, "bf16_round1": torch.bfloat16, "bf16_native": torch.bfloat16}.items():
        model = _model(cfg, dt, False)
        sp = arena_layout(cfg, bs, dtype_name(dt)).state_pages
        cache = model.new_cache(seqs * (nb + sp), bs)
        ids, pos, slots, qsl = [], [], [], [0]
        for b in range(seqs):
            ids += [(b * 7 + i) % 200 for i in range(length)]
            pos += list(range(length))
            slots += [b * nb * bs + i for i in range(length)]
            qsl.append(qsl[-1] + length)
        batch = ForwardBatch.from_lists(
            input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=[length] * seqs,
            block_tables=[list(range(b * nb, (b + 1) * nb)) for b in range(seqs)],
            state_pages=[list(range(seqs * nb + b * sp, seqs * nb + (b + 1) * sp)) for b in range(seqs)],
            has_initial_state=[False] * seqs, logits_indices=[q - 1 for q in qsl[1:]], device="cpu")
        steps[name] = (model, cache, batch)

    def run(name):
        model, cache, batch = steps[name]
        if name == "bf16_round1":
            def r1():
                with _Round1():
                    model(batch, cache)
            return r1
        return lambda: model(batch, cache)

    t = _alternate({k: run(k) for k in steps}, rounds, 1)
    rec = {f"{k}_ms": v * 1e3 for k, v in t.items()}
    rec.update({f"{k}_min_ms": v * 1e3 for k, v in MINS.items()})
    print(f"prefill step, {seqs} prompts of {length} tokens: float32 {rec['float32_ms']:.0f} ms, bf16 round 1 "
          f"{rec['bf16_round1_ms']:.0f} ms, bf16 native {rec['bf16_native_ms']:.0f} ms  (round 1/now "
          f"{t['bf16_round1'] / t['bf16_native']:.2f}x, float32/bf16 {t['float32'] / t['bf16_native']:.2f}x); min: "
          f"{rec['float32_min_ms']:.0f} / {rec['bf16_round1_min_ms']:.0f} / {rec['bf16_native_min_ms']:.0f} ms",
          flush=True)
    return rec


def _deltanet_inputs(cfg, lens: list[int], dtype, seed: int = 0):
    """A layer's mixer inputs as the model passes them: column ranges of the in_proj and
    conv outputs, parameters, a float32 state pool with each sequence's heads."""
    h, hk, kd, vd = (cfg.linear_num_value_heads, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    conv = torch.randn(t, 2 * hk * kd + h * vd, generator=g).to(dtype)
    proj = torch.randn(t, 2 * hk * kd + 2 * h * vd + 2 * h, generator=g).to(dtype)
    q, k, v = torch.split(conv, [hk * kd, hk * kd, h * vd], dim=-1)
    _, z, b, a = torch.split(proj, [2 * hk * kd + h * vd, h * vd, h, h], dim=-1)
    params = dict(A_log=torch.randn(h, generator=g).to(dtype), dt_bias=torch.randn(h, generator=g).to(dtype),
                  norm_weight=(1 + 0.1 * torch.randn(vd, generator=g)).to(dtype))
    n = len(lens)
    state = 0.1 * torch.randn(n * h, 1, kd, vd, generator=g)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    pages = torch.arange(n * h).view(n, h)
    return dict(q=q, k=k, v=v, a=a, b=b, z=z, state=state, varlen=native.Varlen(qsl, pages, [True] * n),
                heads=dict(key_heads=hk, value_heads=h), scale=kd ** -0.5, **params)


def bench_delta_rule(cfg, rounds: int) -> list[dict]:
    out = []
    for label, lens in (("decode 16 x 1", [1] * 16), ("prefill 2 x 512", [512, 512])):
        x = _deltanet_inputs(cfg, lens, torch.bfloat16)
        xf = _deltanet_inputs(cfg, lens, torch.float32)

        def mixer(d, copies=False, k=None):
            cast = (lambda t: t.float()) if copies else (lambda t: t)

            def f():
                kw = dict(key_heads=d["heads"]["key_heads"], value_heads=d["heads"]["value_heads"],
                          scale=d["scale"], a=cast(d["a"]), b=cast(d["b"]), A_log=cast(d["A_log"]),
                          dt_bias=cast(d["dt_bias"]), z=cast(d["z"]), norm_weight=cast(d["norm_weight"]),
                          norm_eps=1e-6, item_base=0)
                saved = native._k
                if k is not None:
                    native._k = k
                try:
                    o = native.gated_delta_rule(cast(d["q"]), cast(d["k"]), cast(d["v"]), d["state"], d["varlen"],
                                                **kw)
                finally:
                    native._k = saved
                return o.to(torch.bfloat16) if copies else o
            return f

        fns = {"bf16_inplace": mixer(x), "bf16_copies": mixer(x, copies=True), "f32": mixer(xf)}
        if BASELINE is not None:
            fns["f32_baseline"] = mixer(xf, k=BASELINE)
        reps = 20 if lens[0] == 1 else 2
        t = _alternate(fns, rounds, reps)
        rec = {"case": label, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
               **{f"{k}_min_ms": v * 1e3 for k, v in MINS.items()}}
        out.append(rec)
        line = (f"delta rule (mixer) {label}: bf16 in place {rec['bf16_inplace_ms']:.3f} ms, bf16 on float32 copies "
                f"(round 1) {rec['bf16_copies_ms']:.3f} ms ({t['bf16_copies'] / t['bf16_inplace']:.2f}x, min "
                f"{MINS['bf16_copies'] / MINS['bf16_inplace']:.2f}x), float32 {rec['f32_ms']:.3f} ms")
        if BASELINE is not None:
            line += (f", float32 baseline build {rec['f32_baseline_ms']:.3f} ms (baseline/this "
                     f"{t['f32_baseline'] / t['f32']:.3f}x; min {MINS['f32_baseline'] / MINS['f32']:.3f}x)")
        print(line, flush=True)
    return out


def bench_prefill_attention(rounds: int) -> list[dict]:
    """The SDPA groups of prefill chunks over a bfloat16 paged cache (0.1b attention
    shape: 8 query heads over 2 KV heads of 64)."""
    from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu

    hq, hkv, d, bs = 8, 2, 64, 16
    out = []
    for label, q_lens, ctx in (("4 prompts x 256", [256] * 4, [256] * 4), ("1 prompt x 1024", [1024], [1024]),
                               ("chunk 512 at 2048", [512], [2048])):
        g = torch.Generator().manual_seed(len(q_lens))
        nbs = [-(-c // bs) for c in ctx]
        tables = torch.zeros(len(ctx), max(nbs), dtype=torch.int32)
        at = 0
        for i, n in enumerate(nbs):
            tables[i, :n] = torch.arange(at, at + n)
            at += n
        k_cache = torch.randn(at, bs, hkv, d, generator=g).to(torch.bfloat16)
        v_cache = torch.randn(at, bs, hkv, d, generator=g).to(torch.bfloat16)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
        q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(torch.bfloat16)
        lens = torch.tensor(ctx)
        plan = AttentionPlan(qsl, lens, tables, bs, split_decodes=True)
        fns = {"bf16_sdpa": lambda: paged_attention_cpu(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5, plan),
               "f32_copies": lambda: attention_round1(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5, plan)}
        t = _alternate(fns, rounds, 3)
        rec = {"case": label, **{f"{k}_ms": v * 1e3 for k, v in t.items()}}
        out.append(rec)
        print(f"prefill attention {label}: SDPA on bf16 blocks {rec['bf16_sdpa_ms']:.2f} ms, on float32 copies "
              f"(round 1) {rec['f32_copies_ms']:.2f} ms ({t['f32_copies'] / t['bf16_sdpa']:.2f}x, min "
              f"{MINS['f32_copies'] / MINS['bf16_sdpa']:.2f}x)", flush=True)
    return out


def bench_conv_norm(cfg, rounds: int) -> list[dict]:
    """conv1d and the residual RMSNorm of this build against the baseline build's, at
    decode (16 rows) and prefill (1,024 rows) sizes, float32 and bfloat16: the bindings
    called directly on preallocated outputs (no allocation in the timing), each kernel's
    pair alternated on its own."""
    if BASELINE is None:
        raise SystemExit("--only convnorm needs --baseline-core")
    out = []
    c, w, hidden = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, cfg.hidden_size
    for dt in (torch.float32, torch.bfloat16):
        view = native._np if dt == torch.float32 else native._bits
        sfx = "" if dt == torch.float32 else "_bf16"
        for lens in ([1] * 16, [512, 512]):
            g = torch.Generator().manual_seed(1)
            t, n = sum(lens), len(lens)
            x = view(torch.randn(t, c + 64, generator=g).to(dt)[:, :c])
            weight = view(torch.randn(c, w, generator=g).to(dt))
            pool = view(torch.randn(n, 1, c, w - 1, generator=g).to(dt))
            y = view(torch.empty(t, c, dtype=dt))
            varlen = native.Varlen(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
                                   torch.arange(n).view(n, 1), [True] * n)
            xs, res = view(torch.randn(t, hidden, generator=g).to(dt)), view(torch.randn(t, hidden, generator=g).to(dt))
            nw, ny = view((0.1 * torch.randn(hidden, generator=g)).to(dt)), view(torch.empty(t, hidden, dtype=dt))

            def conv(k):
                return lambda: getattr(k, "causal_conv1d" + sfx)(x, weight, None, pool, varlen.qsl, varlen.table,
                                                                 varlen.init, y, item_base=0, silu=True)

            def norm(k):
                return lambda: getattr(k, "rms_norm" + sfx)(xs, nw, 1e-6, ny, res, True)

            reps = 20 if t <= 16 else 3
            rec = {"dtype": str(dt).split(".")[-1], "rows": t}
            for name, make in (("conv1d", conv), ("rms_norm", norm)):
                tt = _alternate({"this": make(native._k), "base": make(BASELINE)}, rounds, reps)
                rec.update({f"{name}_this_ms": tt["this"] * 1e3, f"{name}_base_ms": tt["base"] * 1e3,
                            f"{name}_base_over_this": tt["base"] / tt["this"],
                            f"{name}_min_ratio": MINS["base"] / MINS["this"]})
            out.append(rec)
            print(f"{rec['dtype']:8s} rows {t:5d}: conv1d this {rec['conv1d_this_ms']:.4f} ms, baseline "
                  f"{rec['conv1d_base_ms']:.4f} ms (baseline/this {rec['conv1d_base_over_this']:.3f}x, min "
                  f"{rec['conv1d_min_ratio']:.3f}x); rms_norm this {rec['rms_norm_this_ms']:.4f} ms, baseline "
                  f"{rec['rms_norm_base_ms']:.4f} ms (baseline/this {rec['rms_norm_base_over_this']:.3f}x, min "
                  f"{rec['rms_norm_min_ratio']:.3f}x)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", choices=["0.1b", "0.8b"], default="0.1b",
                    help="the issue's ~0.1B (hidden 768, 152K vocab) or ~0.8B (hidden 1024, 248K vocab) shapes")
    ap.add_argument("--layers", type=int, default=4, help="layers of the decode-step model (default 4)")
    ap.add_argument("--prefill-rows", type=int, default=1024)
    ap.add_argument("--only", choices=["all", "gemm", "prefill", "decode", "prefillstep", "deltarule", "attention",
                                       "convnorm"], default="all")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by this thread's CPU time (with --threads 1: immune to the other processes' load)")
    ap.add_argument("--baseline-core", help="another build's _core extension (.so) to compare kernels against")
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
    global BASELINE, CLOCK
    if args.cpu_time:
        if args.threads != 1:
            raise SystemExit("--cpu-time measures one thread: use it with --threads 1")
        CLOCK = time.thread_time
    if args.baseline_core:
        BASELINE = load_baseline(args.baseline_core)
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, kernel threads {native.threads()} "
          f"({native.pool()}), bf16 isa {native.bf16_isa()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    shapes = gemm_shapes(hidden, inter, vocab, cfg.linear_conv_dim, cfg.linear_value_dim, heads)
    if args.only in ("all", "gemm"):
        bench_gemms(shapes, [1, 16, 64], args.rounds)
    if args.only in ("all", "prefill"):
        bench_prefill(shapes, args.prefill_rows, max(2, args.rounds // 2))
    if args.only in ("all", "decode"):
        bench_decode(cfg, 16, 64, args.rounds)
    if args.only in ("all", "prefillstep"):
        bench_prefill_step(cfg, 4, 256, max(2, args.rounds // 2))
    if args.only in ("all", "deltarule"):
        bench_delta_rule(cfg, args.rounds)
    if args.only in ("all", "attention"):
        bench_prefill_attention(args.rounds)
    if args.only == "convnorm" or (args.only == "all" and BASELINE is not None):
        bench_conv_norm(cfg, args.rounds)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
