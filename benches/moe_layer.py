"""MoE layer vs a dense MLP doing the same FLOPs, on the CPU (issue 18's target: <= 1.5x).

The MoE block is the ``moe-bench`` preset's (H 256, 64 experts, 4 routed of 192
channels plus a 512-channel shared expert: 4 x 192 + 512 = 1,280 active channels per
token); the dense MLP has ``intermediate_size`` 1,280, the ``bench`` preset's: the
same multiply-adds per token in the expert GEMMs. The MoE side also pays its router
(H x E per token) and the grouping, which the comparison counts against it. Both run
as the model runs them (float32, the CPU layout: projections stored transposed, the
native kernels where they apply), each timed as the median of many calls, side by side
in one process at 1, 16, 256 and 2,048 tokens.

Each side cycles through ``--layers`` layers of its own weights (default 8, the
presets' depth), as a model step does: a single layer called over and over keeps the
dense MLP's 4 MB of weights in cache, which no model step enjoys, while the MoE
layer's 38 MB never fit. The time reported is per layer. At a few tokens the MoE layer
must read every routed expert's weights once (41 of 64 experts at 16 tokens: 24 MB
against the dense layer's 4 MB for the same FLOPs), so there its cost is the memory's
streaming rate; ``MoE MB read`` is that volume per layer.

The floor columns put numbers on that. ``GB/s`` is this thread's streaming rate on the
same memory, measured in the same rounds (a ``sum`` over every expert tensor of each
layer: 37.7 MB per layer, read once); ``MoE floor`` is ``MoE MB read`` at that rate,
the least the MoE layer can cost with all its arithmetic hidden under the stream;
``floor/dense`` is that over the dense layer's time. The dense layer reads only its
3.9 MB for the same FLOPs and is bound by its arithmetic, so where ``floor/dense`` is
above the target no kernel reaches it on this machine at this width.

The two sides run interleaved (a round of dense calls, a round of MoE calls, repeated)
so a change in the machine's load hits both alike; each reports the median of its
calls. With ``--threads 1`` the time is also taken as the calling thread's CPU time
(``time.thread_time``: every op runs inline on it), which leaves out the time the
thread waits for a core on a shared machine but keeps its stalls on memory; on an
oversubscribed machine that ratio is the steadier one.

With ``--dtype bfloat16`` both sides are a bfloat16 model's: the MoE block's experts
packed in place at its first call (``Experts.pack_bf16``) and the native bfloat16 block
at every token count, the
dense MLP's projections ``[out, in]`` through ``Projection``'s native bfloat16 path
(``native.linear_bf16`` up to ``NATIVE_MAX_ROWS_BF16`` rows, oneDNN past it), as a
bfloat16 dense model runs them; the MB columns count bfloat16 bytes. ``--vs-ref`` adds
the path a bfloat16 MoE block took before (``ops.fused_moe``'s reference: a Python
loop over the experts with rows), timed in the same rounds.

    python benches/moe_layer.py --threads 1
    python benches/moe_layer.py --threads 1 --dtype bfloat16 --tokens 1,8,16,32,64,256,2048
    python benches/moe_layer.py --threads 1 --tokens 16 --min-s 2   # the 16-token floor
    python benches/moe_layer.py --threads 2 --shape 35b   # the 35B-A3B's layer shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = {
    # hidden, experts, top-k, expert inter, shared inter
    "moe-bench": (256, 64, 4, 192, 512),
    # Qwen3.5-35B-A3B: 256 experts, 8 routed of 512, shared 512 (a big layer: 1 GB).
    "35b": (2048, 256, 8, 512, 512),
}


def _interleaved(fns, reps: int, min_s: float, rounds: int = 5) -> list[tuple[float, float]]:
    """Median (wall ms, thread CPU ms) per call of each of ``fns``, run in alternating
    rounds of at least ``reps`` calls each (and until ``min_s`` per function has passed)."""
    for fn in fns:
        fn()
    wall = [[] for _ in fns]
    cpu = [[] for _ in fns]
    per_round = max(1, reps // rounds)
    start = time.perf_counter()
    r = 0
    while r < rounds or (time.perf_counter() - start < min_s * len(fns) and len(wall[0]) < 200):
        for i, fn in enumerate(fns):
            for _ in range(per_round):
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                wall[i].append(time.perf_counter() - t0)
                cpu[i].append(time.thread_time() - c0)
        r += 1
    return [(1e3 * statistics.median(w), 1e3 * statistics.median(c)) for w, c in zip(wall, cpu)]


def build(shape: str, layers: int = 1, dtype: torch.dtype = torch.float32):
    built = [_build_one(shape, seed, dtype) for seed in range(layers)]
    return [b[0] for b in built], [b[1] for b in built], built[0][2]


def fallback(moe, x: torch.Tensor) -> torch.Tensor:
    """The path a bfloat16 MoE block took before its native block: HF's routing, then
    ``ops.fused_moe`` (on the CPU the reference's loop over experts) and the shared
    expert."""
    import torch.nn.functional as F

    from hybridserve.kernels import ops
    from hybridserve.kernels.moe import route_ref

    w, ids = route_ref(F.linear(x, moe.gate.weight), moe.top_k)
    # HF's layout, copied once: the block's own tensors are packed for the native
    # kernel after its first call, and reading them as HF's would unpack them.
    ref = getattr(moe, "_bench_hf_experts", None)
    if ref is None:
        ref = moe._bench_hf_experts = (moe.experts.w13.clone(), moe.experts.w2.clone())
    out = ops.fused_moe(x, ref[0], ref[1], w, ids)
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


def _build_one(shape: str, seed: int, dtype: torch.dtype = torch.float32):
    from hybridserve.config import ModelConfig
    from hybridserve.model.moe import SparseMoeBlock
    from hybridserve.model.qwen3_5 import MLP
    from hybridserve.model.tiny import text_config

    h, e, k, i, si = SHAPES[shape]
    cfg = ModelConfig.from_dict(text_config("moe-bench", hidden_size=h, num_experts=e, num_experts_per_tok=k,
                                            moe_intermediate_size=i, shared_expert_intermediate_size=si))
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoeBlock(cfg)
    dense = MLP(h, k * i + si)
    with torch.no_grad():
        for m in (moe, dense):
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            if dtype == torch.bfloat16:
                # The loader's bfloat16 CPU layout: projections [out, in] as stored, the
                # experts as HF holds them (Experts re-lays them out on the cast).
                m.to(dtype)
                continue
            for sub in m.modules():  # the CPU layout the loader gives float32 projections
                if isinstance(sub, torch.nn.Linear):
                    sub.weight.data = sub.weight.data.t().contiguous().t()
    moe.requires_grad_(False)
    dense.requires_grad_(False)
    return moe, dense, h


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="moe-bench", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,16,256,2048")
    ap.add_argument("--layers", type=int, default=8, help="layers of weights cycled through (see above)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--min-s", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vs-ref", action="store_true", help="also time the pre-native fallback (see above)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    from hybridserve.kernels import native

    native.set_threads(a.threads)
    moes, denses, h = build(a.shape, a.layers, dtype)
    nl = len(moes)
    isa = f", bfloat16 ISA {native.bf16_isa()}" if dtype == torch.bfloat16 else ""
    print(f"torch threads {torch.get_num_threads()}, native kernel threads {native.threads()} "
          f"({native.pool()}), native kernels {'on' if native.available() else 'OFF'}; shape {a.shape} "
          f"{SHAPES[a.shape]} (hidden, experts, top-k, expert inter, shared inter); {nl} layers cycled; "
          f"{a.dtype}{isa}")
    _, e, k, i, si = SHAPES[a.shape]
    nbytes = torch.empty((), dtype=dtype).element_size()
    expert_mb = 3 * h * i * nbytes / 1e6
    cpu_clock = a.threads == 1
    print(f"load average {os.getloadavg()[0]:.1f} at start; times per layer, medians of interleaved rounds"
          + ("; 'cpu' = the thread's CPU time" if cpu_clock else ""))
    head = f"{'tokens':>7} {'dense ms':>9} {'MoE ms':>9} {'MoE/dense':>10}"
    if cpu_clock:
        head += f" {'dense cpu':>10} {'MoE cpu':>9} {'cpu ratio':>10}"
    head += f" {'MoE MB read':>12} {'GB/s':>6} {'MoE floor':>10} {'floor/dense':>12}"
    if a.vs_ref:
        head += f" {'ref ms':>9} {'ref/MoE':>8}" + (f" {'ref cpu':>9} {'cpu x':>6}" if cpu_clock else "")
    print(head)
    worst = worst_cpu = 0.0

    def stack(layers, x):
        for m in layers:
            m(x)

    def stream():
        for m in moes:
            m.experts.w13.sum()
            m.experts.w2.sum()

    def stack_ref(x):
        for m in moes:
            fallback(m, x)

    stream_mb = 3 * e * h * i * nbytes / 1e6

    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
        with torch.no_grad():
            fns = [lambda: stack(denses, x), lambda: stack(moes, x), stream]
            if a.vs_ref:
                fns.append(lambda: stack_ref(x))
            timed = _interleaved(fns, a.reps, a.min_s)
            (d, dc), (m, mc), (s, sc) = timed[:3]
            d, dc, m, mc = d / nl, dc / nl, m / nl, mc / nl
            gbs = stream_mb / ((sc if cpu_clock else s) / nl)  # MB per ms = GB/s
            active = sum(int((torch.bincount(
                torch.topk(x @ moe.gate.weight.t(), k).indices.reshape(-1), minlength=e) > 0).sum())
                for moe in moes) / nl
        mb = active * expert_mb + 3 * h * si * nbytes / 1e6
        worst = max(worst, m / d)
        line = f"{t:>7} {d:>9.3f} {m:>9.3f} {m / d:>10.2f}"
        if cpu_clock:
            worst_cpu = max(worst_cpu, mc / dc)
            line += f" {dc:>10.3f} {mc:>9.3f} {mc / dc:>10.2f}"
        floor = mb / gbs
        line += f" {mb:>12.1f} {gbs:>6.1f} {floor:>10.3f} {floor / (dc if cpu_clock else d):>12.2f}"
        if a.vs_ref:
            r, rc = timed[3][0] / nl, timed[3][1] / nl
            line += f" {r:>9.3f} {r / m:>8.1f}" + (f" {rc:>9.3f} {rc / mc:>6.1f}" if cpu_clock else "")
        print(line)
    print(f"worst ratio {worst:.2f}" + (f", by CPU time {worst_cpu:.2f}" if cpu_clock else "")
          + f" (target <= 1.5); load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
