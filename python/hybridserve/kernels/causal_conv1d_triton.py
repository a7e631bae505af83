"""Depthwise causal conv1d over a flattened varlen batch with paged state, in Triton.

Contract (identical to :func:`hybridserve.kernels.causal_conv1d.causal_conv1d_ref`):
``x`` ``[T, C]`` with sequences delimited by ``query_start_loc`` ``[B+1]``;
``weight`` ``[C, W]`` (``2 <= W <= 4``; Qwen3.5 uses 4), ``bias`` ``[C]`` or None;
``conv_state`` pool ``[num_pages, per_page, C, W-1]`` (a strided view of the arena)
holding each sequence's last ``W-1`` inputs, oldest first, at item ``item_base`` of its
state page table row ``state_pages[b]`` (:mod:`hybridserve.kernels.state_pages`).
Sequence ``b`` starts from there if ``has_initial_state[b]`` else zeros, and leaves its
last ``W-1`` inputs there (in place; a sequence with no tokens this step leaves its
state untouched). ``checkpoint_positions[b] = k >= 1`` (optional): the ``W-1`` inputs
ending at its ``k``-th token also go to the same item of ``checkpoint_pages[b]``,
written by the same launch (serial path: as the walk passes token ``k``; parallel
path: by the state-update launch, before it overwrites the old state it may read).
``read_only`` (optional, bool or int8 ``[B]``): a run with ``read_only[b]`` set reads
its state and computes its outputs (and any checkpoint) as usual but leaves its state
item as it was (a speculative verify run; the native kernels' flag).
``y[t, c] = act(bias[c] + sum_j weight[c, j] * x_ext[t - (W-1) + j, c])`` in float32,
returned in ``x``'s dtype; ``act`` is SiLU or identity.

Launch: grid ``(B, cdiv(C, BLOCK_C))``. Each program owns one sequence's channel
block and walks its tokens in order, keeping the previous ``W-1`` inputs in registers
(three ``[BLOCK_C]`` vectors, zero-weighted when ``W < 4``), so every input is read
once and the state is read at the start and written at the end by the same program
(no race between sequences' reads of the old state and writes of the new). Fused:
state read, convolution, bias, activation, state write. ``O(q_len * C * W)`` FLOPs.
This serial walk suits decode; for batches with prefill (``T > B``) a token-parallel path runs
grid ``(T // 32 + B, cdiv(C, 128))`` over tiles of 32 tokens of one sequence (found
by binary search, as in paged attention) that read the old state but never write it,
then a second launch, grid ``(B, cdiv(C, 128))``, writes each sequence's new state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d_triton"]


@triton.jit
def _item_at(table_ptr, seq, stride_tab, item_base, stride_page, stride_item, PER_PAGE: tl.constexpr):
    """Offset of a sequence's conv item in the pool: page from its table row, slot in the page."""
    page = tl.load(table_ptr + seq * stride_tab + item_base // PER_PAGE).to(tl.int64)
    return page * stride_page + (item_base % PER_PAGE) * stride_item


@triton.jit
def _causal_conv1d_kernel(
    y_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    conv_state_ptr,
    query_start_loc_ptr,
    table_ptr,
    has_initial_state_ptr,
    ck_pos_ptr,
    ck_table_ptr,
    ro_ptr,
    item_base,
    stride_tab,
    num_channels,
    stride_x_t,
    stride_x_c,
    stride_y_t,
    stride_y_c,
    stride_w_c,
    stride_w_j,
    stride_cs_page,
    stride_cs_item,
    stride_cs_c,
    stride_cs_j,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    HAS_RO: tl.constexpr,
):
    seq = tl.program_id(0)
    c_block = tl.program_id(1)
    bos = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    eos = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    if eos == bos:
        return
    item_at = _item_at(table_ptr, seq, stride_tab, item_base, stride_cs_page, stride_cs_item, PER_PAGE)
    offs_c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < num_channels

    # Weight for x[t - i] is weight[:, WIDTH-1-i]; taps beyond the width weigh 0.
    w0 = tl.load(weight_ptr + offs_c * stride_w_c + (WIDTH - 1) * stride_w_j, mask=c_ok, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + offs_c * stride_w_c + (WIDTH - 2) * stride_w_j, mask=c_ok, other=0.0).to(tl.float32)
    w2 = tl.zeros([BLOCK_C], tl.float32)
    w3 = tl.zeros([BLOCK_C], tl.float32)
    if WIDTH >= 3:
        w2 = tl.load(weight_ptr + offs_c * stride_w_c + (WIDTH - 3) * stride_w_j, mask=c_ok, other=0.0).to(tl.float32)
    if WIDTH >= 4:
        w3 = tl.load(weight_ptr + offs_c * stride_w_c + (WIDTH - 4) * stride_w_j, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], tl.float32)

    # r_i = x[t - i]; before the sequence's first token here it comes from the state,
    # whose column W-1-i holds x[-i].
    cs = conv_state_ptr + item_at + offs_c * stride_cs_c
    ck_row = bos - 1  # the token after which the checkpoint is taken (none: never reached)
    ck_cs = cs
    if HAS_CKPT:
        ck = tl.load(ck_pos_ptr + seq).to(tl.int64)
        if ck >= 1:
            ck_row = bos + ck - 1
            ck_cs = conv_state_ptr + _item_at(ck_table_ptr, seq, stride_tab, item_base, stride_cs_page,
                                              stride_cs_item, PER_PAGE) + offs_c * stride_cs_c
    out_ty = conv_state_ptr.dtype.element_ty
    r1 = tl.zeros([BLOCK_C], tl.float32)
    r2 = tl.zeros([BLOCK_C], tl.float32)
    r3 = tl.zeros([BLOCK_C], tl.float32)
    if tl.load(has_initial_state_ptr + seq) != 0:
        r1 = tl.load(cs + (WIDTH - 2) * stride_cs_j, mask=c_ok, other=0.0).to(tl.float32)
        if WIDTH >= 3:
            r2 = tl.load(cs + (WIDTH - 3) * stride_cs_j, mask=c_ok, other=0.0).to(tl.float32)
        if WIDTH >= 4:
            r3 = tl.load(cs + (WIDTH - 4) * stride_cs_j, mask=c_ok, other=0.0).to(tl.float32)

    for t in range(bos, eos):
        xt = tl.load(x_ptr + t * stride_x_t + offs_c * stride_x_c, mask=c_ok, other=0.0).to(tl.float32)
        acc = bias + w0 * xt + w1 * r1 + w2 * r2 + w3 * r3
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + t * stride_y_t + offs_c * stride_y_c, acc.to(y_ptr.dtype.element_ty), mask=c_ok)
        r3 = r2
        r2 = r1
        r1 = xt
        if HAS_CKPT:
            if t == ck_row:
                tl.store(ck_cs + (WIDTH - 2) * stride_cs_j, r1.to(out_ty), mask=c_ok)
                if WIDTH >= 3:
                    tl.store(ck_cs + (WIDTH - 3) * stride_cs_j, r2.to(out_ty), mask=c_ok)
                if WIDTH >= 4:
                    tl.store(ck_cs + (WIDTH - 4) * stride_cs_j, r3.to(out_ty), mask=c_ok)

    # A read-only run (a speculative verify run) leaves its state as it was.
    keep = c_ok
    if HAS_RO:
        keep = c_ok & ((tl.zeros([BLOCK_C], tl.int32) + tl.load(ro_ptr + seq).to(tl.int32)) == 0)
    tl.store(cs + (WIDTH - 2) * stride_cs_j, r1.to(out_ty), mask=keep)
    if WIDTH >= 3:
        tl.store(cs + (WIDTH - 3) * stride_cs_j, r2.to(out_ty), mask=keep)
    if WIDTH >= 4:
        tl.store(cs + (WIDTH - 4) * stride_cs_j, r3.to(out_ty), mask=keep)


@triton.jit
def _seq_of_block(query_start_loc_ptr, blk, num_seqs, BLOCK_T: tl.constexpr):
    """Largest ``b`` with ``query_start_loc[b] // BLOCK_T + b <= blk`` (binary search):
    the sequence owning token block ``blk`` when each sequence gets
    ``q_len // BLOCK_T + 1`` consecutive blocks."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_T + mid <= blk:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _causal_conv1d_tokens_kernel(
    y_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    conv_state_ptr,
    query_start_loc_ptr,
    table_ptr,
    has_initial_state_ptr,
    ck_pos_ptr,
    ck_table_ptr,
    ro_ptr,
    item_base,
    stride_tab,
    num_seqs,
    num_channels,
    stride_x_t,
    stride_x_c,
    stride_y_t,
    stride_y_c,
    stride_w_c,
    stride_w_j,
    stride_cs_page,
    stride_cs_item,
    stride_cs_c,
    stride_cs_j,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    HAS_RO: tl.constexpr,
):
    """Parallel path, phase 1: outputs of a [BLOCK_T tokens of one sequence, BLOCK_C] tile.

    Reads the old state for positions before the step; never writes it (phase 2 does,
    after every phase-1 program has read it: stream order, no race).
    """
    blk = tl.program_id(0)
    c_block = tl.program_id(1)
    seq = _seq_of_block(query_start_loc_ptr, blk, num_seqs, BLOCK_T)
    bos = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - bos
    local = blk - (bos // BLOCK_T + seq)
    if local * BLOCK_T >= q_len:
        return
    item_at = _item_at(table_ptr, seq, stride_tab, item_base, stride_cs_page, stride_cs_item, PER_PAGE)
    init = tl.load(has_initial_state_ptr + seq).to(tl.int32)
    offs_t = local * BLOCK_T + tl.arange(0, BLOCK_T)  # position within this step's tokens
    offs_c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = offs_t < q_len
    c_ok = offs_c < num_channels
    # Scalar flags broadcast as tensors (a scalar in a mask is not portable).
    init_t = (tl.zeros([BLOCK_T], tl.int32) + init) != 0
    if HAS_BIAS:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(
            tl.float32
        )[None, :]
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    rows = (bos + offs_t).to(tl.int64)
    for j in tl.static_range(WIDTH):
        back = WIDTH - 1 - j  # tap j reads x[t - back]
        from_x = t_ok & (offs_t >= back)
        from_state = t_ok & (offs_t < back) & init_t
        xv = tl.load(
            x_ptr + (rows - back)[:, None] * stride_x_t + offs_c[None, :] * stride_x_c,
            mask=from_x[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        # x[-i] of the past lives in state column W-1-i.
        sv = tl.load(
            conv_state_ptr
            + item_at
            + offs_c[None, :] * stride_cs_c
            + (WIDTH - 1 - back + offs_t)[:, None] * stride_cs_j,
            mask=from_state[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(weight_ptr + offs_c * stride_w_c + j * stride_w_j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + rows[:, None] * stride_y_t + offs_c[None, :] * stride_y_c,
        acc.to(y_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _conv_state_update_kernel(
    x_ptr,
    conv_state_ptr,
    query_start_loc_ptr,
    table_ptr,
    has_initial_state_ptr,
    ck_pos_ptr,
    ck_table_ptr,
    ro_ptr,
    item_base,
    stride_tab,
    num_channels,
    stride_x_t,
    stride_x_c,
    stride_cs_page,
    stride_cs_item,
    stride_cs_c,
    stride_cs_j,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    HAS_RO: tl.constexpr,
):
    """Parallel path, phase 2: each sequence's state becomes its last W-1 inputs (and its
    checkpoint, if asked, the W-1 inputs ending at token k: written first, since it may
    read the old state).

    New column i is x_ext[q_len - (W-1) + i]: a step input, or old column q_len + i
    (> i, so columns are read before this loop overwrites them, in order).
    """
    seq = tl.program_id(0)
    c_block = tl.program_id(1)
    bos = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - bos
    if q_len == 0:
        return
    item_at = _item_at(table_ptr, seq, stride_tab, item_base, stride_cs_page, stride_cs_item, PER_PAGE)
    init = tl.load(has_initial_state_ptr + seq).to(tl.int32)
    offs_c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < num_channels
    cs = conv_state_ptr + item_at + offs_c * stride_cs_c
    if HAS_CKPT:
        ck = tl.load(ck_pos_ptr + seq)
        if ck >= 1:
            ck_cs = conv_state_ptr + _item_at(ck_table_ptr, seq, stride_tab, item_base, stride_cs_page,
                                              stride_cs_item, PER_PAGE) + offs_c * stride_cs_c
            for i in tl.static_range(WIDTH - 1):
                p = tl.zeros([BLOCK_C], tl.int32) + (ck - (WIDTH - 1) + i)  # position in the step
                init_c = (tl.zeros([BLOCK_C], tl.int32) + init) != 0
                xv = tl.load(x_ptr + (bos + p).to(tl.int64) * stride_x_t + offs_c * stride_x_c,
                             mask=c_ok & (p >= 0), other=0.0)
                sv = tl.load(cs + (WIDTH - 1 + p) * stride_cs_j, mask=c_ok & (p < 0) & init_c, other=0.0)
                tl.store(ck_cs + i * stride_cs_j,
                         (xv.to(tl.float32) + sv.to(tl.float32)).to(conv_state_ptr.dtype.element_ty), mask=c_ok)
    # A read-only run (a speculative verify run) leaves its state as it was.
    keep = c_ok
    if HAS_RO:
        keep = c_ok & ((tl.zeros([BLOCK_C], tl.int32) + tl.load(ro_ptr + seq).to(tl.int32)) == 0)
    for i in tl.static_range(WIDTH - 1):
        p = tl.zeros([BLOCK_C], tl.int32) + (q_len - (WIDTH - 1) + i)  # position in the step
        init_c = (tl.zeros([BLOCK_C], tl.int32) + init) != 0
        xv = tl.load(x_ptr + (bos + p).to(tl.int64) * stride_x_t + offs_c * stride_x_c, mask=c_ok & (p >= 0), other=0.0)
        sv = tl.load(cs + (WIDTH - 1 + p) * stride_cs_j, mask=c_ok & (p < 0) & init_c, other=0.0)
        tl.store(cs + i * stride_cs_j, (xv.to(tl.float32) + sv.to(tl.float32)).to(conv_state_ptr.dtype.element_ty), mask=keep)


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    token_parallel: bool | None = None,
    *,
    item_base: int,
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_pages: torch.Tensor | None = None,
    read_only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over every sequence from its paged state; see the module doc.

    ``token_parallel``: ``False`` runs one program per (sequence, channel block) walking
    the tokens (one launch, best for decode); ``True`` runs programs over (token block,
    channel block) plus a state-update launch (for prefill, where a serial walk over
    thousands of tokens would idle the GPU); ``None`` picks from shapes alone: serial
    for pure decode batches (``T <= B``), parallel as soon as any prefill may be in.

    Page ids are not range-checked (a device sync per layer); distinct sequences (and
    their checkpoints) must use distinct pages, since their programs run concurrently.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}; use 'silu' or None")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got shape {tuple(x.shape)}")
    c = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be [C={c}, W] (squeeze HF's [C, 1, W]), got {tuple(weight.shape)}")
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise ValueError(f"conv width {width} unsupported by the Triton kernel (2..4); use the reference")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"bias must be [C={c}] or None, got {tuple(bias.shape)}")
    if conv_state.dim() != 4 or tuple(conv_state.shape[2:]) != (c, width - 1):
        raise ValueError(f"conv_state must be a pool [num_pages, per_page, C={c}, W-1={width - 1}], "
                         f"got {tuple(conv_state.shape)}")
    b = state_pages.shape[0] if state_pages.dim() == 2 else -1
    if b < 0 or query_start_loc.dim() != 1 or query_start_loc.shape[0] != b + 1:
        raise ValueError(
            f"state_pages must be [B, cols] and query_start_loc [B+1], got {tuple(state_pages.shape)} "
            f"and {tuple(query_start_loc.shape)}"
        )
    if item_base // conv_state.shape[1] >= state_pages.shape[1]:
        raise ValueError(f"item {item_base} needs more columns than state_pages has ({state_pages.shape[1]})")
    if has_initial_state.dim() != 1 or has_initial_state.shape[0] != b:
        raise ValueError(f"has_initial_state must be [B={b}], got {tuple(has_initial_state.shape)}")
    if (checkpoint_positions is None) != (checkpoint_pages is None):
        raise ValueError("give both checkpoint_positions and checkpoint_pages, or neither")
    if checkpoint_positions is not None and (tuple(checkpoint_positions.shape) != (b,)
                                             or checkpoint_pages.shape != state_pages.shape):
        raise ValueError("checkpoint_positions must be [B] and checkpoint_pages shaped like state_pages")
    if read_only is not None and (tuple(read_only.shape) != (b,) or read_only.dtype not in (torch.bool, torch.int8)
                                  or read_only.device != conv_state.device):
        raise ValueError(f"read_only must be a bool or int8 [B={b}] tensor on {conv_state.device}, got "
                         f"{tuple(read_only.shape)} {read_only.dtype} on {read_only.device}")
    for name, t in (("query_start_loc", query_start_loc), ("state_pages", state_pages)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    tensors = [x, weight, conv_state, query_start_loc, state_pages, has_initial_state]
    if bias is not None:
        tensors.append(bias)
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if b == 0:
        return y
    if has_initial_state.dtype == torch.bool:
        has_initial_state = has_initial_state.view(torch.int8)  # same bytes, no copy
    table = state_pages.contiguous()
    has_ckpt = checkpoint_positions is not None
    ck_pos = checkpoint_positions if has_ckpt else table
    ck_table = checkpoint_pages.to(table.dtype).contiguous() if has_ckpt else table
    has_ro = read_only is not None
    ro = (read_only.view(torch.int8) if read_only.dtype == torch.bool else read_only) if has_ro else has_initial_state
    paged = (table, has_initial_state, ck_pos, ck_table, ro, int(item_base), table.stride(0))
    meta = dict(PER_PAGE=conv_state.shape[1], HAS_CKPT=has_ckpt, HAS_RO=has_ro)
    if token_parallel is None:
        token_parallel = x.shape[0] > b
    if token_parallel:
        block_t = 32
        block_c = min(128, triton.next_power_of_2(c))
        c_blocks = triton.cdiv(c, block_c)
        _causal_conv1d_tokens_kernel[(x.shape[0] // block_t + b, c_blocks)](
            y,
            x,
            weight,
            bias if bias is not None else weight,  # placeholder pointer, never read
            conv_state,
            query_start_loc,
            *paged,
            b,
            c,
            *x.stride(),
            *y.stride(),
            *weight.stride(),
            *conv_state.stride(),
            WIDTH=width,
            HAS_BIAS=bias is not None,
            SILU=activation is not None,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            PER_PAGE=conv_state.shape[1],
            HAS_CKPT=False,  # phase 1 writes no state
            HAS_RO=False,
            num_warps=4,
        )
        _conv_state_update_kernel[(b, c_blocks)](
            x,
            conv_state,
            query_start_loc,
            *paged,
            c,
            *x.stride(),
            *conv_state.stride(),
            WIDTH=width,
            BLOCK_C=block_c,
            **meta,
            num_warps=4,
        )
        return y
    block_c = min(256, triton.next_power_of_2(c))
    grid = (b, triton.cdiv(c, block_c))
    _causal_conv1d_kernel[grid](
        y,
        x,
        weight,
        bias if bias is not None else weight,  # placeholder pointer, never read
        conv_state,
        query_start_loc,
        *paged,
        c,
        *x.stride(),
        *y.stride(),
        *weight.stride(),
        *conv_state.stride(),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        BLOCK_C=block_c,
        **meta,
        num_warps=2 if block_c <= 128 else 4,
    )
    return y
