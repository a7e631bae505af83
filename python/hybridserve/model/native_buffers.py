"""The native decode step's buffers: numpy views of torch tensors, the activations of a
step of a given row count (allocated once, with the column views of the fused
projections), and a verify step's per-layer in_proj outputs (the ring's memory). See
:mod:`hybridserve.model.native_decode`."""

from __future__ import annotations

import numpy as np
import torch

_BF16 = torch.bfloat16

# The key of ``ForwardBatch.op_plans`` under which a step's attention layout with runs
# as one decode query per row lies (query_start_loc, seq_lens, block tables; see
# :func:`decode_rows_layout`): every attention layer of the step, module path and
# native step alike, reads it instead of the batch's own layout.
DECODE_ROWS = "rows_as_decodes"


def _view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy, no copy (bfloat16 as uint16 bits)."""
    t = t.detach()
    return t.view(torch.uint16).numpy() if t.dtype == _BF16 else t.numpy()


class _Buffers:
    """The activations of a ``rows``-row step, allocated once, with their numpy views."""

    def __init__(self, model, rows: int):
        c, dt = model.config, model.dtype

        def buf(width: int) -> tuple[torch.Tensor, np.ndarray]:
            t = torch.empty(rows, width, dtype=dt)
            return t, _view(t)

        h = c.hidden_size
        self.residual, self.residual_np = buf(h)
        self.normed, self.normed_np = buf(h)
        self.mixer_out, self.mixer_out_np = buf(h)
        self.mlp_out, self.mlp_out_np = buf(h)
        self.gate_up, self.gate_up_np = buf(2 * c.intermediate_size)
        self.act_np = self.gate_up_np[:, : c.intermediate_size]
        if c.linear_attention_layers:
            kd, vd, hv = c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
            cd = c.linear_conv_dim
            self.proj, p = buf(cd + vd + 2 * hv)
            self.proj_np = p
            # What a speculative step's ring records (GatedDeltaNet.forward): the conv
            # inputs and the gate inputs b, a (adjacent columns).
            self.ring_mixed, self.ring_ba = self.proj[:, :cd], self.proj[:, cd + vd:]
            # in_proj's rows: [conv input | z | b | a] (see GatedDeltaNet.forward's split).
            self.mixed_np, self.z_np = p[:, :cd], p[:, cd:cd + vd]
            self.b_np, self.a_np = p[:, cd + vd:cd + vd + hv], p[:, cd + vd + hv:]
            _, conv = buf(cd)
            self.conv_np = conv
            self.q_np, self.k_np, self.v_np = conv[:, :kd], conv[:, kd:2 * kd], conv[:, 2 * kd:]
            self.rule_out, self.rule_out_np = buf(vd)
        if c.full_attention_layers:
            nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            qr, kvr = nh * d * 2, nkv * d
            self.qkv, qkv = buf(qr + 2 * kvr)
            self.qkv_np = qkv
            self.qg_np, self.kx_np, self.vx_np = qkv[:, :qr], qkv[:, qr:qr + kvr], qkv[:, qr + kvr:]
            # The output gate: the second half of each head's [q_h | gate_h] rows.
            self.gate = self.qkv[:, :qr].view(rows, nh, 2 * d)[..., d:]
            self.rq_np = _view(torch.empty(rows, nh * d, dtype=dt))
            self.rk_np = _view(torch.empty(rows, kvr, dtype=dt))
            self.attn, self.attn_np = buf(nh * d)
            self.attn3 = self.attn.view(rows, nh, d)
            self.sig = torch.empty(rows, nh, d, dtype=dt)
            self.gated, self.gated_np = buf(nh * d)
            self.gated3 = self.gated.view(rows, nh, d)
        # bfloat16: the LM head's output, widened to float32 for the caller (a new tensor
        # each step: the engine may still read the last step's logits).
        self.logits = torch.empty(rows, c.vocab_size, dtype=dt) if dt == _BF16 else None
        self.logits_np = _view(self.logits) if self.logits is not None else None


class _SpecProj:
    """One DeltaNet layer's in_proj output of a verify step, with its column views."""

    __slots__ = ("proj_np", "ring_mixed", "ring_ba", "mixed_np", "z_np", "ba_np", "b_np", "a_np")
