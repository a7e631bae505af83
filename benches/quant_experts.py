"""A GGUF MoE layer's routed experts on their blocks: the per-expert Python loop, the
fused native call (``quant_experts``, issue 35), and the bfloat16 MoE block on the same
weights dequantized, at a 35B-A3B-like shape scaled to this machine.

The shape (default): hidden 1,024, 64 experts of 256 channels, top-8, no shared expert
(the 35B-A3B has hidden 2,048, 256 experts of 512, top-8: a quarter of its width and
expert count, the same top-k). The weights are random normals quantized as
llama-quantize's Q4_K_M leaves experts (gate / up Q4_K, down Q6_K; ``--types`` picks
others); the bfloat16 block gets those weights dequantized (``gguf``'s values, rounded
to bfloat16). Each side cycles through ``--layers`` layers of its own weights, as a
model step does (one layer called over and over would sit in cache).

Every side includes HF's routing of the same router weight: the quantized sides as the
GGUF model runs them (``F.linear`` of the router then ``route_ref``, then
``QuantizedExperts.forward_loop`` or ``.forward``, the native call), the bfloat16 side
as the bfloat16 model does (``SparseMoeBlock``: the native bfloat16 block, routing
included, experts packed at its first call). Times are per layer, medians of
interleaved rounds; with one thread also the thread's CPU time. ``MB`` is the expert
bytes a step reads (the active experts' blocks, or their bfloat16 weights).

    python benches/quant_experts.py --threads 1
    python benches/quant_experts.py --threads 1 --dtype float32 --types q8_0,q8_0,q8_0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from moe_layer import _interleaved  # noqa: E402


def build_layer(h: int, e: int, k: int, inter: int, types: list[str], seed: int):
    """(router weight bf16 [E, H], QuantizedExperts, bfloat16 SparseMoeBlock on the same
    weights dequantized)."""
    from hybridserve.config import ModelConfig
    from hybridserve.model.moe import SparseMoeBlock
    from hybridserve.model.tiny import text_config
    from hybridserve.quant.ggml import GGMLWeight
    from hybridserve.quant.ggml_quantize import quantize
    from hybridserve.quant.gguf.weights import QuantizedExperts

    gen = torch.Generator().manual_seed(seed)
    per, deq = [], []
    for (rows, cols), qtype in zip([(inter, h), (inter, h), (h, inter)], types):
        w = torch.randn(e * rows, cols, generator=gen) / cols ** 0.5
        data = torch.from_numpy(quantize(w.numpy(), qtype)).reshape(e, rows, -1)
        del w
        ws = [GGMLWeight(qtype, data[i], (rows, cols)) for i in range(e)]
        per.append(ws)
        from hybridserve.kernels import quant as qk
        deq.append(qk.dequantize(data.reshape(e * rows, -1), ws[0].type.ggml_id, cols,
                                 torch.bfloat16).reshape(e, rows, cols))
    qex = QuantizedExperts(*per)
    assert qex.blocks is not None
    cfg = ModelConfig.from_dict(text_config("moe-bench", hidden_size=h, num_experts=e, num_experts_per_tok=k,
                                            moe_intermediate_size=inter, shared_expert_intermediate_size=0))
    blk = SparseMoeBlock(cfg)
    router = (torch.randn(e, h, generator=gen) / h ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        blk.to(torch.bfloat16)
        blk.gate.weight.copy_(router)
        blk.experts.gate_up_proj.copy_(torch.cat([deq[0], deq[1]], dim=1))
        blk.experts.down_proj.copy_(deq[2])
    blk.requires_grad_(False)
    return router, qex, blk


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--types", default="q4_k,q4_k,q6_k", help="gate,up,down block types")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="the quantized sides' activations (the GGUF model's dtype)")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--min-s", type=float, default=1.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from hybridserve.kernels import native
    from hybridserve.kernels import quant as qk
    from hybridserve.kernels.moe import route_ref

    native.set_threads(a.threads)
    h, e, k, inter = a.hidden, a.experts, a.top_k, a.inter
    types = a.types.split(",")
    dtype = getattr(torch, a.dtype)
    layers = [build_layer(h, e, k, inter, types, seed) for seed in range(a.layers)]
    nl = len(layers)
    print(f"torch threads {torch.get_num_threads()}, native kernel threads {native.threads()} ({native.pool()}); "
          f"quant ISA {qk.isa()}, bfloat16 ISA {native.bf16_isa()}; hidden {h}, {e} experts of {inter}, top-{k}; "
          f"types gate/up/down {types}; quantized sides' activations {a.dtype}; {nl} layers cycled")
    cpu_clock = a.threads == 1
    print(f"load average {os.getloadavg()[0]:.1f} at start; times per layer (ms), medians of interleaved rounds"
          + ("; cpu = the thread's CPU time" if cpu_clock else ""))
    qbytes = layers[0][1].nbytes / e
    bbytes = 3 * h * inter * 2
    head = (f"{'tokens':>7} {'active':>7} {'loop':>8} {'kernel':>8} {'bf16 blk':>9} {'loop/kern':>10} "
            f"{'bf16/kern':>10}")
    if cpu_clock:
        head += f" {'loop cpu':>9} {'kern cpu':>9} {'bf16 cpu':>9} {'l/k cpu':>8} {'b/k cpu':>8}"
    head += f" {'kern MB':>8} {'bf16 MB':>8}"
    print(head)

    def routed(router, x):
        return route_ref(F.linear(x, router.to(x.dtype)), k)

    def loop(x):
        for router, qex, _ in layers:
            w, ids = routed(router, x)
            qex.forward_loop(x, w, ids)

    def kernel(x):
        for router, qex, _ in layers:
            w, ids = routed(router, x)
            qex(x, w, ids)

    def bf16(xb):
        for _, _, blk in layers:
            blk(xb)

    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
        xb = x.to(torch.bfloat16)
        with torch.no_grad():
            # The three agree (the kernel with the loop up to silu's last bit and the
            # rounding it moves; the bfloat16 block to the activations' 8-bit rounding).
            router, qex, blk = layers[0]
            w, ids = routed(router, x)
            ref, got, other = qex.forward_loop(x, w, ids).float(), qex(x, w, ids).float(), blk(xb).float()
            scale = ref.abs().max().item()
            timed = _interleaved([lambda: loop(x), lambda: kernel(x), lambda: bf16(xb)], a.reps, a.min_s)
            active = sum(int((torch.bincount(routed(r, x)[1].reshape(-1), minlength=e) > 0).sum())
                         for r, _, _ in layers) / nl
        (lw, lc), (kw, kc), (bw, bc) = [(w_ / nl, c_ / nl) for w_, c_ in timed]
        line = f"{t:>7} {active:>7.1f} {lw:>8.3f} {kw:>8.3f} {bw:>9.3f} {lw / kw:>10.2f} {bw / kw:>10.2f}"
        if cpu_clock:
            line += f" {lc:>9.3f} {kc:>9.3f} {bc:>9.3f} {lc / kc:>8.2f} {bc / kc:>8.2f}"
        line += f" {active * qbytes / 1e6:>8.1f} {active * bbytes / 1e6:>8.1f}"
        print(line + f"   (|kernel - loop| max {(got - ref).abs().max().item() / scale:.1e}, "
              f"|bf16 - loop| max {(other - ref).abs().max().item() / scale:.1e} of max |out|)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
