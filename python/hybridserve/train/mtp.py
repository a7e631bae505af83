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
    # A config read with AutoConfig (export.load_trained: what `train mtp` and `train eval`
    # load) has no attention implementation set; HF then builds no causal mask and falls
    # back to eager attention without one, so row t would see rows > t (including h_{t+1},
    # whose LM head is the target). A model's from_pretrained/constructor sets it; here it
    # is set explicitly so the layer is causal however the config was obtained.
    if getattr(cfg, "_attn_implementation", None) is None:
        cfg._attn_implementation = "sdpa"
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


class _ChainKV:
    """The K/V of the chain's earlier passes, as the one attention layer's ``past_key_values``:
    each pass's keys/values are appended after those of the passes before it (HF's
    ``Cache.update`` contract: returns all keys/values so far)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v


def _chain_mask(lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of pass ``d = len(lens)``'s rows over the keys of passes
    1..d (``lens[e]`` rows each): row i (the chain that pass 1 started at position i) sees
    pass 1's rows 0..i (the context the MTP prefill wrote from the trunk) and row i of every
    later pass (its own chain's drafts), as the drafter's paged KV holds them."""
    n = lens[-1]
    i = torch.arange(n)[:, None]
    parts = [torch.arange(lens[0])[None, :] <= i]
    parts += [torch.arange(m)[None, :] == i for m in lens[1:]]
    ok = torch.cat(parts, dim=1)
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, torch.finfo(dtype).min)[None, None]


def mtp_chain(mtp: MTP, hidden: torch.Tensor, embeds: torch.Tensor, rotary_emb, depth: int,
              chain_embeds=None) -> list[torch.Tensor]:
    """The MTP layer chained ``depth`` times as the drafter chains it, for a chain starting
    at every position at once. ``hidden``: [B, T, H] trunk states (post final norm);
    ``embeds``: [B, T, H] embeddings of the sequence's tokens 0..T-1. Returns the normed
    states of pass d = 1..depth, ``[B, T - d, H]``: row i of pass d sits at position
    i + d - 1 and predicts token i + d + 1.

    Pass 1 is :meth:`MTP.forward` over every position (row i: h_i, token i+1), the MTP
    prefill. Pass d > 1, row i: the previous pass's normed output at row i (the tensor the
    drafter feeds on, ``NativeDecodeStep.mtp_draft``'s ``h = b.normed``) and token i + d,
    attending to pass 1's K/V at positions 0..i and its own chain's K/V at positions
    i+1..i+d-1 (what the drafter's paged MTP KV holds for that chain).

    ``chain_embeds(d, prev)``: the embeddings fed to pass d > 1 given ``prev`` (pass d-1's
    states ``[B, T - d, H]``); None: the sequence's own tokens ``embeds[:, d:]`` (a draft
    that was accepted is the sequence's token)."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    b, t, _ = hidden.shape
    if t <= depth:
        raise ValueError(f"a chain of depth {depth} needs more than {depth} positions, got {t}")
    kv = _ChainKV()
    layer = mtp.layers[0]
    lens: list[int] = []
    outs: list[torch.Tensor] = []
    prev = hidden[:, : t - 1]
    for d in range(1, depth + 1):
        n = t - d
        prev = prev[:, :n]
        e = embeds[:, d:] if d == 1 or chain_embeds is None else chain_embeds(d, prev)
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(prev)], -1))
        pos = (torch.arange(n) + (d - 1)).unsqueeze(0).expand(b, -1)
        lens.append(n)
        x = layer(x, position_embeddings=rotary_emb(x, pos), attention_mask=_chain_mask(lens, x.dtype),
                  position_ids=pos, past_key_values=kv)
        prev = mtp.norm(x)
        outs.append(prev)
    return outs
