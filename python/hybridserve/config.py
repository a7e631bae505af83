"""The model's shape, read from a HF ``config.json``: the one fact every part shares.

Pure Python (no torch): the capacity planner, the engine, the model and the
checkpoint generator all read the shape from here. Both HF spellings are accepted:
``model_type`` ``qwen3_5_text`` (the causal LM, fields at top level) and ``qwen3_5``
(the vision-language wrapper, text fields nested under ``text_config``), and the same
two for the mixture-of-experts models: ``qwen3_5_moe_text`` and ``qwen3_5_moe``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from hybridserve.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
# The vision-language wrappers, whose text fields sit under ``text_config``.
_VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "fp8": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"``, ``"float32"``, ...)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3.5 hybrid (attention + Gated DeltaNet) language model.

    A mixture-of-experts model (``num_experts > 0``) has a sparse MoE block in place of
    every layer's dense MLP: ``num_experts`` routed SwiGLU experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token, plus a shared
    expert of ``shared_expert_intermediate_size`` (0: none). Its ``intermediate_size``
    (the dense MLP's) is 0: no layer has a dense MLP. Dense models have 0 in every MoE
    field.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # The raw text-config dict, for whatever a consumer needs beyond the fields above.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------
    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def num_full_attention_layers(self) -> int:
        return len(self.full_attention_layers)

    @property
    def num_linear_attention_layers(self) -> int:
        return len(self.linear_attention_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """Channels of q (and of k) in one DeltaNet layer: key heads x key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels through the causal conv1d: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # ---- loading ------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: hybridserve serves Qwen3.5 hybrid "
                f"models ({' or '.join(SUPPORTED_MODEL_TYPES)}); check config.json"
            )
        top = cfg
        if model_type in _VL_MODEL_TYPES:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(
                    f"config.json has model_type {model_type!r} but no 'text_config' object; "
                    "a Qwen3.5 VL checkpoint nests the language model's fields there"
                )
        else:
            text = cfg

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json is missing required field {key!r}")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                for i in range(num_layers)
            ]
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
            )
        bad = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ConfigError(f"unknown layer types {bad} in layer_types")

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)))
        partial = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported; only 'default' is")

        eos = text.get("eos_token_id", top.get("eos_token_id"))
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        else:
            eos_ids = tuple(int(e) for e in eos)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        moe = _moe_fields(text, need) if model_type in _MOE_MODEL_TYPES else {}
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=0 if moe else int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim", hidden // heads)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=layer_types,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(
                text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
            ),
            torch_dtype=str(
                text.get("dtype") or text.get("torch_dtype") or top.get("dtype")
                or top.get("torch_dtype") or "bfloat16"
            ),
            eos_token_ids=eos_ids,
            model_type=model_type,
            raw=dict(text),
            **moe,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> "ModelConfig":
        """Read a ``config.json`` file, or the one inside a checkpoint directory; a
        ``.gguf`` file's metadata (:mod:`hybridserve.quant.gguf.config`; imported only
        then: it needs torch and the ``gguf`` package)."""
        path = os.fspath(path)
        if path.endswith(".gguf"):
            from hybridserve.quant.gguf.load import gguf_config

            return gguf_config(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path!r}; pass a checkpoint directory") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path!r} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d


def _moe_fields(text: dict[str, Any], need) -> dict[str, int]:
    """The MoE fields of a ``qwen3_5_moe(_text)`` text config, checked.

    HF's Qwen3.5 MoE block always renormalises the top-k weights and puts an MoE block
    in every layer; a config asking otherwise (keys some other MoE families carry) is
    refused rather than served wrong.
    """
    fields = {
        "num_experts": int(need("num_experts")),
        "num_experts_per_tok": int(need("num_experts_per_tok")),
        "moe_intermediate_size": int(need("moe_intermediate_size")),
        "shared_expert_intermediate_size": int(text.get("shared_expert_intermediate_size", 0)),
    }
    e, k = fields["num_experts"], fields["num_experts_per_tok"]
    if e < 1 or not 1 <= k <= e:
        raise ConfigError(
            f"num_experts_per_tok ({k}) must be between 1 and num_experts ({e}), and num_experts at least 1"
        )
    if fields["moe_intermediate_size"] < 1 or fields["shared_expert_intermediate_size"] < 0:
        raise ConfigError("moe_intermediate_size must be positive and shared_expert_intermediate_size >= 0")
    if text.get("norm_topk_prob", True) is False:
        raise ConfigError("norm_topk_prob=false is not supported: Qwen3.5 MoE renormalises the top-k weights")
    if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError(
            "dense-MLP layers in an MoE model (mlp_only_layers / decoder_sparse_step) are not supported: "
            "Qwen3.5 MoE has an MoE block in every layer"
        )
    return fields
