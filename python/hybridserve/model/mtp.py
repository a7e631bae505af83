"""Qwen3.5's multi-token-prediction (MTP) layer for serving: the draft model of
speculative decoding.

Checkpoint tensors (``mtp.*``; :mod:`hybridserve.model.loader` maps them here): ``fc``
(``[H, 2H]``), ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.0.*`` (one
full-attention decoder layer, an MoE block in MoE checkpoints) and ``norm``. The
embedding and the LM head are the trunk's.

Row ``r`` combines ``h`` (the trunk's hidden state at position ``t``) with the embedding
of token ``t+1`` and yields the state whose logits predict token ``t+2``::

    x = fc([pre_fc_norm_embedding(embed(tok_{t+1})) | pre_fc_norm_hidden(h)])
    x = decoder_layer(x)          # attention over the MTP layer's own paged KV
    out = norm(x)                 # logits = lm_head(out)

Which hidden state: the trunk's output AFTER its final norm. vLLM's
``Qwen3_5MultiTokenPredictor.forward`` (vllm/model_executor/models/qwen3_5_mtp.py)
receives ``hidden_states`` from the target model, whose ``Qwen3_5Model.forward`` ends in
``hidden_states, _ = self.norm(hidden_states, residual)``, and applies its own
``pre_fc_norm_hidden`` on top of it.

Chained drafts (k > 1): vLLM's proposer (vllm/v1/spec_decode/eagle.py, ``method ==
"mtp"``: ``last_hidden_states = hidden_states = ret_hidden_states``) feeds the MTP's own
output back as the next step's ``h`` -- the state after the MTP's final ``norm``, the
same tensor whose logits it samples. :meth:`MultiTokenPredictor.forward` returns that
state as ``mtp_hidden``.

This module imports no model module but the shared layer pieces: the decoder layer is
built by :class:`~hybridserve.model.qwen3_5.Qwen3_5ForServing` and handed in (the
package's imports form a DAG).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.config import ModelConfig
from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache import HybridCache
from hybridserve.model.layers import Projection, ZeroCenteredRMSNorm


class MultiTokenPredictor(nn.Module):
    """The MTP layer (one decoder layer: ``mtp_num_hidden_layers`` is 1 in every Qwen3.5
    checkpoint). ``decoder_layer`` is a full-attention
    :class:`~hybridserve.model.qwen3_5.DecoderLayer` whose attention reads and writes the
    KV of layer index ``config.num_hidden_layers`` (the arena's extra attention layer,
    :attr:`~hybridserve.model.cache.HybridCache.mtp_layer_index`)."""

    def __init__(self, config: ModelConfig, decoder_layer: nn.Module):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Projection(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.layers = nn.ModuleList([decoder_layer])
        self.norm = ZeroCenteredRMSNorm(h, eps)

    @property
    def layer_index(self) -> int:
        """The cache layer index of the MTP layer's K/V."""
        return self.layers[0].self_attn.layer_idx

    def forward(self, trunk: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch,
                cache: HybridCache, lm_head: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[R, H]``, ``input_ids`` ``[R]``; ``batch`` lays out the R rows
        (positions, slot_mapping into the MTP layer's KV, query_start_loc, seq_lens,
        block_tables, logits_indices). Returns float32 logits ``[S, V]`` for
        ``batch.logits_indices`` and the MTP's normed output ``[R, H]`` (the next chained
        step's ``hidden``). ``lm_head``: the head the logits come from (default the
        trunk's; a reduced draft vocabulary's first rows)."""
        if hidden.shape[0] != input_ids.shape[0]:
            raise ValueError(f"mtp_forward: hidden has {hidden.shape[0]} rows, input_ids {input_ids.shape[0]}")
        e = trunk.embed_tokens(input_ids)
        x = torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1)
        x = self.fc(x)
        cos, sin = trunk.rotary.cos_sin(batch.positions, x.dtype)
        x, residual = self.layers[0](x, None, cos, sin, batch, cache)
        out, _ = self.norm.add_forward(x, residual)
        logits = (lm_head or trunk.lm_head)(out.index_select(0, batch.logits_indices)).float()
        return logits, out
