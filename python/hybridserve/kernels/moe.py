"""Mixture-of-experts routing and the routed experts' SwiGLU MLPs: the plain-PyTorch
references the native (``native.moe_block``) and Triton (``moe_triton``) kernels are
held to, and the portable path for everything else.

Layout (the one the kernels read, see :class:`hybridserve.model.moe.Experts`):
``w13`` ``[E, H, 2I]`` (expert ``e``'s gate and up projections transposed, gate
columns first) and ``w2`` ``[E, I, H]`` (its down projection transposed), so that
``silu(x @ w13[e][:, :I]) * (x @ w13[e][:, I:]) @ w2[e]`` is expert ``e``'s output.

Routing follows HF's ``Qwen3_5MoeTopKRouter`` operation for operation: router logits
in the model dtype, softmax in float32, top-k of the probabilities, the k weights
renormalised to sum to 1 (in float32), then cast back to the model dtype. Doing the
top-k on the float32 probabilities (not on the logits) keeps near-ties routing as HF
routes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` ``[T, E]`` -> (weights ``[T, k]`` in the logits' dtype, expert
    ids ``[T, k]`` int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(router_logits.dtype), ids


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows routed to each expert (int64 ``[E]``). A scatter-add, not ``bincount``:
    on CUDA ``bincount`` reads the largest id back to size its output (a host sync,
    and no CUDA-graph capture)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for ``x`` ``[T, H]``.

    The reference: one sort groups the (token, k) pairs by expert, then each expert
    that received rows runs its GEMM pair on them and the weighted rows are added back
    with one ``index_add_``. The loop over experts is the reference's clarity, not a
    fast path (the CPU's is native, the GPU's Triton).
    """
    t, k = topk_ids.shape
    inter = w2.shape[1]
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order]
    rows = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = slice(start, start + n)
        h = x[tokens[sel]] @ w13[e]
        act = F.silu(h[:, :inter]) * h[:, inter:]
        rows[sel] = (act @ w2[e]) * weights[sel, None]
        start += n
    return out.index_add_(0, tokens, rows)


def shared_expert_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      gate_weight: torch.Tensor) -> torch.Tensor:
    """The shared expert scaled by ``sigmoid(x @ gate_weight)`` (HF's
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``); ``w13`` ``[H, 2I]``, ``w2``
    ``[I, H]``, ``gate_weight`` ``[H]``."""
    inter = w2.shape[0]
    h = x @ w13
    y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2
    return torch.sigmoid(x @ gate_weight)[:, None] * y


def moe_block_ref(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_k: int, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sparse MoE block: route (``router_weight`` ``[E, H]``), the routed
    experts, plus the gated shared expert ``(w13, w2, gate_weight)`` if given. Returns
    (output ``[T, H]``, expert ids ``[T, k]``)."""
    weights, ids = route_ref(F.linear(x, router_weight), top_k)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    if shared is not None:
        out = out + shared_expert_ref(x, *shared)
    return out, ids
