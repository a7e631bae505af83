"""Tiny Qwen3.5 checkpoints with deterministic random weights, in real HF formats.

Used by tests (the HF model loads the same directory as the oracle), by benchmarks
(the ~10M-parameter ``bench`` preset) and by ``serve``'s embedded default. A checkpoint
is ``config.json`` + safetensors (single or sharded, causal-LM or VL tensor naming)
+ a byte-level ``tokenizer.json`` + ``tokenizer_config.json`` with a chat template,
so ``transformers.AutoTokenizer.from_pretrained(dir)`` works offline.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hybridserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

LIN, FULL = LINEAR_ATTENTION, FULL_ATTENTION

# Token ids of the byte-level tokenizer: byte b is id b, then the special tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258

_BASE: dict[str, Any] = {
    "vocab_size": 272,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "bos_token_id": None,
}

PRESETS: dict[str, dict[str, Any]] = {
    # 4 layers, 3 DeltaNet then attention; GQA 2:1, head_dim 32 (rotary 8);
    # DeltaNet 2 key heads serving 4 value heads (grouped), conv kernel 4.
    "test-a": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": [LIN, LIN, LIN, FULL],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    },
    # 6 layers in a custom pattern; GQA 6:1, head_dim 16 (rotary 8 via factor 0.5);
    # DeltaNet heads ungrouped with different k/v dims, conv kernel 3; tied embeddings.
    "test-b": {
        "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 6,
        "layer_types": [LIN, FULL, LIN, LIN, FULL, LIN],
        "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 3, "linear_num_value_heads": 3,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3,
        "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5, "tie_word_embeddings": True,
    },
    # ~10M parameters, the Qwen3.5 layer pattern (every 4th layer full attention).
    "bench": {
        "hidden_size": 256, "intermediate_size": 1280, "num_hidden_layers": 8,
        "layer_types": [LIN, LIN, LIN, FULL] * 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    },
    # The shapes of the llama.cpp side-by-side bench (issue 22, benches/llamacpp_peer.py):
    # not tiny, but random weights all the same. ~0.1B: hidden 768, 12 layers, the 152K
    # vocabulary of Qwen2/Qwen3 (151,936, as llama.cpp's shipped Qwen BPE vocabulary),
    # tied embeddings (the LM head is the largest GEMM).
    "peer-0.1b": {
        "vocab_size": 151_936, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
        "layer_types": [LIN, LIN, LIN, FULL] * 3,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 128,
        "linear_num_key_heads": 8, "linear_num_value_heads": 16,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": True,
    },
    # Qwen3.5-0.8B's published text shape (hidden 1024, 24 layers, 248K vocabulary,
    # head_dim 256 with a quarter rotary, 16 DeltaNet heads of 128, tied embeddings).
    "peer-0.8b": {
        "vocab_size": 248_320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
        "layer_types": [LIN, LIN, LIN, FULL] * 6,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": True,
    },
    # Mixture-of-experts (model_type qwen3_5_moe_text): a sparse MoE block in every
    # layer. Top-3 of 7 experts (not a power of two), GQA 1:1, a shared expert.
    "moe-a": {
        "hidden_size": 64, "num_hidden_layers": 4, "layer_types": [LIN, LIN, LIN, FULL],
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
        "num_experts": 7, "num_experts_per_tok": 3, "moe_intermediate_size": 40,
        "shared_expert_intermediate_size": 48,
    },
    # Top-1 of 5 experts, GQA 3:1, a custom layer pattern, tied embeddings.
    "moe-b": {
        "hidden_size": 48, "num_hidden_layers": 5, "layer_types": [LIN, FULL, LIN, LIN, FULL],
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 3, "linear_num_value_heads": 3,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3,
        "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5, "tie_word_embeddings": True,
        "num_experts": 5, "num_experts_per_tok": 1, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 32,
    },
    # The bench preset's attention/DeltaNet shape with 64 experts, 4 routed plus a
    # shared expert: 4 x 192 + 512 = 1,280 active MLP channels per token, the dense
    # bench preset's intermediate size (~56M parameters, ~14M active).
    "moe-bench": {
        "hidden_size": 256, "num_hidden_layers": 8, "layer_types": [LIN, LIN, LIN, FULL] * 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
        "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 192,
        "shared_expert_intermediate_size": 512,
    },
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def text_config(preset: str = "test-a", **overrides: Any) -> dict[str, Any]:
    """The ``qwen3_5_text`` config dict of a preset, with overrides applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = {**_BASE, **PRESETS[preset], **overrides}
    rope_theta = cfg.pop("rope_theta")
    partial = cfg.pop("partial_rotary_factor")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta,
                              "partial_rotary_factor": partial}
    cfg["model_type"] = "qwen3_5_moe_text" if cfg.get("num_experts") else "qwen3_5_text"
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise ValueError("layer_types must have num_hidden_layers entries")
    if cfg["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for the byte tokenizer")
    return cfg


def _init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Weights that keep activations O(1) through the stack, so logits are not flat."""
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        # Decay rates spread over fast and slow heads.
        return torch.empty(shape).uniform_(0.05, 2.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)  # plain RMSNorm weight
    if name.endswith("norm.weight"):
        return 0.1 * torch.randn(shape, generator=gen)  # zero-centred (1 + w)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name == "embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    if len(shape) == 2:
        std = 1.0 / math.sqrt(shape[1])
        if leaf[-2] in ("o_proj", "out_proj", "down_proj"):
            std /= math.sqrt(2 * config.num_hidden_layers)
        return std * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)  # biases


def random_state_dict(config: ModelConfig, seed: int = 0, shared_gate_scale: float = 1.0
                      ) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights (local names) for ``config``. MoE experts come per
    expert, as the published checkpoints store them. ``shared_gate_scale`` multiplies
    the shared-expert gates (large: ``sigmoid`` saturates at 0 or 1)."""
    from hybridserve.model.qwen3_5 import Qwen3_5ForServing

    shapes = Qwen3_5ForServing(config, device="meta").checkpoint_shapes()
    gen = torch.Generator().manual_seed(seed)
    out = {name: _init_tensor(name, shape, config, gen).contiguous() for name, shape in shapes.items()}
    for name in out:
        if name.endswith("shared_expert_gate.weight"):
            out[name] = out[name] * shared_gate_scale
    return out


def random_mtp_state_dict(config: ModelConfig, seed: int = 0, shared_gate_scale: float = 1.0
                          ) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights of a complete MTP layer (``mtp.*`` names, as the
    released checkpoints store them; an MoE block for an MoE config), drawn from their
    own generator so the trunk's weights are the same with or without them."""
    from hybridserve.model.qwen3_5 import Qwen3_5ForServing

    shapes = {n: s for n, s in Qwen3_5ForServing(config, device="meta", mtp=True).checkpoint_shapes().items()
              if n.startswith("mtp.")}
    gen = torch.Generator().manual_seed(seed + 7919)
    out = {name: _init_tensor(name.removeprefix("mtp."), shape, config, gen).contiguous()
           for name, shape in shapes.items()}
    for name in out:
        if name.endswith("shared_expert_gate.weight"):
            out[name] = out[name] * shared_gate_scale
    return out


def fuse_experts(tensors: dict[str, torch.Tensor], config: ModelConfig, prefix: str,
                 num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> HF's in-memory fused layout (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), as a checkpoint saved from
    transformers' fused modules carries them. ``num_layers``: of ``prefix`` (default the
    trunk's; 1 for the MTP layer's ``mtp.``)."""
    out = dict(tensors)
    for layer in range(config.num_hidden_layers if num_layers is None else num_layers):
        base = f"{prefix}layers.{layer}.mlp.experts."
        gu, dn = [], []
        for e in range(config.num_experts):
            gu.append(torch.cat([out.pop(f"{base}{e}.gate_proj.weight"), out.pop(f"{base}{e}.up_proj.weight")]))
            dn.append(out.pop(f"{base}{e}.down_proj.weight"))
        out[f"{base}gate_up_proj"] = torch.stack(gu)
        out[f"{base}down_proj"] = torch.stack(dn)
    return out


# Qwen's reasoning and tool-call markers: added tokens that are *not* special (they stay
# in the detokenized text, where the reasoning and tool parsers find them), ids 259..
QWEN_MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                      "</tool_response>")


def qwen_chat_template() -> str:
    """The chat template Qwen3.5 checkpoints ship (tools, XML tool calls, thinking)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "qwen3_5_chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


def write_tokenizer(out_dir: str, vocab_size: int, model_max_length: int = 4096,
                    qwen_chat: bool = False) -> None:
    """Byte-level tokenizer: id b for byte b, ids 256.. for the special tokens.
    ``qwen_chat``: Qwen's markers as added tokens too, and Qwen3.5's real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.token_to_id("<|im_end|>") == IM_END_ID
    if qwen_chat:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_MARKER_TOKENS])
        assert tok.get_vocab_size() <= vocab_size
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": model_max_length,
            "chat_template": qwen_chat_template() if qwen_chat else CHAT_TEMPLATE,
        }, f, indent=2)


def write_tiny_checkpoint(out_dir: str | os.PathLike[str], *, preset: str = "test-a", seed: int = 0,
                          dtype: str = "float32", shards: int = 1, vl_naming: bool = False,
                          fused_experts: bool = False, shared_gate_scale: float = 1.0,
                          qwen_chat: bool = False, mtp: bool = True, **overrides: Any) -> str:
    """Write a complete tiny checkpoint to ``out_dir`` (created) and return its path.

    ``overrides`` replace fields of the preset's text config. Same ``preset``,
    ``overrides`` and ``seed`` give the same weights whatever ``dtype``, ``shards`` or
    ``vl_naming``. ``vl_naming`` writes the ``qwen3_5`` VL layout (nested text_config,
    ``model.language_model.*`` names, plus a few ``model.visual.*`` and ``mtp.*`` tensors
    that a text server must skip). MoE presets: ``fused_experts`` stores HF's fused 3-D
    expert tensors instead of per-expert ones; ``shared_gate_scale`` see
    :func:`random_state_dict`. ``qwen_chat``: the tokenizer also has Qwen's ``<think>`` and
    ``<tool_call>`` markers and Qwen3.5's real chat template (see :func:`write_tokenizer`).
    ``mtp``: a complete random MTP layer (``mtp.*`` at the top level under either naming,
    as the released checkpoints keep it; ``mtp_num_hidden_layers: 1`` in the config),
    from its own generator (:func:`random_mtp_state_dict`); without it the config has
    ``mtp_num_hidden_layers: 0`` (a VL checkpoint still gets one stray ``mtp.*``
    tensor, which a text server must skip).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    text = text_config(preset, **overrides)
    text["dtype"] = dtype
    text["mtp_num_hidden_layers"] = 1 if mtp else 0
    config = ModelConfig.from_dict(text)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    local = random_state_dict(config, seed, shared_gate_scale=shared_gate_scale)
    prefix = "model.language_model." if vl_naming else "model."
    tensors = {("lm_head.weight" if n == "lm_head.weight" else prefix + n): t.to(tdtype)
               for n, t in local.items()}
    if fused_experts and config.is_moe:
        tensors = fuse_experts(tensors, config, prefix)
    if mtp:
        extra = {n: t.to(tdtype) for n, t in random_mtp_state_dict(config, seed, shared_gate_scale).items()}
        if fused_experts and config.is_moe:
            extra = fuse_experts(extra, config, "mtp.", num_layers=1)
        tensors.update(extra)
    moe = config.is_moe
    if vl_naming:
        gen = torch.Generator().manual_seed(seed + 1)
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4, generator=gen).to(tdtype)
        stray = torch.randn(4, 8, generator=gen).to(tdtype)
        if not mtp:
            tensors["mtp.fc.weight"] = stray
        cfg = {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision", "depth": 1, "hidden_size": 8,
                              "num_heads": 1, "intermediate_size": 16, "out_hidden_size": text["hidden_size"],
                              "patch_size": 4, "temporal_patch_size": 2},
            "tie_word_embeddings": text["tie_word_embeddings"],
            "eos_token_id": text["eos_token_id"],
        }
    else:
        cfg = {**text, "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)

    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
            save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"]}, f)
    write_tokenizer(out_dir, text["vocab_size"], text["max_position_embeddings"], qwen_chat=qwen_chat)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridserve.model.tiny OUT_DIR [--preset bench] [--seed 0] ...``"""
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random Qwen3.5 checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="test-a", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--vl-naming", action="store_true")
    a = ap.parse_args(argv)
    print(write_tiny_checkpoint(a.out_dir, preset=a.preset, seed=a.seed, dtype=a.dtype,
                                shards=a.shards, vl_naming=a.vl_naming))


if __name__ == "__main__":
    main()
