"""Test-side GGUF writer: a tiny random Qwen3.5 checkpoint (the project's tiny generator,
dense and MoE) written with ``gguf.GGUFWriter`` in llama.cpp's layout, as its converter
(``convert_hf_to_gguf.py``, ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``) writes it:
its metadata keys, tensor names (``gguf``'s own ``TensorNameMap`` for the architecture;
the MTP layer's nextn names as llama.cpp's ``constants.py`` spells them) and transforms
(norms ``1 + w``, ``ssm_a = -exp(A_log)``, squeezed conv, experts stacked ``[E, out, in]``,
value heads reordered grouped -> tiled where DeltaNet has more value than key heads).

Alongside the file, :func:`write_gguf` returns the oracle's weights: HF's state dict of
the weights the file holds, i.e. every tensor dequantized by ``gguf``'s reference and
the transforms undone here (written independently of ``hybridserve.quant.gguf.names``),
which a HF ``Qwen3_5ForCausalLM`` loads (:func:`write_oracle_dir`).
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

from hybridserve.config import ModelConfig
from hybridserve.model.tiny import (CHAT_TEMPLATE, ENDOFTEXT_ID, IM_END_ID, SPECIAL_TOKENS, random_mtp_state_dict,
                                    random_state_dict, text_config, write_tokenizer)

QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0, "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1, "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K, "q6_k": gguf.GGMLQuantizationType.Q6_K,
}
ARCH = {False: "qwen35", True: "qwen35moe"}


def _v_perm(nk: int, nv: int, head_dim: int) -> np.ndarray:
    """The converter's grouped -> tiled value-head order: ``new = old[perm]``."""
    return np.arange(nv * head_dim).reshape(nk, nv // nk, head_dim).transpose(1, 0, 2).reshape(-1)


def _block_ok(qtype: str, cols: int) -> bool:
    size = gguf.GGML_QUANT_SIZES[QTYPES[qtype]][0]
    return cols % size == 0


def _quantize(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, its values as the reference reads them back)."""
    kind = QTYPES[qtype]
    if qtype == "f32":
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == "f16":
        q = w.astype(np.float16)
        return q, q.astype(np.float32)
    try:
        q = quantize(w.astype(np.float32), kind)
    except NotImplementedError:
        q = _random_kquant(w, qtype, rng)
    return q, dequantize(q, kind).astype(np.float32).reshape(w.shape)


def _random_kquant(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """A valid k-quant tensor of ``w``'s shape and roughly its scale (gguf has no k-quant
    quantizer): random quants and sub-block scales, the super-block scales set so the
    values' standard deviation matches ``w``'s. The oracle reads its values back."""
    kind = QTYPES[qtype]
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = w.shape
    nblk = rows * cols // size
    blocks = rng.integers(0, 256, size=(nblk, nbytes), dtype=np.uint8)
    # Offsets of the fp16 scales: q4_k / q5_k d at 0, dmin at 2; q6_k d at the end.
    d_at = [0, 2] if qtype in ("q4_k", "q5_k") else [nbytes - 2]

    def set_scale(val: float):
        for at in d_at:
            blocks[:, at:at + 2] = np.frombuffer(np.float16(val).tobytes(), dtype=np.uint8)

    set_scale(1.0)
    probe = dequantize(blocks.reshape(rows, -1), kind)
    scale = float(w.std()) / max(float(probe.std()), 1e-12)
    set_scale(scale)
    return blocks.reshape(rows, cols // size * nbytes)


def _is_zero_centred_norm(name: str) -> bool:
    return (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")) or name.endswith(
        ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"))


def write_gguf(path: str | os.PathLike[str], *, preset: str = "test-a", qtype: str = "q8_0", seed: int = 0,
               embed_qtype: str | None = None, types: dict[str, str] | None = None, mtp: bool = False,
               split_max_tensors: int = 0, arch: str | None = None, tokenizer_dir: str | None = None,
               **overrides) -> tuple[str, dict, dict]:
    """Write the tiny ``preset`` as a GGUF at ``path``: 2-D projection weights in ``qtype``
    (where their input features hold whole blocks, else Q8_0, else F32, as llama-quantize
    falls back), the embedding in ``embed_qtype`` (default ``qtype``), ``types``: GGUF
    tensor name suffix -> type overrides (e.g. ``{"ffn_down": "q6_k"}``); norms, conv and
    gates F32. ``split_max_tensors``: a split GGUF of that many tensors per part (the
    returned path is the first part). ``arch``: write another architecture name.
    ``tokenizer_dir``: store that HF tokenizer (tokenizer.json + tokenizer_config.json) as
    the converter does, instead of the tiny byte tokenizer.

    Returns (path, the HF text config dict, the oracle's HF state dict: ``model.*`` /
    ``lm_head.weight`` / ``mtp.*`` float32 tensors as the file holds them)."""
    path = os.fspath(path)
    text = text_config(preset, **overrides)
    text["mtp_num_hidden_layers"] = 1 if mtp else 0
    config = ModelConfig.from_dict(text)
    local = random_state_dict(config, seed)
    if mtp:
        local.update(random_mtp_state_dict(config, seed))
    moe = config.is_moe
    n_layers = config.num_hidden_layers
    blocks = n_layers + (1 if mtp else 0)
    rng = np.random.default_rng(seed + 17)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35, blocks)

    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    hk, hv = config.linear_key_head_dim, config.linear_value_head_dim
    reorder = nk != nv

    def v_rows(t: np.ndarray, head_dim: int) -> np.ndarray:  # forward: grouped -> tiled
        return t[_v_perm(nk, nv, head_dim)]

    def v_rows_back(t: np.ndarray, head_dim: int) -> np.ndarray:
        return t[np.argsort(_v_perm(nk, nv, head_dim))]

    # (HF name with model./mtp. prefix, GGUF name, stored array, qtype) and the oracle.
    out: list[tuple[str, np.ndarray, str]] = []
    oracle: dict[str, torch.Tensor] = {}

    def gguf_name(hf: str) -> str:
        if hf.startswith("mtp."):
            sub = hf[4:]
            top = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
                   "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}
            if sub in top:
                return f"blk.{n_layers}.{top[sub]}"
            hf = f"model.layers.{n_layers}." + sub.removeprefix("layers.0.")
        if hf.endswith(".dt_bias"):
            hf = hf.removesuffix(".dt_bias") + ".dt_proj.bias"
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(hf)
        return name

    def pick_type(gname: str, cols: int, default: str) -> str:
        for suffix, t in (types or {}).items():
            if suffix in gname:
                default = t
        if default in ("f32", "f16", "bf16") or _block_ok(default, cols):
            return default
        return "q8_0" if _block_ok("q8_0", cols) else "f32"

    # Experts stacked per layer, as the converter merges them.
    stacked: dict[str, list[np.ndarray]] = {}
    for lname, t in local.items():
        hf = lname if lname.startswith("mtp.") else ("lm_head.weight" if lname == "lm_head.weight" else f"model.{lname}")
        a = t.float().numpy()
        if ".mlp.experts." in hf:
            base, _, rest = hf.partition(".mlp.experts.")
            e, kind = rest.split(".", 1)
            stacked.setdefault(f"{base}.mlp.experts.{kind}", []).append(a)
            continue
        out.append((hf, a, "plain"))
    for hf, parts in stacked.items():
        out.append((hf, np.stack(parts), "experts"))

    writer = gguf.GGUFWriter(path, arch or ARCH[moe], split_max_tensors=split_max_tensors)
    for hf, a, kind in out:
        gname = gguf_name(hf)
        # Forward transforms (the converter's).
        if hf.endswith(".A_log"):
            a = -np.exp(a)
        if "conv1d" in hf:
            a = a.squeeze()
        if _is_zero_centred_norm(hf):
            a = a + 1.0
        if reorder and ".linear_attn." in hf:
            if ".in_proj_qkv." in hf:
                a = np.concatenate([a[:2 * nk * hk], v_rows(a[2 * nk * hk:], hv)])
            elif ".in_proj_z." in hf:
                a = v_rows(a, hv)
            elif ".in_proj_a." in hf or ".in_proj_b." in hf or hf.endswith((".A_log", ".dt_bias")):
                a = v_rows(a, 1)
            elif "conv1d" in hf:
                a = np.concatenate([a[:2 * nk * hk], v_rows(a[2 * nk * hk:], hv)])
            elif ".out_proj." in hf:
                a = a[:, _v_perm(nk, nv, hv)]
        a = np.ascontiguousarray(a, dtype=np.float32)
        is_matrix = a.ndim >= 2 and "conv1d" not in hf and not gname.endswith(("ffn_gate_inp.weight",
                                                                                 "ffn_gate_inp_shexp.weight"))
        if gname == "token_embd.weight":
            q = pick_type(gname, a.shape[-1], embed_qtype or qtype)
        elif is_matrix:
            q = pick_type(gname, a.shape[-1], qtype)
        else:
            q = "f32"
        if q == "bf16":
            bits = torch.from_numpy(a).to(torch.bfloat16)
            stored = bits.view(torch.int16).numpy().view(np.uint16)
            back = bits.float().numpy()
        else:
            flat = a.reshape(-1, a.shape[-1])
            stored, back = _quantize(flat, q, rng)
            back = back.reshape(a.shape)
            if q not in ("f32", "f16"):
                stored = stored.reshape(*a.shape[:-1], stored.shape[-1])
        if q in ("f32", "f16"):
            writer.add_tensor(gname, stored.reshape(a.shape))
        else:
            writer.add_tensor(gname, stored, raw_dtype=QTYPES[q])
        # The oracle: the stored values with the transforms undone.
        b = back
        if reorder and ".linear_attn." in hf:
            if ".in_proj_qkv." in hf or "conv1d" in hf:
                b = np.concatenate([b[:2 * nk * hk], v_rows_back(b[2 * nk * hk:], hv)])
            elif ".in_proj_z." in hf:
                b = v_rows_back(b, hv)
            elif ".in_proj_a." in hf or ".in_proj_b." in hf or hf.endswith((".A_log", ".dt_bias")):
                b = v_rows_back(b, 1)
            elif ".out_proj." in hf:
                b = b[:, np.argsort(_v_perm(nk, nv, hv))]
        if _is_zero_centred_norm(hf):
            b = b - 1.0
        if hf.endswith(".A_log"):
            b = np.log(-b)
        b = torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))
        if kind == "experts":
            for e in range(b.shape[0]):
                oracle[hf.replace(".mlp.experts.", f".mlp.experts.{e}.") ] = b[e].clone()
        else:
            oracle[hf] = b.reshape(local[hf.removeprefix("model.") if hf.startswith("model.") else hf].shape)

    # Metadata, as the converter writes it.
    writer.add_block_count(blocks)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if not moe:
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(hk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(hv * nv)
    recurrent = [t == "linear_attention" for t in config.layer_types] + [False] * (blocks - n_layers)
    writer.add_array(f"{arch or ARCH[moe]}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(config.rotary_dim)
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    if tokenizer_dir:
        _add_hf_tokenizer(writer, tokenizer_dir, config.vocab_size)
    else:
        _add_tokenizer(writer, config.vocab_size)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        stem = path.removesuffix(".gguf")
        parts = sorted(p for p in os.listdir(os.path.dirname(path) or ".")
                       if p.startswith(os.path.basename(stem) + "-") and p.endswith(".gguf"))
        path = os.path.join(os.path.dirname(path), parts[0])
    text["mtp_num_hidden_layers"] = 1 if mtp else 0
    return path, text, oracle


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The tiny byte-level tokenizer (:func:`hybridserve.model.tiny.write_tokenizer`) in
    ``tokenizer.ggml.*`` keys, as the converter's ``_set_vocab_gpt2`` writes a BPE one."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + list(SPECIAL_TOKENS)
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    # Padding up to the embedding rows, as the converter pads a vocabulary.
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([])
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_hf_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: str, vocab_size: int) -> None:
    """A HF byte-level BPE tokenizer in ``tokenizer.ggml.*`` keys, as the converter's
    ``_set_vocab_gpt2`` stores one: tokens in id order (added ones too), padded to the
    embedding's rows with UNUSED ``[PAD{i}]``; added special tokens CONTROL, other added
    tokens USER_DEFINED; merges as ``"a b"``; the Qwen3.5 pre-tokenizer; the template."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    kinds = {}
    for a in tj["added_tokens"]:
        by_id[a["id"]] = a["content"]
        kinds[a["id"]] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(kinds.get(i, gguf.TokenType.NORMAL))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    writer.add_eos_token_id(ids[tc["eos_token"]])
    writer.add_pad_token_id(ids[tc["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tc["chat_template"])


def write_oracle_dir(out_dir: str | os.PathLike[str], text: dict, oracle: dict) -> str:
    """A HF checkpoint directory of the oracle's weights (float32), for
    ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM.from_pretrained``, with the tiny
    byte tokenizer."""
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    moe = bool(text.get("num_experts"))
    cfg = {**text, "dtype": "float32",
           "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in oracle.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out_dir, text["vocab_size"], text["max_position_embeddings"])
    return out_dir
