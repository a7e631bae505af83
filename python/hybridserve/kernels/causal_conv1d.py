"""Depthwise causal conv1d over a flattened varlen batch with per-sequence paged state.

The conv state of a sequence is the last ``W-1`` inputs it has seen (oldest first),
so a sequence can be fed in chunks of any size, including single decode tokens, and
produce exactly what one pass over the whole sequence would. It is one item of the
conv pool ``[num_pages, per_page, C, W-1]``, found through the sequence's state page
table (:mod:`hybridserve.kernels.state_pages`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.kernels.state_pages import check_pool, item_coords


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}; use 'silu' or None")


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    *,
    item_base: int,
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_pages: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t, c] = act(bias[c] + sum_j weight[c, j] * x_ext[t - (W-1) + j, c])`` per sequence.

    * ``x`` ``[T, C]``, sequences delimited by ``query_start_loc`` ``[B+1]``.
    * ``weight`` ``[C, W]`` (HF's ``conv1d.weight`` squeezed), ``bias`` ``[C]`` or None.
    * ``conv_state`` pool ``[num_pages, per_page, C, W-1]``; sequence ``b``'s state is
      item ``item_base`` of its row of ``state_pages``: ``x_ext`` before the sequence's
      first token is that item if ``has_initial_state[b]`` else zeros.
    * Afterwards the item holds the last ``W-1`` inputs (in place).
    * ``checkpoint_positions[b] = k >= 1``: the last ``W-1`` inputs up to the run's
      ``k``-th token also go to item ``item_base`` of ``checkpoint_pages[b]``.

    Computed in float32; returns ``y`` ``[T, C]`` in ``x``'s dtype. O(T * C * W), no
    per-sequence Python loop: every (token, tap) input is gathered from one table made
    of the step's inputs, the sequences' stored states and a zero row.
    """
    t, c = x.shape
    w = weight.shape[-1]
    if weight.shape[0] != c:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C={c}, W]")
    check_pool(conv_state, (c, w - 1), "conv state")
    dev = x.device
    qsl = torch.as_tensor(query_start_loc, device=dev).long()
    table_rows = torch.as_tensor(state_pages, device=dev)
    init = torch.as_tensor(has_initial_state, device=dev).bool()
    nb = init.shape[0]
    if t == 0 or nb == 0:
        return x.new_empty(t, c)
    pages, within = (a[:, 0] for a in item_coords(table_rows, item_base, 1, conv_state.shape[1]))
    lens = qsl[1:] - qsl[:-1]
    seq_of = torch.repeat_interleave(torch.arange(nb, device=dev), lens, output_size=t)
    # Table rows: [0, T) step inputs, [T, T + B*(W-1)) the B stored states (oldest
    # first), last row zeros.
    hist = conv_state[pages, within].float().transpose(1, 2).reshape(nb * (w - 1), c)
    table = torch.cat([x.float(), hist, x.new_zeros(1, c, dtype=torch.float32)])
    zero_row = table.shape[0] - 1

    def source(seq, pos_in_seq):
        """Table row of input position ``pos_in_seq`` (may be negative: the past)."""
        from_x = qsl[seq] + pos_in_seq
        from_state = t + seq * (w - 1) + (w - 1) + pos_in_seq
        past = torch.where(init[seq], from_state, torch.full_like(from_state, zero_row))
        return torch.where(pos_in_seq >= 0, from_x, past)

    pos = torch.arange(t, device=dev) - qsl[seq_of]
    taps = torch.arange(w, device=dev) - (w - 1)  # offsets -(W-1)..0
    rows = source(seq_of[:, None], pos[:, None] + taps[None, :])  # [T, W]
    y = torch.einsum("twc,cw->tc", table[rows], weight.float())
    if bias is not None:
        y = y + bias.float()
    seqs = torch.arange(nb, device=dev)
    hw_ar = torch.arange(w - 1, device=dev)[None, :]
    if checkpoint_positions is not None:
        ck = torch.as_tensor(checkpoint_positions, device=dev).long()
        want = ck >= 0
        if bool(((ck < 1) | (ck > lens))[want].any()):
            b = int(torch.nonzero(want & ((ck < 1) | (ck > lens)))[0])
            raise ValueError(f"checkpoint position {int(ck[b])} of sequence {b} must lie in 1..{int(lens[b])}")
        if bool(want.any()):
            # The W-1 inputs ending at the k-th scheduled token.
            ck_new = table[source(seqs[:, None], ck[:, None] - (w - 1) + hw_ar)]  # [B, W-1, C]
            ck_pages, ck_within = (a[:, 0] for a in item_coords(
                torch.as_tensor(checkpoint_pages, device=dev), item_base, 1, conv_state.shape[1]))
            conv_state[ck_pages[want], ck_within[want]] = ck_new[want].transpose(1, 2).to(conv_state.dtype)
    # New state: the W-1 inputs ending at each sequence's last token (empty runs keep theirs).
    last = lens[:, None] - (w - 1) + hw_ar  # [B, W-1]
    new = table[source(seqs[:, None], last)]  # [B, W-1, C]
    ran = lens > 0
    conv_state[pages[ran], within[ran]] = new[ran].transpose(1, 2).to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


# ----------------------------------------------------------------------------- CPU path
class Conv1dPlan:
    """Row layout of one step for :func:`causal_conv1d_cpu` (shared by all DeltaNet layers).

    Each sequence with tokens becomes one segment of an extended input: its ``W-1``
    stored inputs (or zero rows when it starts fresh), then its tokens. One depthwise
    pass over the concatenated segments yields every output; windows straddling two
    segments are computed and never read (``W-1`` rows per sequence). A checkpoint at
    token ``k`` is the ``W-1`` rows of the segment ending at its ``k``-th token.
    """

    def __init__(self, query_start_loc, has_initial_state, width: int,
                 device: torch.device | str = "cpu", checkpoint_positions=None):
        import numpy as np

        def host(a, dtype):
            return np.asarray(a.tolist() if torch.is_tensor(a) else a, dtype=dtype)

        qsl = host(query_start_loc, np.int64)
        init = host(has_initial_state, bool)
        hw = width - 1
        t, nb = int(qsl[-1]), len(init)
        lens = qsl[1:] - qsl[:-1]
        act = np.nonzero(lens > 0)[0]
        seg_len = lens[act] + hw
        seg_start = np.cumsum(seg_len) - seg_len
        seg = np.repeat(np.arange(len(act)), seg_len)
        off = np.arange(int(seg_len.sum())) - seg_start[seg]
        b = act[seg]
        # Table rows: [0, T) this step's inputs, then B*(W-1) stored inputs, then a zero row.
        zero_row = t + nb * hw
        hist = np.where(init[b], t + b * hw + np.minimum(off, hw - 1), zero_row)
        ext = np.where(off < hw, hist, qsl[b] + off - hw)

        def tt(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=device)

        self.width = width
        self.ext_rows = tt(ext)
        self.out_rows = tt(np.repeat(seg_start, lens[act]) + (np.arange(t) - np.repeat(qsl[act], lens[act])))
        self.state_rows = tt((seg_start + lens[act])[:, None] + np.arange(hw)[None, :])
        self.active = tt(act)
        self.num_seqs = nb
        self.checkpoint_seqs = self.checkpoint_rows = None
        if checkpoint_positions is not None:
            ck = host(checkpoint_positions, np.int64)
            bad = np.nonzero((ck >= 0) & ((ck < 1) | (ck > lens)))[0]
            if len(bad):
                raise ValueError(f"checkpoint position {int(ck[bad[0]])} of sequence {int(bad[0])} "
                                 f"must lie in 1..{int(lens[bad[0]])}")
            want = np.nonzero(ck >= 0)[0]
            if len(want):
                seg_of = np.full(nb, -1)
                seg_of[act] = np.arange(len(act))
                self.checkpoint_seqs = tt(want)
                self.checkpoint_rows = tt((seg_start[seg_of[want]] + ck[want])[:, None] + np.arange(hw)[None, :])


def causal_conv1d_cpu(x, weight, bias, conv_state, query_start_loc, state_pages, has_initial_state,
                      activation: str | None = "silu", plan: Conv1dPlan | None = None, *, item_base: int,
                      checkpoint_positions=None, checkpoint_pages=None) -> torch.Tensor:
    """The CPU path; same contract as :func:`causal_conv1d_ref`. O((T + B*W) * C * W):
    one gather of ``T + B*(W-1)`` rows instead of ``T*W``, then ``W`` shifted
    multiply-adds over the whole step."""
    t, c = x.shape
    w = weight.shape[-1]
    if weight.shape[0] != c:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C={c}, W]")
    check_pool(conv_state, (c, w - 1), "conv state")
    if plan is None:
        plan = Conv1dPlan(query_start_loc, has_initial_state, w, x.device, checkpoint_positions)
    if t == 0 or plan.num_seqs == 0:
        return x.new_empty(t, c)
    hw = w - 1
    per_page = conv_state.shape[1]
    pages, within = (a[:, 0] for a in item_coords(torch.as_tensor(state_pages, device=x.device),
                                                    item_base, 1, per_page))
    hist = conv_state[pages, within].transpose(1, 2).reshape(-1, c)
    table = torch.cat([x, hist.to(x.dtype), x.new_zeros(1, c)]).float()
    ext = table.index_select(0, plan.ext_rows)  # [N, C]
    wf = weight.float()
    n = ext.shape[0] - hw
    y = ext[:n] * wf[:, 0]
    for j in range(1, w):
        y.addcmul_(ext[j:j + n], wf[:, j])
    y = y.index_select(0, plan.out_rows)
    if bias is not None:
        y = y + bias.float()
    if plan.checkpoint_seqs is not None:
        cs = plan.checkpoint_seqs
        ckp, ckw = (a[:, 0] for a in item_coords(torch.as_tensor(checkpoint_pages, device=x.device),
                                                 item_base, 1, per_page))
        snap = ext.index_select(0, plan.checkpoint_rows.reshape(-1)).view(-1, hw, c).transpose(1, 2)
        conv_state[ckp.index_select(0, cs), ckw.index_select(0, cs)] = snap.to(conv_state.dtype)
    new = ext.index_select(0, plan.state_rows.reshape(-1)).view(-1, hw, c).transpose(1, 2)
    act = plan.active
    conv_state[pages.index_select(0, act), within.index_select(0, act)] = new.to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)
