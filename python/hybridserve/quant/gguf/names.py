"""Our parameter names (HF's, without ``model.``) <-> llama.cpp's GGUF tensor names for
``qwen35`` / ``qwen35moe``, and the inverses of the transforms llama.cpp's converter
applies on the way (``convert_hf_to_gguf.py``: ``Qwen3NextModel.modify_tensors``,
``_LinearAttentionVReorderBase.modify_tensors``, ``_QwenMtpMixin.filter_tensors``):

- every zero-centred RMSNorm weight (all ``*norm.weight`` but DeltaNet's gated
  ``linear_attn.norm``, and the MTP layer's ``enorm`` / ``hnorm`` / ``shared_head_norm``)
  is stored as ``1 + w``;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- the depthwise conv weight ``[C, 1, W]`` is stored squeezed, ``[C, W]``;
- where DeltaNet has more value heads than key heads, the value heads are reordered
  from grouped by key head (HF: ``[k0 v0, k0 v1, k1 v0, ...]``) to tiled (``[k0 v0, k1 v0,
  k0 v1, ...]``) along every value-head axis: rows of the V part of ``attn_qkv``, of
  ``attn_gate`` (z), ``ssm_alpha`` / ``ssm_beta``, the V channels of the conv, ``ssm_a``,
  ``ssm_dt`` -- and the *columns* (input features) of ``ssm_out``.
- the MTP layer (``mtp.*``) is block ``num_hidden_layers``: its decoder layer under
  the ordinary block names, ``fc`` as ``nextn.eh_proj``, its norms as ``nextn.enorm``,
  ``nextn.hnorm`` and ``nextn.shared_head_norm``.

Row permutations apply to block tensors as they are (rows are independent); a column
permutation of a block tensor is not undone in the blocks: the activation is permuted
before the product instead (:class:`hybridserve.quant.gguf.weights.ColumnPermutedWeight`).
"""

from __future__ import annotations

import re

import torch

from hybridserve.config import ModelConfig

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MTP_TOP = {
    "fc.weight": "nextn.eh_proj.weight",
    "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(local: str, num_layers: int) -> tuple[str, int | None]:
    """(GGUF tensor name, expert index or None) of our parameter ``local``."""
    if local in _TOP:
        return _TOP[local], None
    block, rest = None, None
    if local.startswith("mtp."):
        sub = local[4:]
        if sub in _MTP_TOP:
            return f"blk.{num_layers}.{_MTP_TOP[sub]}", None
        m = re.match(r"^layers\.0\.(.*)$", sub)
        if m:
            block, rest = num_layers, m[1]
    else:
        m = re.match(r"^layers\.(\d+)\.(.*)$", local)
        if m:
            block, rest = int(m[1]), m[2]
    if rest is not None:
        if rest in _LAYER:
            return f"blk.{block}.{_LAYER[rest]}", None
        e = _EXPERT.match(rest)
        if e:
            return f"blk.{block}.ffn_{e[2]}_exps.weight", int(e[1])
    raise KeyError(f"no GGUF tensor for parameter {local!r}")


def plus_one_norm(local: str) -> bool:
    """Whether the converter stored ``local`` as ``1 + w`` (a zero-centred RMSNorm)."""
    return local.endswith("norm.weight") and not local.endswith("linear_attn.norm.weight") or \
        local.endswith(("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"))


def v_head_perm(config: ModelConfig, head_dim: int) -> torch.Tensor | None:
    """``perm`` with ``gguf[j] = hf[perm[j]]`` along a value-head axis of ``head_dim``
    channels per head (the converter's grouped -> tiled reorder); None where there is
    none (as many value heads as key heads)."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nk == nv:
        return None
    n = nv * head_dim
    return torch.arange(n).reshape(nk, nv // nk, head_dim).permute(1, 0, 2).reshape(n)


def row_perm(local: str, config: ModelConfig) -> torch.Tensor | None:
    """``inv`` with ``hf = gguf[inv]`` along dim 0 for parameter ``local`` (None: as stored).
    Applies to plain and block tensors alike."""
    if ".linear_attn." not in local:
        return None
    leaf = local.rsplit("linear_attn.", 1)[1]
    hv = config.linear_value_head_dim
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        p = v_head_perm(config, hv)
        if p is None:
            return None
        qk = 2 * config.linear_key_dim
        return torch.cat([torch.arange(qk), qk + torch.argsort(p)])
    if leaf == "in_proj_z.weight":
        p = v_head_perm(config, hv)
    elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        p = v_head_perm(config, 1)
    else:
        return None
    return None if p is None else torch.argsort(p)


def column_perm(local: str, config: ModelConfig) -> torch.Tensor | None:
    """``perm`` with ``gguf[:, j] = hf[:, perm[j]]`` (``ssm_out``'s input features under the
    value-head reorder); None where the columns are as HF's."""
    if local.endswith("linear_attn.out_proj.weight"):
        return v_head_perm(config, config.linear_value_head_dim)
    return None


def plain_to_hf(local: str, t: torch.Tensor, config: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """A plain GGUF tensor (float32 values) -> our parameter ``local`` of ``shape``, every
    converter transform undone."""
    t = t.float()
    if plus_one_norm(local):
        t = t - 1.0
    if local.endswith("linear_attn.A_log"):
        t = torch.log(-t)
    if t.numel() == int(torch.Size(shape).numel()) and t.dim() != len(shape):
        t = t.reshape(shape)  # conv [C, W] -> [C, 1, W]; a 1-D shared-expert gate -> [1, H]
    inv = row_perm(local, config)
    if inv is not None:
        t = t.index_select(0, inv)
    perm = column_perm(local, config)
    if perm is not None:
        t = t.index_select(1, torch.argsort(perm))
    return t
