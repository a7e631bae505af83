"""How many parameters a model holds, and how many bytes its weights take on a device.

Counts follow HF transformers' layouts exactly (``Qwen3_5ForCausalLM`` for dense,
``Qwen3_5MoeForCausalLM`` for mixture-of-experts; for the VL wrappers only the language
model, which is all hybridserve loads). Every parameter is also classed as **sharded**
or **replicated** under tensor parallelism (:func:`param_split`), the rule
:mod:`.devices` uses to say how many devices a model needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.planner.units import MiB


@dataclass(frozen=True)
class ParamSplit:
    """Parameters of one part of the model: split across tensor-parallel ranks, or a full
    copy on every rank."""

    sharded: int = 0
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def __add__(self, other: "ParamSplit") -> "ParamSplit":
        return ParamSplit(self.sharded + other.sharded, self.replicated + other.replicated)

    def __mul__(self, k: int) -> "ParamSplit":
        return ParamSplit(self.sharded * k, self.replicated * k)


def param_split(config: ModelConfig) -> dict[str, ParamSplit]:
    """Parameters by part, each split into sharded / replicated under tensor parallelism.

    Parts: ``embed_tokens``; ``lm_head`` (0 if ``tie_word_embeddings``); per
    full-attention layer q_proj (doubled for the sigmoid output gate), k/v/o_proj, q/k
    RMSNorm (and biases when ``attention_bias``); per DeltaNet layer in_proj_qkv/z/b/a,
    depthwise conv1d (no bias), dt_bias, A_log, the gated RMSNorm over one head,
    out_proj; per layer the dense SwiGLU MLP, or for MoE models the router ``mlp.gate``
    [E, H], E routed SwiGLU experts of ``moe_intermediate_size`` (all resident), the
    shared expert of ``shared_expert_intermediate_size`` and ``shared_expert_gate``
    [1, H]; two RMSNorms per layer and the final norm.

    **The tensor-parallel rule** (vLLM's, written down here because the device count
    depends on it): *replicated* on every rank are the RMSNorm weights (they scale the
    hidden size or one head's width, which no rank splits), the router ``mlp.gate``,
    ``shared_expert_gate`` and ``o_proj``'s bias (all tiny, needed whole by every rank);
    everything else is *sharded* 1/N: the projections and experts by heads or by
    intermediate width, conv1d / dt_bias / A_log with their heads, and embed_tokens /
    lm_head by vocabulary rows.
    """
    c = config
    h = c.hidden_size
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    attn = ParamSplit(sharded=h * 2 * q_out + 2 * h * kv_out + q_out * h, replicated=2 * c.head_dim)
    if c.raw.get("attention_bias", False):
        attn += ParamSplit(sharded=2 * q_out + 2 * kv_out, replicated=h)
    conv_dim = c.linear_conv_dim
    value_dim = c.linear_value_dim
    heads = c.linear_num_value_heads
    delta = ParamSplit(
        sharded=(
            h * conv_dim  # in_proj_qkv
            + h * value_dim  # in_proj_z
            + 2 * h * heads  # in_proj_b, in_proj_a
            + conv_dim * c.linear_conv_kernel_dim  # conv1d, depthwise, no bias
            + 2 * heads  # dt_bias, A_log
            + value_dim * h  # out_proj
        ),
        replicated=c.linear_value_head_dim,  # gated norm, shared across heads
    )
    if c.num_experts > 0:
        experts = c.num_experts * 3 * h * c.moe_intermediate_size  # gate, up, down each
        shared = 3 * h * c.shared_expert_intermediate_size
        ffn = ParamSplit(
            sharded=experts + shared,
            # Router [E, H]; the shared expert's scalar gate [1, H] when there is one.
            replicated=c.num_experts * h + (h if c.shared_expert_intermediate_size else 0),
        )
    else:
        ffn = ParamSplit(sharded=3 * h * c.intermediate_size)
    vocab = c.vocab_size * h
    return {
        "embed_tokens": ParamSplit(sharded=vocab),
        "lm_head": ParamSplit(sharded=0 if c.tie_word_embeddings else vocab),
        "full_attention": attn * c.num_full_attention_layers,
        "linear_attention": delta * c.num_linear_attention_layers,
        ("moe" if c.num_experts > 0 else "mlp"): ffn * c.num_hidden_layers,
        "norms": ParamSplit(replicated=c.num_hidden_layers * 2 * h + h),
    }


def mtp_param_count(config: ModelConfig) -> int:
    """Parameters of the MTP layer (speculative decoding's drafter, ``mtp.*``): ``fc``
    [H, 2H], one full-attention decoder layer with the trunk's MLP or MoE block, its two
    RMSNorms, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm``. The
    embedding and LM head are the trunk's."""
    parts = param_split(config)
    h = config.hidden_size
    layers = config.num_hidden_layers
    attn = parts["full_attention"].total // max(1, config.num_full_attention_layers)
    if not config.num_full_attention_layers:  # a shape without attention layers still drafts with one
        one = dataclasses.replace(config, layer_types=("full_attention",), num_hidden_layers=1)
        attn = param_split(one)["full_attention"].total
    ffn = parts["moe" if config.num_experts > 0 else "mlp"].total // max(1, layers)
    return 2 * h * h + attn + ffn + 5 * h


def param_breakdown(config: ModelConfig) -> dict[str, int]:
    """Parameter count of the language model by part (see :func:`param_split`)."""
    return {k: v.total for k, v in param_split(config).items()}


def param_count(config: ModelConfig) -> int:
    """Total parameters of the language model (see :func:`param_split`)."""
    return sum(param_breakdown(config).values())


def active_param_count(config: ModelConfig) -> int:
    """Parameters one token runs through: for MoE, ``num_experts_per_tok`` routed experts
    of ``num_experts`` (the "A3B" of a model's name); for dense, all of them."""
    total = param_count(config)
    if config.num_experts <= 0:
        return total
    idle_experts = config.num_experts - config.num_experts_per_tok
    idle = idle_experts * 3 * config.hidden_size * config.moe_intermediate_size
    return total - idle * config.num_hidden_layers


#: Tensors of a checkpoint that a text-only engine never loads.
_NOT_LOADED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
#: The MTP layer's tensors (hybridserve.model.loader loads them with load_mtp).
_MTP_PREFIXES = ("mtp.", "model.mtp.")


def checkpoint_weight_bytes(path: str | os.PathLike[str], *, text_only: bool = True, mtp: bool = False) -> int:
    """Bytes of tensor data in a checkpoint's ``*.safetensors`` files (headers excluded).

    Reads only each file's JSON header (no tensor data, no torch). With ``text_only``,
    tensors the text engine does not load (vision tower, multi-token-prediction head)
    are left out; ``mtp`` keeps the MTP layer's (loaded for speculative decoding).
    Raises :class:`CheckpointError` if there are no safetensors files or a header is
    malformed.
    """
    path = os.fspath(path)
    if path.endswith(".gguf"):
        return gguf_weight_bytes(path, mtp=mtp)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; pass a checkpoint directory")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {path!r}; pass a config.json to count weights "
            "from the parameter count instead"
        )
    total = 0
    for name in files:
        fpath = os.path.join(path, name)
        try:
            with open(fpath, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > 100 * MiB:
                    raise ValueError(f"header length {hlen} is implausible")
                header = json.loads(f.read(hlen))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if text_only and key.startswith(_NOT_LOADED_PREFIXES) and not (
                        mtp and key.startswith(_MTP_PREFIXES)):
                    continue
                begin, end = info["data_offsets"]
                total += int(end) - int(begin)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise CheckpointError(f"cannot read safetensors header of {fpath!r}: {e}") from None
    return total


def gguf_weight_bytes(path: str | os.PathLike[str], *, mtp: bool = False) -> int:
    """Bytes of tensor data in a GGUF file (every part of a split one) as stored: the
    quantized blocks' bytes, which is what serving holds. The MTP (nextn) layer's tensors
    (block ``block_count - nextn_predict_layers``) count only with ``mtp``. Reads the
    headers through the ``gguf`` package (memory-mapped; no tensor data is read)."""
    from gguf import GGUFReader

    from hybridserve.quant.gguf.reader import split_parts

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file {path!r} does not exist")
    total, mtp_block = 0, None
    for i, part in enumerate(split_parts(path)):
        r = GGUFReader(part, "r")
        if i == 0:
            arch = r.fields["general.architecture"].contents()
            nextn = r.fields.get(f"{arch}.nextn_predict_layers")
            blocks = r.fields.get(f"{arch}.block_count")
            if nextn is not None and blocks is not None and int(nextn.contents()) > 0:
                mtp_block = f"blk.{int(blocks.contents()) - int(nextn.contents())}."
        for t in r.tensors:
            if not mtp and mtp_block is not None and t.name.startswith(mtp_block):
                continue
            total += int(t.n_bytes)
    return total


def weight_bytes(config: ModelConfig, checkpoint_dir: str | os.PathLike[str] | None = None,
                 mtp: bool = False) -> int:
    """Device bytes of the weights: the checkpoint's tensor bytes if a directory is
    given, else the quantized form's bytes when the config has a ``quantization_config``
    (:func:`quantized_weight_bytes`), else :func:`param_count` x the model dtype's size;
    ``mtp``: with the MTP layer's (speculative decoding)."""
    if checkpoint_dir is not None:
        return checkpoint_weight_bytes(checkpoint_dir, mtp=mtp)
    mtp_bytes = mtp_param_count(config) * dtype_bytes(config.torch_dtype) if mtp else 0
    quantized = quantized_weight_bytes(config)
    if quantized is not None:
        # The MTP layer is counted in the model dtype (an upper bound: a GGUF made
        # with --no-mtp carries none).
        return quantized + mtp_bytes
    return param_count(config) * dtype_bytes(config.torch_dtype) + mtp_bytes


# ---- quantized forms --------------------------------------------------------------
#
# A preset (or config.json) with a ``quantization_config`` is counted in the bytes its
# quantized form holds, tensor by tensor:
#
# * ``{"quant_method": "gguf", "file_type": "Q4_K_M"}`` (a hybridserve preset field: a
#   GGUF keeps its metadata in the file, not in a config.json): the tensors llama.cpp's
#   ``convert_hf_to_gguf.py`` writes for ``qwen35`` / ``qwen35moe``, each in the type
#   ``llama-quantize`` gives it for that file type (see :func:`gguf_tensor_plan`);
# * ``{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert":
#   [...]}`` (Qwen's official FP8 checkpoints): every linear layer's weight in e4m3, one
#   byte a weight, plus one ``weight_scale_inv`` per 128 x 128 block; the embedding,
#   the norms, conv1d, ``A_log`` / ``dt_bias`` and the modules the list names stay in
#   the model dtype (see :func:`fp8_tensor_plan`).

#: ggml block formats: (weights per block, bytes per block).
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
#: llama-quantize file types: the type most tensors get.
GGUF_FILE_TYPES: dict[str, str] = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0",
    "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
}
# llama-quantize's fallback when a row is not a whole number of 256-blocks.
_GGUF_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
#: Bytes of one FP8 block scale (``weight_scale_inv``): Qwen's FP8 checkpoints store them
#: in bfloat16 beside the e4m3 weights (a checkpoint directory is counted from its headers).
FP8_SCALE_BYTES = 2


@dataclass(frozen=True)
class QuantTensor:
    """One tensor of a quantized form: ``shape`` in the format's own order (GGUF:
    ggml's, the row length first; FP8: HF's ``[out, in]``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def _ggml_bytes(shape: tuple[int, ...], qtype: str) -> int:
    block, nbytes = GGML_BLOCKS[qtype]
    n = 1
    for s in shape:
        n *= s
    if shape[0] % block:
        raise ValueError(f"a {qtype} row holds whole blocks of {block}; row length {shape[0]} is not one")
    return n // block * nbytes


def _use_more_bits(i: int, n: int) -> bool:
    # llama-quantize's choice of the layers that get more bits (src/llama-quant.cpp).
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _gguf_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, ggml shape, quantizable) of every tensor ``convert_hf_to_gguf.py`` writes for
    the text model (no MTP layer), in the order llama-quantize visits them (by layer).
    Not quantizable: 1-D tensors, norms, conv1d, the router, the shared-expert gate
    (``[H, 1]``, one ggml dimension), all float32 from the converter."""
    c = config
    h = c.hidden_size
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    nv = c.linear_num_value_heads
    out: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (h, c.vocab_size), True)]
    if not c.tie_word_embeddings:
        out.append(("output.weight", (h, c.vocab_size), True))
    out.append(("output_norm.weight", (h,), False))
    for i, kind in enumerate(c.layer_types):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), False), (p + "post_attention_norm.weight", (h,), False)]
        if kind == "linear_attention":
            out += [(p + "ssm_a", (nv,), False), (p + "ssm_dt.bias", (nv,), False),
                    (p + "ssm_conv1d.weight", (c.linear_conv_kernel_dim, c.linear_conv_dim), False),
                    (p + "ssm_norm.weight", (c.linear_value_head_dim,), False),
                    (p + "ssm_alpha.weight", (h, nv), True), (p + "ssm_beta.weight", (h, nv), True),
                    (p + "attn_qkv.weight", (h, c.linear_conv_dim), True),
                    (p + "attn_gate.weight", (h, c.linear_value_dim), True),
                    (p + "ssm_out.weight", (c.linear_value_dim, h), True)]
        else:
            out += [(p + "attn_q_norm.weight", (c.head_dim,), False), (p + "attn_k_norm.weight", (c.head_dim,), False),
                    (p + "attn_q.weight", (h, 2 * q_out), True), (p + "attn_k.weight", (h, kv_out), True),
                    (p + "attn_v.weight", (h, kv_out), True), (p + "attn_output.weight", (q_out, h), True)]
        if c.num_experts > 0:
            e, im = c.num_experts, c.moe_intermediate_size
            out += [(p + "ffn_gate_inp.weight", (h, e), False),
                    (p + "ffn_gate_exps.weight", (h, im, e), True), (p + "ffn_up_exps.weight", (h, im, e), True),
                    (p + "ffn_down_exps.weight", (im, h, e), True)]
            if c.shared_expert_intermediate_size:
                s = c.shared_expert_intermediate_size
                out += [(p + "ffn_gate_inp_shexp.weight", (h, 1), False),
                        (p + "ffn_gate_shexp.weight", (h, s), True), (p + "ffn_up_shexp.weight", (h, s), True),
                        (p + "ffn_down_shexp.weight", (s, h), True)]
        else:
            im = c.intermediate_size
            out += [(p + "ffn_gate.weight", (h, im), True), (p + "ffn_up.weight", (h, im), True),
                    (p + "ffn_down.weight", (im, h), True)]
    return out


def gguf_tensor_plan(config: ModelConfig, file_type: str) -> list[QuantTensor]:
    """Every tensor of the text model's GGUF at ``file_type`` with the type
    ``llama-quantize`` gives it (no imatrix, no overrides), as ``src/llama-quant.cpp``
    decides for ``qwen35`` / ``qwen35moe``:

    * most weights get the file type's base type (Q4_K for Q4_K_M, Q5_K for Q5_K_M);
    * the LM head (the embedding when tied) gets Q6_K unless the file type is Q8_0 (then
      Q8_0); an untied embedding gets the base type;
    * for Q4_K_M and Q5_K_M, the V-like projection (``attn_v`` of attention layers,
      ``attn_qkv`` of DeltaNet layers) and every ``ffn_down*`` get Q6_K in the layers
      ``use_more_bits`` picks (the first and last eighth, every third between);
    * a row that is not a whole number of 256-weight blocks falls back (Q4_K to Q5_0,
      Q5_K to Q5_1, Q6_K to Q8_0; F16 when even that does not fit);
    * float32 stays float32 (norms, ``ssm_a`` / ``ssm_dt``, conv1d, the router, the
      shared-expert gate).
    F16 / BF16 / F32 are the converter's own outputs (every quantizable tensor in it).
    """
    if file_type not in GGUF_FILE_TYPES:
        raise ConfigError(f"GGUF file type {file_type!r} is not one hybridserve serves; "
                          f"choose one of {sorted(GGUF_FILE_TYPES)}")
    base = GGUF_FILE_TYPES[file_type]
    n = config.num_hidden_layers
    kq = file_type in ("Q4_K_M", "Q5_K_M")
    plan = []
    for name, shape, quantizable in _gguf_shapes(config):
        if name.endswith("ffn_gate_inp_shexp.weight") and base not in ("F32", "F16", "BF16"):
            shape = shape[:1]  # llama-quantize rewrites it with ggml's dimension count (1)
        if not quantizable:
            qtype = "F32"
        elif base in ("F32", "F16", "BF16"):
            qtype = base
        else:
            qtype = base
            layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
            head = name == "output.weight" or (name == "token_embd.weight" and config.tie_word_embeddings)
            if head:
                qtype = "Q8_0" if base == "Q8_0" or shape[0] % GGML_BLOCKS[base][0] else "Q6_K"
            elif kq and (name.endswith(("attn_v.weight", "attn_qkv.weight")) or ".ffn_down" in name):
                qtype = "Q6_K" if _use_more_bits(layer, n) else base
            if shape[0] % GGML_BLOCKS[qtype][0]:
                qtype = _GGUF_FALLBACK.get(qtype, qtype)
                if shape[0] % GGML_BLOCKS[qtype][0]:
                    qtype = "F16"
        plan.append(QuantTensor(name, shape, qtype, _ggml_bytes(shape, qtype)))
    return plan


def _module_matches(name: str, keys: list[str]) -> bool:
    # A key names a module by its full name or by a dot-separated tail / part of it
    # ("lm_head", "mlp.gate", "model.layers.0.mlp.gate"), never by a prefix of a word:
    # "mlp.gate" keeps the router, not "mlp.gate_proj".
    dotted = f".{name}."
    return any(f".{k}." in dotted for k in keys)


def fp8_tensor_plan(config: ModelConfig, quant: dict) -> list[QuantTensor]:
    """Every tensor of the text model's FP8 checkpoint (HF names and ``[out, in]``
    shapes; MoE experts one by one, as the checkpoints store them): a linear layer's
    weight in e4m3 plus its ``weight_scale_inv`` of ``ceil(out/b0) x ceil(in/b1)``
    scales unless ``modules_to_not_convert`` names its module; every other tensor in
    the model dtype."""
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    keep = list(quant.get("modules_to_not_convert") or [])
    wide = dtype_bytes(config.torch_dtype)
    plan = []
    for name, shape, linear in _hf_shapes(config):
        n = 1
        for s in shape:
            n *= s
        module = name.rsplit(".", 1)[0]
        if linear and not _module_matches(module, keep):
            plan.append(QuantTensor(name, shape, "F8_E4M3", n))
            scales = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            plan.append(QuantTensor(module + ".weight_scale_inv", scales, "BF16", scales[0] * scales[1] * FP8_SCALE_BYTES))
        else:
            plan.append(QuantTensor(name, shape, config.torch_dtype, n * wide))
    return plan


def _hf_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is a linear layer's weight) of the text model's HF tensors."""
    c = config
    h = c.hidden_size
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    nv = c.linear_num_value_heads
    out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (c.vocab_size, h), False)]
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, h), True))
    out.append(("model.norm.weight", (h,), False))
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), False), (p + "post_attention_layernorm.weight", (h,), False)]
        if kind == "linear_attention":
            a = p + "linear_attn."
            out += [(a + "in_proj_qkv.weight", (c.linear_conv_dim, h), True),
                    (a + "in_proj_z.weight", (c.linear_value_dim, h), True),
                    (a + "in_proj_b.weight", (nv, h), True), (a + "in_proj_a.weight", (nv, h), True),
                    (a + "conv1d.weight", (c.linear_conv_dim, 1, c.linear_conv_kernel_dim), False),
                    (a + "dt_bias", (nv,), False), (a + "A_log", (nv,), False),
                    (a + "norm.weight", (c.linear_value_head_dim,), False),
                    (a + "out_proj.weight", (h, c.linear_value_dim), True)]
        else:
            a = p + "self_attn."
            out += [(a + "q_proj.weight", (2 * q_out, h), True), (a + "k_proj.weight", (kv_out, h), True),
                    (a + "v_proj.weight", (kv_out, h), True), (a + "o_proj.weight", (h, q_out), True),
                    (a + "q_norm.weight", (c.head_dim,), False), (a + "k_norm.weight", (c.head_dim,), False)]
        if c.num_experts > 0:
            m = p + "mlp."
            out.append((m + "gate.weight", (c.num_experts, h), True))
            for e in range(c.num_experts):
                x = f"{m}experts.{e}."
                out += [(x + "gate_proj.weight", (c.moe_intermediate_size, h), True),
                        (x + "up_proj.weight", (c.moe_intermediate_size, h), True),
                        (x + "down_proj.weight", (h, c.moe_intermediate_size), True)]
            if c.shared_expert_intermediate_size:
                s = c.shared_expert_intermediate_size
                out += [(m + "shared_expert.gate_proj.weight", (s, h), True),
                        (m + "shared_expert.up_proj.weight", (s, h), True),
                        (m + "shared_expert.down_proj.weight", (h, s), True),
                        (m + "shared_expert_gate.weight", (1, h), True)]
        else:
            m = p + "mlp."
            out += [(m + "gate_proj.weight", (c.intermediate_size, h), True),
                    (m + "up_proj.weight", (c.intermediate_size, h), True),
                    (m + "down_proj.weight", (h, c.intermediate_size), True)]
    return out


def quantization_of(config: ModelConfig) -> dict | None:
    """The config's ``quantization_config`` when the planner counts its form, else None;
    a ConfigError for a method it does not know (counting bf16 bytes instead would
    overstate the weights several times over)."""
    quant = config.raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in ("gguf", "fp8"):
        raise ConfigError(f"the planner counts GGUF (quant_method 'gguf') and FP8 (quant_method 'fp8') weights; "
                          f"quantization_config.quant_method is {method!r}")
    return quant


def quantized_tensor_plan(config: ModelConfig) -> list[QuantTensor] | None:
    """The tensors of the config's quantized form (None for an unquantized config)."""
    quant = quantization_of(config)
    if quant is None:
        return None
    if quant["quant_method"] == "gguf":
        return gguf_tensor_plan(config, str(quant.get("file_type", "")))
    return fp8_tensor_plan(config, quant)


def quantized_weight_bytes(config: ModelConfig) -> int | None:
    """Bytes of the config's quantized form (None for an unquantized config)."""
    plan = quantized_tensor_plan(config)
    return None if plan is None else sum(t.nbytes for t in plan)


def describe_quantization(config: ModelConfig) -> str | None:
    """A short name of the quantized form for reports ("GGUF Q4_K_M", "FP8 e4m3, 128x128 blocks")."""
    quant = quantization_of(config)
    if quant is None:
        return None
    if quant["quant_method"] == "gguf":
        return f"GGUF {quant.get('file_type')} (llama-quantize's per-tensor types)"
    b = quant.get("weight_block_size") or [128, 128]
    return f"FP8 e4m3 with {b[0]}x{b[1]} block scales, unconverted modules in {config.torch_dtype}"
