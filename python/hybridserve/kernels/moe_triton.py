"""The routed experts of an MoE block as two grouped GEMMs over expert-sorted rows, in Triton.

Contract (identical to :func:`hybridserve.kernels.moe.fused_moe_ref`): ``x`` ``[T, H]``;
``w13`` ``[E, H, 2I]`` (gate columns then up), ``w2`` ``[E, I, H]`` (any strides);
``topk_weights`` ``[T, k]``, ``topk_ids`` int ``[T, k]``; returns
``sum_k w[t, k] * silu(x w13_g) * (x w13_u) @ w2`` for the chosen experts, ``[T, H]``.

Layout: the ``T * k`` (token, slot) pairs are sorted by expert with plain tensor ops
(stable argsort + scatter-add counts + cumsum, no host synchronisation) and each expert's run is
padded to a multiple of ``BLOCK_M`` with a sentinel id, so that a block of ``BLOCK_M``
sorted rows belongs to one expert (:func:`align_by_expert`). Launches:

1. ``_moe_up_kernel`` grid ``(row blocks, cdiv(I, BLOCK_N))``: gathers its rows of ``x``
   (row ``id // k``), multiplies by the expert's gate and up column tiles (two
   accumulators) and stores ``silu(gate) * up`` into ``act[id]`` ``[T * k, I]``.
2. ``_moe_down_kernel`` grid ``(row blocks, cdiv(H, BLOCK_N))``: ``act[id] @ w2[e]``
   with the routing weight of pair ``id`` applied in the epilogue, stored to
   ``rows[id]`` ``[T * k, H]``; the k rows of a token are then summed (``view + sum``).

Blocks past the padded total exit at once (the grid is sized by the bound
``T * k + E * (BLOCK_M - 1)``, so the launch needs no count from the device).
Accumulation is float32 whatever the weights' dtype; float32 inputs multiply as
``tf32x3`` (three tf32 passes, about float32's accuracy on tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.moe import expert_counts

__all__ = ["align_by_expert", "fused_moe_triton"]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Expert-sorted pair ids padded per expert to ``block_m``.

    Returns ``(sorted_ids [P], block_expert [P // block_m], num_padded [1])`` with
    ``P = T * k + E * (block_m - 1)`` rounded up to ``block_m``; ``sorted_ids`` holds
    the flat pair id ``t * k + j`` of each row, ``T * k`` where a row is padding.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    counts = expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first row in `order`
    dest = starts[experts] + torch.arange(n, device=dev) - first[experts]
    cap = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((cap,), n, dtype=torch.int64, device=dev)
    sorted_ids[dest] = order
    block_starts = torch.arange(0, cap, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert, ends[-1:].clone()


@triton.jit
def _moe_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, INTER,
    stride_xt, stride_xh,
    stride_we, stride_wk, stride_wn,
    stride_at, stride_ai,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_pairs
    tokens = ids // top_k
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + kk[None, :] * stride_xh,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_base + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=wmask, other=0.0)
        wu = tl.load(w_base + kk[:, None] * stride_wk + (offs_n + INTER)[None, :] * stride_wn,
                     mask=wmask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + ids[:, None] * stride_at + offs_n[None, :] * stride_ai,
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, H, INTER,
    stride_at, stride_ai,
    stride_we, stride_wk, stride_wn,
    stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < INTER
        a = tl.load(act_ptr + ids[:, None] * stride_at + kk[None, :] * stride_ai,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    # Epilogue: the pair's routing weight.
    rw = tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(out_ptr + ids[:, None] * stride_ot + offs_n[None, :] * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, block_m: int = 16, block_n: int = 64,
                     block_k: int = 32) -> torch.Tensor:
    """See the module docstring; ``block_*`` are the tile sizes (powers of two, >= 16)."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, _, two_i = w13.shape
    inter = two_i // 2
    if w2.shape != (e, inter, h) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"w13 [E, H, 2I] = {list(w13.shape)}, w2 {list(w2.shape)} and the top-k "
                         f"tensors {list(topk_ids.shape)}/{list(topk_weights.shape)} do not agree")
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, e, block_m)
    # float32 models: three tf32 passes (about float32's accuracy on tensor cores).
    precision = "tf32x3" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    rows = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    blocks = sorted_ids.numel() // block_m
    _moe_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, act, sorted_ids, block_expert, num_padded, pairs, k, h, inter,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), act.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    weights = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(blocks, triton.cdiv(h, block_n))](
        act, w2, rows, weights, sorted_ids, block_expert, num_padded, pairs, h, inter,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        rows.stride(0), rows.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    return rows.view(t, k, h).sum(dim=1)
