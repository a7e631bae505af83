"""Fused recurrent Gated DeltaNet (gated delta rule) over paged state, in Triton.

Contract (identical to
:func:`hybridserve.kernels.gated_delta_rule.gated_delta_rule_recurrent_ref`):

* ``q``, ``k``: ``[T, Hk, K]``; ``v``: ``[T, H, V]``; ``g`` (log decay, <= 0) and
  ``beta``: ``[T, H]``. ``Hk`` divides ``H``; value head ``h`` reads query/key head
  ``h // (H // Hk)`` (HF's ``repeat_interleave``), so grouped q/k need no copy. With
  ``Hk == H`` this is exactly the reference's layout.
* ``state``: float32 pool ``[num_pages, per_page, K, V]`` (a strided view of the
  arena), updated in place: value head ``h`` of sequence ``b`` is item
  ``i = item_base + h`` of its state page table row ``state_pages[b]``, i.e.
  ``state[state_pages[b, i // per_page], i % per_page]``
  (:mod:`hybridserve.kernels.state_pages`); it starts from there (or from zeros when
  ``has_initial_state[b]`` is false) and its final state is left there.
* ``checkpoint_positions[b] = k >= 1`` (optional): the state after the sequence's
  first ``k`` tokens is also stored at the same items of ``checkpoint_pages[b]``. The
  recurrent kernel stores it as it passes token ``k``; the chunked kernel shifts its
  chunk grid (inert zero tokens before the sequence's first) so that a chunk ends at
  token ``k`` and stores the state there: no split launch, at most one extra chunk.
* ``read_only`` (optional): bool or int8 ``[B]``; a run with ``read_only[b]`` set
  starts from its state and computes its outputs (and any checkpoint) as usual, but
  leaves its state items as they were (a speculative verify run: the state advances
  once acceptance is known, by a replay of the accepted rows). The native kernels'
  flag, with the same meaning.
* ``query_start_loc``: int ``[B+1]``, sequence ``b`` owns tokens
  ``query_start_loc[b] : query_start_loc[b+1]`` (a decode step is one token, a prefill
  chunk many).
* Per token, in float32: optional l2norm of q and k (``x / sqrt(sum x^2 + 1e-6)``,
  like HF/FLA), ``q *= scale``, ``S *= exp(g)``, ``S += k (beta (v - k^T S))^T``,
  ``o = S^T q``. Returns ``o`` ``[T, H, V]`` in ``v``'s dtype.

Launch: grid ``(B, H, cdiv(V, BLOCK_V))``. Columns of the state are independent
under the delta rule (``k^T S`` is per column), so each program keeps one
``[K, BLOCK_V]`` float32 tile of one sequence's state in registers, streams that
sequence's tokens through it in order, and writes the tile back once. Fused: the
l2norms, the scale, the decay, the state read/write and the output. Cost per program
``O(q_len * K * BLOCK_V)`` FLOPs; state memory traffic is one read and one write per
sequence regardless of ``q_len``. This is the decode kernel; it is also correct for
prefill (token by token).

Prefill: :func:`gated_delta_rule_chunked_triton`, same grid, walks the sequence 16
tokens at a time in the chunked (UT-transform) form, so the serial depth is
``q_len / 16`` steps of ``tl.dot`` work instead of ``q_len`` steps of reductions.
:func:`gated_delta_rule_triton` (what ``ops`` calls) sends each sequence to the kernel
that suits its length, without a device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gated_delta_rule_chunked_triton", "gated_delta_rule_recurrent_triton", "gated_delta_rule_triton"]

# In gated_delta_rule_triton, sequences with at least this many tokens in a step take
# the chunked kernel, shorter ones the recurrent kernel.
CHUNKED_MIN_LEN = 16


@triton.jit
def _gated_delta_rule_recurrent_kernel(
    o_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    query_start_loc_ptr,
    table_ptr,
    has_initial_state_ptr,
    ck_pos_ptr,
    ck_table_ptr,
    ro_ptr,
    item_base,
    stride_tab,
    scale,
    min_len,  # sequences with fewer tokens are left to another launch
    max_len,  # sequences with more tokens are left to another launch
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_o_t,
    stride_o_h,
    stride_g_t,
    stride_g_h,
    stride_b_t,
    stride_b_h,
    stride_s_page,
    stride_s_item,
    stride_s_k,
    stride_s_v,
    HEAD_RATIO: tl.constexpr,  # H // Hk
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    HAS_RO: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    qk_head = head // HEAD_RATIO

    bos = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    eos = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    if eos == bos:
        return  # no tokens this step: the slot keeps its state (even if has_initial_state is 0)
    if (eos - bos < min_len) | (eos - bos > max_len):
        return
    item = item_base + head
    page = tl.load(table_ptr + seq * stride_tab + item // PER_PAGE).to(tl.int64)
    item_at = page * stride_s_page + (item % PER_PAGE) * stride_s_item

    offs_k = tl.arange(0, K_PAD)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < K_DIM
    v_ok = offs_v < V_DIM
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    s_ptrs = state_ptr + item_at + tile
    ck_row = bos - 1  # the token after which the checkpoint is taken (none: never reached)
    ck_ptrs = s_ptrs
    if HAS_CKPT:
        ck = tl.load(ck_pos_ptr + seq).to(tl.int64)
        if ck >= 1:
            ck_row = bos + ck - 1
            ck_page = tl.load(ck_table_ptr + seq * stride_tab + item // PER_PAGE).to(tl.int64)
            ck_ptrs = state_ptr + ck_page * stride_s_page + (item % PER_PAGE) * stride_s_item + tile
    # Padded rows/columns of the tile stay exactly 0 through every update below
    # (k and v are 0 there), so they never leak into the reductions.
    if tl.load(has_initial_state_ptr + seq) != 0:
        s = tl.load(s_ptrs, mask=tile_ok, other=0.0)
    else:
        s = tl.zeros([K_PAD, BLOCK_V], tl.float32)

    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_q_t + qk_head * stride_q_h + offs_k * stride_q_d, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_k_t + qk_head * stride_k_h + offs_k * stride_k_d, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v_t + head * stride_v_h + offs_v * stride_v_d, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_g_t + head * stride_g_h).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_b_t + head * stride_b_h).to(tl.float32)
        if USE_L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale

        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_o_t + head * stride_o_h + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        if HAS_CKPT:
            if t == ck_row:
                tl.store(ck_ptrs, s, mask=tile_ok)

    # A read-only run (a speculative verify run) leaves its state as it was.
    if HAS_RO:
        # (As a tile: the interpreter takes no scalar in a mask.)
        ro = tl.zeros([K_PAD, BLOCK_V], tl.int32) + tl.load(ro_ptr + seq).to(tl.int32)
        tl.store(s_ptrs, s, mask=tile_ok & (ro == 0))
    else:
        tl.store(s_ptrs, s, mask=tile_ok)


def _check(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
           checkpoint_positions, checkpoint_pages, read_only=None) -> None:
    """Shape/dtype/device checks that need no device sync; raise ValueError saying what to fix."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T={q.shape[0]}, H, V], got {tuple(v.shape)}")
    t, hk, kd = q.shape
    _, h, vd = v.shape
    if hk == 0 or h % hk != 0:
        raise ValueError(f"value heads ({h}) must be a multiple of query/key heads ({hk})")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (t, h):
            raise ValueError(f"{name} must be [T={t}, H={h}], got {tuple(x.shape)}")
    if state.dim() != 4 or tuple(state.shape[2:]) != (kd, vd):
        raise ValueError(f"state must be a pool [num_pages, per_page, K={kd}, V={vd}], got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32 (the recurrence accumulates in it), got {state.dtype}")
    b = state_pages.shape[0] if state_pages.dim() == 2 else -1
    if b < 0 or query_start_loc.dim() != 1 or query_start_loc.shape[0] != b + 1:
        raise ValueError(
            f"state_pages must be [B, cols] and query_start_loc [B+1], got {tuple(state_pages.shape)} "
            f"and {tuple(query_start_loc.shape)}"
        )
    if (item_base + h - 1) // state.shape[1] >= state_pages.shape[1]:
        raise ValueError(f"items {item_base}..{item_base + h - 1} need more columns than state_pages has "
                         f"({state_pages.shape[1]})")
    if has_initial_state.dim() != 1 or has_initial_state.shape[0] != b:
        raise ValueError(f"has_initial_state must be [B={b}], got {tuple(has_initial_state.shape)}")
    if (checkpoint_positions is None) != (checkpoint_pages is None):
        raise ValueError("give both checkpoint_positions and checkpoint_pages, or neither")
    if checkpoint_positions is not None and (tuple(checkpoint_positions.shape) != (b,)
                                             or checkpoint_pages.shape != state_pages.shape):
        raise ValueError("checkpoint_positions must be [B] and checkpoint_pages shaped like state_pages")
    if read_only is not None and (tuple(read_only.shape) != (b,) or read_only.dtype not in (torch.bool, torch.int8)
                                  or read_only.device != state.device):
        raise ValueError(f"read_only must be a bool or int8 [B={b}] tensor on {state.device}, got "
                         f"{tuple(read_only.shape)} {read_only.dtype} on {read_only.device}")
    for name, x in (("query_start_loc", query_start_loc), ("state_pages", state_pages)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    devs = {x.device for x in (q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")


def gated_delta_rule_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    item_base: int,
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_pages: torch.Tensor | None = None,
    read_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the gated delta rule for every sequence from its state pages; see the module doc.

    ``state`` is updated in place. Page ids are not range-checked (a device sync per
    layer); distinct sequences (and their checkpoints) must use distinct pages, since
    their programs run concurrently.
    """
    o, paged = _prepare(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
                        checkpoint_positions, checkpoint_pages, read_only)
    if state_pages.shape[0]:
        _launch_recurrent(o, q, k, v, g, beta, state, query_start_loc, paged, scale, use_qk_l2norm, 1, q.shape[0])
    return o


def _prepare(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
             checkpoint_positions, checkpoint_pages, read_only=None):
    """Check inputs; allocate ``o`` (contiguous: rows are stored with unit stride); bool
    ``has_initial_state`` viewed as int8 (same bytes, no copy; the kernels test != 0).
    Returns ``o`` and the state addressing the launches pass on."""
    _check(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
           checkpoint_positions, checkpoint_pages, read_only)
    if read_only is not None and read_only.dtype == torch.bool:
        read_only = read_only.view(torch.int8)  # same bytes, no copy
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if has_initial_state.dtype == torch.bool:
        has_initial_state = has_initial_state.view(torch.int8)
    table = state_pages if state_pages.stride(-1) == 1 else state_pages.contiguous()
    if checkpoint_pages is not None:
        checkpoint_pages = checkpoint_pages.to(table.dtype).contiguous()
        if checkpoint_pages.stride(0) != table.stride(0):
            table = table.contiguous()
    return o, _Paged(table, has_initial_state, int(item_base), checkpoint_positions, checkpoint_pages, read_only)


class _Paged:
    """The kernels' state addressing arguments (see the module doc)."""

    def __init__(self, table, has_initial_state, item_base, ck_pos, ck_table, read_only=None):
        self.table, self.init, self.item_base = table, has_initial_state, item_base
        self.has_ckpt = ck_pos is not None
        self.ck_pos = ck_pos if self.has_ckpt else table
        self.ck_table = ck_table if self.has_ckpt else table
        self.has_ro = read_only is not None
        self.ro = read_only if self.has_ro else has_initial_state  # placeholder pointer, never read

    def args(self, state):
        """Pointer and scalar arguments, in the kernels' order."""
        return (self.table, self.init, self.ck_pos, self.ck_table, self.ro, self.item_base, self.table.stride(0))

    def strides(self, state):
        return state.stride()

    def meta(self, state):
        return dict(PER_PAGE=state.shape[1], HAS_CKPT=self.has_ckpt, HAS_RO=self.has_ro)


def _launch_recurrent(o, q, k, v, g, beta, state, query_start_loc, paged, scale, use_qk_l2norm, min_len, max_len):
    _, hk, kd = q.shape
    _, h, vd = v.shape
    num_seqs = paged.table.shape[0]
    k_pad = triton.next_power_of_2(kd)
    # Keep the register tile at <= 4096 float32 (16 KiB): K=128 -> 32 columns.
    block_v = min(triton.next_power_of_2(vd), max(8, 4096 // k_pad))
    grid = (num_seqs, h, triton.cdiv(vd, block_v))
    _gated_delta_rule_recurrent_kernel[grid](
        o,
        q,
        k,
        v,
        g,
        beta,
        state,
        query_start_loc,
        *paged.args(state),
        float(scale),
        min_len,
        max_len,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        o.stride(0),
        o.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        *paged.strides(state),
        HEAD_RATIO=h // hk,
        K_DIM=kd,
        V_DIM=vd,
        K_PAD=k_pad,
        BLOCK_V=block_v,
        USE_L2NORM=bool(use_qk_l2norm),
        **paged.meta(state),
        num_warps=4,
    )


@triton.jit
def _gated_delta_rule_chunked_kernel(
    o_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    query_start_loc_ptr,
    table_ptr,
    has_initial_state_ptr,
    ck_pos_ptr,
    ck_table_ptr,
    ro_ptr,
    item_base,
    stride_tab,
    scale,
    min_len,  # sequences with fewer tokens are left to another launch
    max_len,  # sequences with more tokens are left to another launch
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_o_t,
    stride_o_h,
    stride_g_t,
    stride_g_h,
    stride_b_t,
    stride_b_h,
    stride_s_page,
    stride_s_item,
    stride_s_k,
    stride_s_v,
    HEAD_RATIO: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    HAS_RO: tl.constexpr,
):
    """Chunked form (prefill): per chunk of CHUNK tokens, with cum = cumsum(g),
    decay[i, j] = exp(cum_i - cum_j) (j <= i), A = strict_lower(beta_i k_i.k_j decay),
    T = (I + A)^-1 (forward substitution), v_new = T (beta (v - exp(cum) k S)), o = (exp(cum) q) S + lower(q k^T decay) v_new,
    S <- exp(cum_last) S + (exp(cum_last - cum) k)^T v_new. Same math as the reference's
    chunked form; rows outside the sequence (past its end, or before its start when the
    grid is shifted for a checkpoint) are zero and drop out."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    qk_head = head // HEAD_RATIO
    bos = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    eos = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    if (eos == bos) | (eos - bos < min_len) | (eos - bos > max_len):
        return
    item = item_base + head
    page = tl.load(table_ptr + seq * stride_tab + item // PER_PAGE).to(tl.int64)
    item_at = page * stride_s_page + (item % PER_PAGE) * stride_s_item

    offs_k = tl.arange(0, K_PAD)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.arange(0, CHUNK)
    k_ok = offs_k < K_DIM
    v_ok = offs_v < V_DIM
    tile = offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    s_ptrs = state_ptr + item_at + tile
    # A checkpoint after token k: start the chunk grid `front` inert tokens early so
    # that a chunk ends exactly at token k; its end state is the checkpoint.
    front = bos * 0
    ck_end = bos - 1
    ck_ptrs = s_ptrs
    if HAS_CKPT:
        ck = tl.load(ck_pos_ptr + seq).to(tl.int64)
        if ck >= 1:
            front = (CHUNK - ck % CHUNK) % CHUNK
            ck_end = bos + ck
            ck_page = tl.load(ck_table_ptr + seq * stride_tab + item // PER_PAGE).to(tl.int64)
            ck_ptrs = state_ptr + ck_page * stride_s_page + (item % PER_PAGE) * stride_s_item + tile
    if tl.load(has_initial_state_ptr + seq) != 0:
        s = tl.load(s_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    else:
        s = tl.zeros([K_PAD, BLOCK_V], tl.float32)

    row = offs_c[:, None]
    col = offs_c[None, :]
    strict = col < row
    incl = col <= row
    eye = tl.where(row == col, 1.0, 0.0)
    for c0 in range(bos - front, eos, CHUNK):
        t = c0 + offs_c
        t_ok = (t >= bos) & (t < eos)
        qk_mask = t_ok[:, None] & k_ok[None, :]
        # Inputs are loaded late so that few tiles stay live across the substitution
        # loop (register pressure on GPUs).
        k = tl.load(
            k_ptr + t[:, None] * stride_k_t + qk_head * stride_k_h + offs_k[None, :] * stride_k_d, mask=qk_mask, other=0.0
        ).to(tl.float32)
        g = tl.load(g_ptr + t * stride_g_t + head * stride_g_h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_b_t + head * stride_b_h, mask=t_ok, other=0.0).to(tl.float32)
        if USE_L2NORM:
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        cum = tl.cumsum(g, axis=0)
        # exp only where the mask keeps it: above the diagonal cum_i - cum_j >= 0 may overflow.
        decay_strict = tl.exp(tl.where(strict, cum[:, None] - cum[None, :], float("-inf")))
        a = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * decay_strict * beta[:, None]

        # T = (I + A)^-1, lower unitriangular: row i = e_i - sum_{j<i} A[i, j] T[j, :],
        # rows in order so every T[j, :] used is final.
        tinv = eye
        for i in range(1, CHUNK):
            a_i = tl.sum(tl.where(row == i, a, 0.0), axis=0)  # A[i, :]
            upd = tl.sum(a_i[:, None] * tinv, axis=0)  # (A[i, :] T)[:]
            tinv = tl.where(row == i, tinv - upd[None, :], tinv)

        q = tl.load(
            q_ptr + t[:, None] * stride_q_t + qk_head * stride_q_h + offs_k[None, :] * stride_q_d, mask=qk_mask, other=0.0
        ).to(tl.float32)
        v = tl.load(
            v_ptr + t[:, None] * stride_v_t + head * stride_v_h + offs_v[None, :] * stride_v_d,
            mask=t_ok[:, None] & v_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if USE_L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
        q = q * scale
        cum_last = tl.sum(g, axis=0)  # padded rows have g = 0
        decay_incl = tl.exp(tl.where(incl, cum[:, None] - cum[None, :], float("-inf")))

        # U - W S = T (beta (v - exp(cum) k S)): one [CHUNK, BLOCK_V] product, no [CHUNK, K] W.
        k_s = tl.dot(k * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
        v_new = tl.dot(tinv, (v - k_s) * beta[:, None], input_precision=DOT_PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay_incl
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION) + tl.dot(
            qk, v_new, input_precision=DOT_PRECISION
        )
        tl.store(
            o_ptr + t[:, None] * stride_o_t + head * stride_o_h + offs_v[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=t_ok[:, None] & v_ok[None, :],
        )
        k_dec = k * tl.exp(cum_last - cum)[:, None]
        s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_dec), v_new, input_precision=DOT_PRECISION)
        if HAS_CKPT:
            if c0 + CHUNK == ck_end:
                tl.store(ck_ptrs, s, mask=k_ok[:, None] & v_ok[None, :])

    # A read-only run (a speculative verify run) leaves its state as it was.
    if HAS_RO:
        # (As a tile: the interpreter takes no scalar in a mask.)
        ro = tl.zeros([K_PAD, BLOCK_V], tl.int32) + tl.load(ro_ptr + seq).to(tl.int32)
        tl.store(s_ptrs, s, mask=k_ok[:, None] & v_ok[None, :] & (ro == 0))
    else:
        tl.store(s_ptrs, s, mask=k_ok[:, None] & v_ok[None, :])


def gated_delta_rule_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = 16,
    *,
    item_base: int,
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_pages: torch.Tensor | None = None,
    read_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`gated_delta_rule_recurrent_triton`, in chunks (prefill).

    Grid ``(B, H, cdiv(V, BLOCK_V))`` as in the recurrent kernel; each program walks its
    sequence ``chunk_size`` tokens at a time, the intra-chunk work as ``tl.dot``
    products (the UT transform ``(I + A)^-1`` by forward substitution in registers),
    the state carried across chunks in float32. ``O(q_len * (chunk * (K + V) + K * V))``
    per head. A 1-token sequence still pays a whole chunk: use the recurrent kernel for
    decode-heavy batches (:func:`gated_delta_rule_triton` chooses).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    o, paged = _prepare(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
                        checkpoint_positions, checkpoint_pages, read_only)
    if state_pages.shape[0]:
        _launch_chunked(o, q, k, v, g, beta, state, query_start_loc, paged, scale, use_qk_l2norm, 1, q.shape[0],
                        chunk_size)
    return o


def _launch_chunked(o, q, k, v, g, beta, state, query_start_loc, paged, scale, use_qk_l2norm, min_len, max_len,
                    chunk_size):
    _, hk, kd = q.shape
    _, h, vd = v.shape
    num_seqs = paged.table.shape[0]
    # tl.dot needs every dimension >= 16. Sized with ptxas -v for sm_90 (K = V = 128,
    # bf16): chunk 16, 64 columns, 8 warps use ~236 registers and do not spill; chunk
    # 32 spills (the substitution loop keeps [CHUNK, CHUNK] tiles live).
    k_pad = max(16, triton.next_power_of_2(kd))
    block_v = max(16, min(triton.next_power_of_2(vd), 64 if k_pad <= 128 else 32))
    # float32: 3xTF32 keeps ~fp32 accuracy on tensor cores; "ieee" FMA dots spill badly here.
    precision = "tf32x3" if v.dtype == torch.float32 else "tf32"
    grid = (num_seqs, h, triton.cdiv(vd, block_v))
    _gated_delta_rule_chunked_kernel[grid](
        o,
        q,
        k,
        v,
        g,
        beta,
        state,
        query_start_loc,
        *paged.args(state),
        float(scale),
        min_len,
        max_len,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        o.stride(0),
        o.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        *paged.strides(state),
        HEAD_RATIO=h // hk,
        K_DIM=kd,
        V_DIM=vd,
        K_PAD=k_pad,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        USE_L2NORM=bool(use_qk_l2norm),
        DOT_PRECISION=precision,
        **paged.meta(state),
        num_warps=8,
    )


def gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    item_base: int,
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_pages: torch.Tensor | None = None,
    read_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence by the kernel that suits it: fewer than ``CHUNKED_MIN_LEN`` tokens
    (decodes, short chunks) recurrent, longer ones chunked. Same contract as both.

    Lengths are not read on the host: two launches cover all sequences, each kernel
    skipping (first thing) the sequences of the other. One recurrent launch does it
    all when shapes say long sequences are impossible (``T < CHUNKED_MIN_LEN``) or
    unlikely (``T <= B``: a decode batch; the recurrent kernel is correct for any
    length, only slower on long ones).
    """
    o, paged = _prepare(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, item_base,
                        checkpoint_positions, checkpoint_pages, read_only)
    t, b = q.shape[0], state_pages.shape[0]
    if b == 0:
        return o
    args = (o, q, k, v, g, beta, state, query_start_loc, paged, scale, use_qk_l2norm)
    if t < CHUNKED_MIN_LEN or t <= b:
        _launch_recurrent(*args, 1, t)
    else:
        _launch_recurrent(*args, 1, CHUNKED_MIN_LEN - 1)
        _launch_chunked(*args, CHUNKED_MIN_LEN, t, 16)
    return o
