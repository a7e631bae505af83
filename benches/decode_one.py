"""One sequence's decode step (or ``--seqs`` sequences') in process (issue 22): the float32 model with the dense
projections column-major (the CPU layout before this change: every ``nn.Linear``,
the tied LM head too, transposed into huge-page memory, run on the column-major few-row
kernel) against the layout the loader keeps now (``[out, in]``, the row-major
dot-product kernel), and the bfloat16 model, on the same checkpoint, in one process.

Variants: ``f32_colmajor``, ``f32_rows``, ``bf16``; ``f32_modules`` / ``bf16_modules``
are ``f32_rows`` / ``bf16`` with the native decode step off
(``Qwen3_5ForServing.native_decode = False``: every decode through the module path,
the step before hybridserve.model.native_decode), for its side-by-side.

Each variant is an :class:`hybridserve.LLM` on the checkpoint; rounds alternate them.
A round generates ``--tokens`` greedy tokens from ``--seqs`` 64-token prompts at once
and times every decode-only forward (every sequence one token); medians over all
rounds are printed with the thread count and the load average.

    python benches/decode_one.py --checkpoint ~/.cache/hybridserve/llamacpp/11434.0.0/work/peer-0.1b/hf --threads 2
    python benches/decode_one.py --checkpoint .../peer-0.1b/hf --threads 2 --seqs 16
    python benches/decode_one.py --checkpoint .../peer-0.1b/hf --threads 2 --variants bf16,bf16_modules,f32_rows,f32_modules
    python benches/decode_one.py --checkpoint .../peer-0.1b/hf --threads 2 --variants bf16,bf16_before \
        --baseline-core /tmp/base_bf16/target/release/lib_core.so

``bf16_before`` (needs ``--baseline-core``, another build's ``_core``, see
``benches/bf16_kernels.py``): the bfloat16 model with that build's few-row bfloat16
GEMM (``native.linear_bf16`` and the native decode step's GEMM swapped in during its
rounds only), to compare two GEMM builds within the whole step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def transpose_dense(model) -> None:
    """The layout before this change: every float32 projection (and the tied head)
    stored transposed, as ``store_projections_column_major`` did."""
    from hybridserve.model.hugepages import transposed_copy

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.weight.stride(0) != 1:
                m.weight.data = transposed_copy(m.weight.data)


def baseline_linear_bf16(core_path: str | None):
    """``native.linear_bf16`` on another build's kernel, and that build's raw
    ``matmul_bf16`` (what the native decode step calls)."""
    if core_path is None:
        raise SystemExit("the bf16_before variant needs --baseline-core")
    from bf16_kernels import load_baseline  # benches/ is the script's folder

    from hybridserve.kernels import native

    base = load_baseline(core_path)

    def linear_bf16(x, weight, out_dtype=torch.bfloat16):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        base.matmul_bf16(native._bits(x), native._bits(weight),
                         native._bits(out) if out_dtype == torch.bfloat16 else native._np(out))
        return out

    return linear_bf16, base.matmul_bf16
def skip_gemms() -> None:
    """No native GEMM runs (``--outside-gemms``): the module path's Projection gets an
    empty output of the right shape, the native decode step's GEMM does nothing."""
    from hybridserve.kernels import native
    from hybridserve.model import native_decode

    native.linear_bf16 = lambda x, w, out_dtype=torch.bfloat16: torch.empty(x.shape[0], w.shape[0], dtype=out_dtype)
    native.linear_rows = lambda x, w: torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    init = native_decode.NativeDecodeStep.__init__

    def no_gemm_init(self, model):
        init(self, model)
        self.k_gemm = lambda x, w, out: None

    native_decode.NativeDecodeStep.__init__ = no_gemm_init


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="f32_colmajor,f32_rows,bf16")
    ap.add_argument("--seqs", type=int, default=1, help="sequences decoding together (16: the batched row)")
    ap.add_argument("--baseline-core", default=None, help="another build's _core (the bf16_before variant)")
    ap.add_argument("--outside-gemms", action="store_true",
                    help="time everything but the GEMMs: every native GEMM call skipped (its output left "
                         "uninitialised, so the tokens are meaningless)")
    args = ap.parse_args()
    if args.outside_gemms:
        skip_gemms()
    from hybridserve import LLM
    from hybridserve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    llms, times = {}, {}
    for v in args.variants.split(","):
        llm = LLM(args.checkpoint, dtype="bfloat16" if v.startswith("bf16") else "float32", max_num_seqs=args.seqs,
                  cpu_threads=args.threads, kv_cache_memory_bytes=1 << 30)
        if v == "f32_colmajor":
            transpose_dense(llm.engine.runner.model)
        model = llm.engine.runner.model
        if v.endswith("_modules"):
            model.native_decode = False
        inner = model.forward
        rec: list[float] = []

        def timed(batch, cache, inner=inner, rec=rec):
            t0 = time.perf_counter()
            out = inner(batch, cache)
            if batch.input_ids.shape[0] == args.seqs and int(batch.query_start_loc.shape[0]) - 1 == args.seqs:
                rec.append(time.perf_counter() - t0)
            return out

        model.forward = timed
        llms[v], times[v] = llm, rec
    swaps = {}
    if "bf16_before" in llms:
        # Loaded after the engines, so that it takes the kernel thread count they set.
        swaps["bf16_before"], base_gemm = baseline_linear_bf16(args.baseline_core)
        before = llms["bf16_before"].engine.runner.model
        build = before._native_decode_for

        def with_base_gemm(batch, build=build):
            step = build(batch)
            if step is not None:
                step.k_gemm = base_gemm
            return step

        before._native_decode_for = with_base_gemm
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(100, 5000, (64,), generator=gen)] for _ in range(args.seqs)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    outs = {}
    for v, llm in llms.items():  # warm-up
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        times[v].clear()
    from hybridserve.kernels import native

    own = native.linear_bf16
    for _ in range(args.rounds):
        for v, llm in llms.items():
            native.linear_bf16 = swaps.get(v, own)
            try:
                outs[v] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            finally:
                native.linear_bf16 = own
    for v, ts in times.items():
        print(f"{v:14s} decode step median {statistics.median(ts) * 1e3:7.2f} ms  min {min(ts) * 1e3:7.2f} ms "
              f"({len(ts)} steps)")
    if "f32_colmajor" in outs and "f32_rows" in outs:
        print("float32 greedy tokens equal across layouts:", list(outs["f32_colmajor"]) == list(outs["f32_rows"]))
    if "bf16" in outs and "bf16_before" in outs:
        print("bfloat16 greedy tokens equal across GEMM builds:", list(outs["bf16"]) == list(outs["bf16_before"]))
    for fast, slow in (("f32_rows", "f32_modules"), ("bf16", "bf16_modules")):
        if fast in times and slow in times:
            print(f"{fast} / {slow}: step time {statistics.median(times[fast]) / statistics.median(times[slow]):.3f}x, "
                  f"greedy tokens equal: {list(outs[fast]) == list(outs[slow])}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
