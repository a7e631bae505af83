"""A GGUF file (llama.cpp's ``qwen35`` / ``qwen35moe``) -> :class:`Qwen3_5ForServing`,
with every quantized tensor kept in its blocks.

- A projection whose tensors (one, or the parts of a fused one: q|k|v, gate|up, DeltaNet's
  qkv|z|b|a) include a block tensor is served from them (:meth:`Projection.quantize_`,
  a :class:`~hybridserve.quant.ConcatWeight` of the parts; float parts as
  :class:`~hybridserve.quant.weight.FloatWeight`); the float weight is never
  allocated.
- An MoE layer's routed experts in blocks become
  :class:`~hybridserve.quant.gguf.weights.QuantizedExperts` (views of the file's 3-D
  tensors, per expert); the router and the shared-expert gate load as they are stored.
- A token embedding in blocks becomes
  :class:`~hybridserve.quant.gguf.weights.QuantizedEmbedding`; a tied LM head (no
  ``output.weight``) serves from the same blocks.
- Everything else (norms, conv, gates, float projections) is copied into the model's
  parameters with the converter's transforms undone (:mod:`.names`).
"""

from __future__ import annotations

import os
import warnings

import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model.cache import resolve_dtype
from hybridserve.model.layers import Projection, _Fused
from hybridserve.model.moe import SparseMoeBlock
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.quant.ggml import GGMLWeight
from hybridserve.quant.gguf import names
from hybridserve.quant.gguf.config import hf_config
from hybridserve.quant.gguf.reader import GGUFFile, Tensor
from hybridserve.quant.gguf.weights import ColumnPermutedWeight, QuantizedEmbedding, QuantizedExperts
from hybridserve.quant.weight import ConcatWeight, FloatWeight


def gguf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file (its metadata only)."""
    return ModelConfig.from_dict(hf_config(GGUFFile(path)))


class _Loader:
    def __init__(self, f: GGUFFile, config: ModelConfig, dtype: torch.dtype):
        self.f, self.config, self.dtype = f, config, dtype
        self.used: set[str] = set()

    def tensor(self, local: str) -> tuple[Tensor, int | None]:
        gname, expert = names.gguf_name(local, self.config.num_hidden_layers)
        t = self.f.tensors.get(gname)
        if t is None:
            raise CheckpointError(f"GGUF {self.f.path!r} has no tensor {gname!r} (for {local!r})")
        self.used.add(gname)
        return t, expert

    def part(self, local: str, rows: int, cols: int):
        """Parameter ``local`` (``[rows, cols]``) as a quantized-contract weight."""
        t, _ = self.tensor(local)
        if t.quantized:
            w = t.weight()
            inv = names.row_perm(local, self.config)
            if inv is not None:
                w = GGMLWeight(w.qtype, w.data.index_select(0, inv), w.shape)
            perm = names.column_perm(local, self.config)
            if perm is not None:
                w = ColumnPermutedWeight(w, perm)
        else:
            w = FloatWeight(names.plain_to_hf(local, t.plain(), self.config, (rows, cols)).to(self.dtype),
                            t.type_name.lower())
        if tuple(w.shape) != (rows, cols):
            raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata implies "
                                  f"{[rows, cols]} for {local!r}")
        return w

    def quantize_projections(self, model: Qwen3_5ForServing) -> None:
        tied = self.config.tie_word_embeddings
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, Projection) or (tied and name == "lm_head"):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            pre = f"{parent_name}." if parent_name else ""
            if isinstance(parent, _Fused) and parent._fused_name == leaf:
                parts = [(f"{pre}{hf}.weight", rows) for hf, rows in parent._parts]
            else:
                parts = [(f"{name}.weight", mod.out_features)]
            if not any(self.tensor(local)[0].quantized for local, _ in parts):
                continue
            ws = _merge_same_type([self.part(local, rows, mod.in_features) for local, rows in parts])
            # (A fused projection stays a ConcatWeight, of one part where all merged.)
            mod.quantize_(ws[0] if len(parts) == 1 else ConcatWeight(ws))

    def quantize_experts(self, model: Qwen3_5ForServing) -> None:
        for name, block in list(model.named_modules()):
            if not isinstance(block, SparseMoeBlock):
                continue
            ex = block.experts
            kinds = {}
            for kind in ("gate", "up", "down"):
                kinds[kind], _ = self.tensor(f"{name}.experts.0.{kind}_proj.weight")
            if not any(t.quantized for t in kinds.values()):
                continue
            want = {"gate": (ex.num, ex.inter, ex.hidden), "up": (ex.num, ex.inter, ex.hidden),
                    "down": (ex.num, ex.hidden, ex.inter)}
            per: dict[str, list] = {}
            for kind, t in kinds.items():
                if tuple(t.shape) != want[kind]:
                    raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata "
                                          f"implies {list(want[kind])}")
                if t.quantized:
                    data = t.blocks()
                    per[kind] = [GGMLWeight(t.type_name.lower(), data[e], t.shape[1:]) for e in range(ex.num)]
                else:
                    vals = t.plain().to(self.dtype)
                    per[kind] = [FloatWeight(vals[e], t.type_name.lower()) for e in range(ex.num)]
            block.experts = QuantizedExperts(per["gate"], per["up"], per["down"])

    def load(self, model: Qwen3_5ForServing) -> None:
        """Fill every float parameter the model still has."""
        for local, target in model.checkpoint_tensors().items():
            t, expert = self.tensor(local)
            # (A small tensor llama-quantize put in blocks where the model keeps floats:
            # its values.)
            vals = t.dequantize() if t.quantized else t.plain()
            if expert is not None:
                vals = vals[expert]
            hf = names.plain_to_hf(local, vals, self.config, tuple(target.shape))
            if tuple(hf.shape) != tuple(target.shape):
                raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata implies "
                                      f"{list(target.shape)} for {local!r}")
            with torch.no_grad():
                target.copy_(hf.to(self.dtype))


def _merge_same_type(ws: list) -> list:
    """A fused projection's parts with each run of adjacent block weights of one type
    (and no column permutation) stacked into one: one kernel call per run instead of
    one per file tensor (a decode step at one sequence pays per call), the same
    products (each output row is its own blocks' product either way)."""
    runs: list[list] = []
    for w in ws:
        prev = runs[-1][-1] if runs else None
        if type(w) is GGMLWeight and type(prev) is GGMLWeight and prev.qtype == w.qtype:
            runs[-1].append(w)
        else:
            runs.append([w])
    return [run[0] if len(run) == 1 else GGMLWeight.cat_rows(run) for run in runs]


def load_gguf_model(path: str | os.PathLike[str], dtype: str | torch.dtype = "float32",
                    device: str | torch.device = "cpu", progress: bool = True, load_mtp: bool = False,
                    ) -> tuple[Qwen3_5ForServing, ModelConfig]:
    """Load a GGUF file (or split GGUF) as :func:`hybridserve.model.load_model` loads a
    checkpoint directory; quantized tensors stay in their blocks. CPU only."""
    path = os.fspath(path)
    device = torch.device(device)
    if device.type != "cpu":
        raise ConfigError(f"GGUF checkpoints are served on the CPU (device {device} asked): their block "
                          "kernels are CPU kernels; use device 'cpu' or a safetensors checkpoint")
    dtype = resolve_dtype(dtype)
    f = GGUFFile(path)
    config = ModelConfig.from_dict(hf_config(f))
    if load_mtp and int(config.raw.get("mtp_num_hidden_layers", 0) or 0) < 1:
        raise ConfigError(f"GGUF {path!r} has no MTP (nextn) layer, so speculative decoding with method 'mtp' "
                          "cannot be used: turn speculative decoding off or convert the checkpoint with its MTP layer")
    ld = _Loader(f, config, dtype)
    model = Qwen3_5ForServing(config, dtype=dtype, device="meta", mtp=load_mtp)
    ld.quantize_projections(model)
    ld.quantize_experts(model)
    emb, _ = ld.tensor("embed_tokens.weight")
    qemb = None
    if emb.quantized:
        qemb = emb.weight()
        model.embed_tokens = QuantizedEmbedding(qemb, dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings and qemb is not None:
        model.lm_head.quantize_(qemb)
    model.tie_weights()
    ld.load(model)
    skipped = [n for n in f.tensors if n not in ld.used and not (not load_mtp and _is_mtp(n, config))]
    if skipped:
        warnings.warn(f"ignored {len(skipped)} unexpected tensor(s) in {path}: {skipped[:5]}", stacklevel=2)
    model.store_cpu_layout()
    model.eval()
    model.gguf_path = path
    return model, config


def _is_mtp(gguf_name: str, config: ModelConfig) -> bool:
    return gguf_name.startswith(f"blk.{config.num_hidden_layers}.") or ".nextn." in gguf_name
