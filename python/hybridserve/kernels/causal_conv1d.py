"""Depthwise causal conv1d over a flattened varlen batch with per-sequence state slots.

The conv state of a sequence is the last ``W-1`` inputs it has seen (oldest first),
so a sequence can be fed in chunks of any size, including single decode tokens, and
produce exactly what one pass over the whole sequence would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """``y[t, c] = act(bias[c] + sum_j weight[c, j] * x_ext[t - (W-1) + j, c])`` per sequence.

    * ``x`` ``[T, C]``, sequences delimited by ``query_start_loc`` ``[B+1]``.
    * ``weight`` ``[C, W]`` (HF's ``conv1d.weight`` squeezed), ``bias`` ``[C]`` or None.
    * ``conv_state`` pool ``[S, C, W-1]``: ``x_ext`` before the sequence's first token here
      is ``conv_state[state_slots[b]]`` if ``has_initial_state[b]`` else zeros.
    * Afterwards ``conv_state[state_slots[b]]`` holds the last ``W-1`` inputs (in place).

    Computed in float32; returns ``y`` ``[T, C]`` in ``x``'s dtype. O(T * C * W), no
    per-sequence Python loop: every (token, tap) input is gathered from one table made
    of the step's inputs, the sequences' stored states and a zero row.
    """
    t, c = x.shape
    w = weight.shape[-1]
    if weight.shape[0] != c:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C={c}, W]")
    dev = x.device
    qsl = torch.as_tensor(query_start_loc, device=dev).long()
    slots = torch.as_tensor(state_slots, device=dev).long()
    init = torch.as_tensor(has_initial_state, device=dev).bool()
    nb = slots.shape[0]
    if t == 0 or nb == 0:
        return x.new_empty(t, c)
    lens = qsl[1:] - qsl[:-1]
    seq_of = torch.repeat_interleave(torch.arange(nb, device=dev), lens, output_size=t)
    # Table rows: [0, T) step inputs, [T, T + B*(W-1)) the B stored states (oldest
    # first), last row zeros.
    hist = conv_state.index_select(0, slots).float().transpose(1, 2).reshape(nb * (w - 1), c)
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
    # New state: the W-1 inputs ending at each sequence's last token (empty runs keep theirs).
    seqs = torch.arange(nb, device=dev)
    last = lens[:, None] - (w - 1) + torch.arange(w - 1, device=dev)[None, :]  # [B, W-1]
    new = table[source(seqs[:, None], last)]  # [B, W-1, C]
    ran = lens > 0
    conv_state[slots[ran]] = new[ran].transpose(1, 2).to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)
