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
from hybridserve.errors import CheckpointError
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
    given, else :func:`param_count` x the model dtype's size; ``mtp``: with the MTP
    layer's (speculative decoding)."""
    if checkpoint_dir is not None:
        return checkpoint_weight_bytes(checkpoint_dir, mtp=mtp)
    return (param_count(config) + (mtp_param_count(config) if mtp else 0)) * dtype_bytes(config.torch_dtype)
