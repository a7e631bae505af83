"""Qwen3.5's multi-token-prediction (MTP) layer, under the tensor names of the released
checkpoints (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*``, ``mtp.norm``); the embedding and LM head are the trunk's.

Row t combines the trunk's hidden state h_t with the embedding of token t+1 and
predicts token t+2 (DeepSeek-V3's MTP depth 1, as Qwen3-Next/Qwen3.5 ship it).

Where h_t is taken: after the trunk's final norm. vLLM's ``Qwen3NextMultiTokenPredictor``
(and Qwen3.5's, which reuses it) receives ``hidden_states`` from the target model's
forward, which ends in ``hidden_states, _ = self.norm(hidden_states, residual)``, and
applies its own ``pre_fc_norm_hidden`` on top; HF's ``last_hidden_state`` is the same
post-norm tensor.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm


def mtp_layer_config(text_config):
    """The trunk's config with one full-attention layer: the MTP decoder layer's shape."""
    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    return cfg


class MTP(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.config = mtp_layer_config(text_config)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(self.config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_embeddings, position_ids: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, H] trunk states h_t (post final norm); next_embeds: [B, T, H]
        embeddings of tokens t+1. Returns the normed MTP states whose LM-head logits
        predict tokens t+2."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=mask,
                      position_ids=position_ids)
        return self.norm(x)


def mtp_state_dict(mtp: MTP) -> dict[str, torch.Tensor]:
    return {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
