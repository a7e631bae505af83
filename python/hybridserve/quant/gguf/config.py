"""llama.cpp's ``qwen35`` / ``qwen35moe`` metadata -> the HF text config dict that
:class:`hybridserve.config.ModelConfig` takes.

The keys are those llama.cpp's converter writes (``convert_hf_to_gguf.py``,
``Qwen3NextModel.set_gguf_parameters`` and the base ``TextModel``'s) and its loader
reads back (``src/models/qwen35*.cpp``):

- ``{arch}.block_count`` counts the MTP (nextn) layers too; ``{arch}.nextn_predict_layers``
  says how many of the last ones they are.
- Layer types: ``{arch}.attention.recurrent_layers`` (one bool per block, DeltaNet =
  true) when present, else every ``{arch}.full_attention_interval``-th layer is attention.
- DeltaNet: ``ssm.conv_kernel``, ``ssm.state_size`` (key head dim), ``ssm.group_count``
  (key heads), ``ssm.time_step_rank`` (value heads), ``ssm.inner_size`` (value heads x
  value head dim).
- Rope: ``rope.freq_base``, ``rope.dimension_count`` (the rotary dims: head_dim x
  partial_rotary_factor), ``rope.dimension_sections`` (mrope; text-only positions make
  all sections the same rope).
"""

from __future__ import annotations

from typing import Any

from hybridserve.config import FULL_ATTENTION, LINEAR_ATTENTION
from hybridserve.errors import ConfigError
from hybridserve.quant.gguf.reader import GGUFFile

ARCHITECTURES = ("qwen35", "qwen35moe")


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The HF text config (``qwen3_5_text`` or ``qwen3_5_moe_text``) of GGUF ``f``."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"GGUF {f.path!r} has architecture {arch!r}; hybridserve serves Qwen3.5 GGUFs, "
            f"llama.cpp's {' or '.join(ARCHITECTURES)}")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in f.fields:
            raise ConfigError(f"GGUF {f.path!r} ({arch}) lacks metadata key {full!r}")
        return f.fields[full]

    def get(key: str, default: Any = None) -> Any:
        return f.fields.get(f"{arch}.{key}", default)

    nextn = int(get("nextn_predict_layers", 0) or 0)
    blocks = int(need("block_count"))
    layers = blocks - nextn
    if layers < 1:
        raise ConfigError(f"GGUF {f.path!r}: block_count {blocks} with {nextn} nextn layers leaves no layer")
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ConfigError(f"GGUF {f.path!r}: attention.recurrent_layers has {len(recurrent)} entries "
                              f"for {layers} layers")
        layer_types = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers]]
    else:
        interval = int(get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    if isinstance(kv, list):  # a per-layer array: the attention layers' value
        kv = max(kv)
    head_dim = int(get("attention.key_length", hidden // heads))
    value_len = int(get("attention.value_length", head_dim))
    if value_len != head_dim:
        raise ConfigError(f"GGUF {f.path!r}: key_length {head_dim} != value_length {value_len}; "
                          "Qwen3.5 attention has one head dim")
    rot = int(get("rope.dimension_count", head_dim // 4))
    k_heads = int(need("ssm.group_count"))
    v_heads = int(need("ssm.time_step_rank"))
    k_dim = int(need("ssm.state_size"))
    inner = int(need("ssm.inner_size"))
    if inner % v_heads:
        raise ConfigError(f"GGUF {f.path!r}: ssm.inner_size {inner} is not a multiple of {v_heads} value heads")
    vocab = _vocab_size(f)
    moe = arch == "qwen35moe"
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": k_dim,
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
        "max_position_embeddings": int(get("context_length", 32768)),
        # Stored as float32: its 7 significant digits give back the decimal written (1e-06).
        "rms_norm_eps": float(f"{float(need('attention.layer_norm_rms_epsilon')):.7g}"),
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(f"{float(get('rope.freq_base', 1e7)):.7g}"),
                            "partial_rotary_factor": rot / head_dim},
        # Tied when the file has no separate LM head (llama.cpp then reads token_embd).
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "mtp_num_hidden_layers": nextn,
        "dtype": "bfloat16",
    }
    sections = get("rope.dimension_sections")
    if sections is not None:
        cfg["rope_parameters"]["mrope_section"] = [int(s) for s in sections[:3]]
        cfg["rope_parameters"]["mrope_interleaved"] = True
    if moe:
        cfg["num_experts"] = int(need("expert_count"))
        cfg["num_experts_per_tok"] = int(need("expert_used_count"))
        ff = need("expert_feed_forward_length")
        cfg["moe_intermediate_size"] = int(max(ff) if isinstance(ff, list) else ff)
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
    else:
        ff = need("feed_forward_length")
        cfg["intermediate_size"] = int(max(ff) if isinstance(ff, list) else ff)
    for key, tok in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        v = f.get(f"tokenizer.ggml.{tok}_token_id")
        cfg[key] = None if v is None else int(v)
    return cfg


def _vocab_size(f: GGUFFile) -> int:
    """The embedding's rows (what the model computes over); the tokenizer's list may be shorter."""
    emb = f.tensors.get("token_embd.weight")
    if emb is not None:
        return int(emb.shape[0])
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ConfigError(f"GGUF {f.path!r} has neither token_embd.weight nor tokenizer.ggml.tokens")
    return len(tokens)
