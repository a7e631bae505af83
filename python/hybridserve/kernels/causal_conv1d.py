"""Depthwise causal conv1d over a flattened varlen batch with per-sequence state slots.

The conv state of a sequence is the last ``W-1`` inputs it has seen (oldest first),
so a sequence can be fed in chunks of any size, including single decode tokens, and
produce exactly what one pass over the whole sequence would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _as_list(t: torch.Tensor | list) -> list:
    return t if isinstance(t, list) else t.tolist()


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

    Computed in float32; returns ``y`` ``[T, C]`` in ``x``'s dtype. O(T * C * W).
    """
    w = weight.shape[-1]
    qsl = _as_list(query_start_loc)
    slots = _as_list(state_slots)
    init = _as_list(has_initial_state)
    y = torch.empty_like(x)
    wf = weight.float()[:, None, :]
    bf = None if bias is None else bias.float()
    for b, slot in enumerate(slots):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        xb = x[start:end].float().t()  # [C, L]
        if init[b]:
            past = conv_state[slot].float()
        else:
            past = xb.new_zeros(xb.shape[0], w - 1)
        ext = torch.cat([past, xb], dim=1)  # [C, W-1+L]
        yb = F.conv1d(ext[None], wf, bf, groups=ext.shape[0])[0]  # [C, L]
        y[start:end] = _activate(yb, activation).t().to(x.dtype)
        conv_state[slot] = ext[:, ext.shape[1] - (w - 1):].to(conv_state.dtype)
    return y
