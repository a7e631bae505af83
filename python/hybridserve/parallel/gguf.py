"""One rank's shard of a GGUF file (llama.cpp's ``qwen35`` / ``qwen35moe``), its block
tensors sliced along block boundaries.

The cuts are :class:`~hybridserve.parallel.shard.ShardPlan`'s, in HF's order: each
quantized projection part is cut from a view of the file's bytes (memory-mapped: only
this rank's rows and columns are read and copied):

- column-parallel parts (q/k/v, DeltaNet's qkv|z|b|a, gate/up) by rows: rows of a block
  tensor are independent, so any row range is a byte range; where the converter
  reordered the value heads, the rows this rank needs are picked through the inverse
  permutation;
- row-parallel ones (o_proj, ssm_out, down, the MTP layer's fc) by columns:
  :meth:`GGMLWeight.cols`, whole blocks only (32 columns, 256 for the k-quants); for
  ``ssm_out`` under the value-head reorder, one run of columns per value head of a key
  head's group (:meth:`ColumnPermutedWeight.cols`). A split inside a block is refused
  with a ConfigError naming the tensor, its type and the sizes that work;
- the token embedding (and a tied LM head) / ``output.weight`` by vocabulary rows;
- an MoE layer's experts in blocks stay in blocks: per expert, gate/up rows and down
  columns of this rank's intermediate range (:class:`QuantizedExperts` of the shards);
  where that range cuts through the down projection's blocks, each expert's down shard
  is dequantized at load instead (logged), the rest stays in blocks.

Float tensors (norms, conv, gates, float projections) are read, their converter
transforms undone, and cut like a safetensors checkpoint's.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model.cache import resolve_dtype
from hybridserve.model.layers import Projection, _Fused
from hybridserve.model.moe import SparseMoeBlock
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.parallel.group import TPGroup
from hybridserve.parallel.layers import (VocabParallelQuantizedEmbedding, install_all_reduces, make_mtp_parallel,
                                         make_vocab_parallel)
from hybridserve.parallel.loader import full_shapes, shard_or_refuse
from hybridserve.parallel.shard import ShardPlan
from hybridserve.quant.ggml import GGML_BY_ID, GGMLWeight
from hybridserve.quant.gguf import names
from hybridserve.quant.gguf.load import _is_mtp, _Loader
from hybridserve.quant.gguf.reader import GGUFFile, Tensor
from hybridserve.quant.gguf.weights import ColumnPermutedWeight, QuantizedExperts
from hybridserve.quant.weight import ConcatWeight, FloatWeight, SliceError

logger = logging.getLogger("hybridserve.parallel")


def _blocks_view(t: Tensor) -> torch.Tensor:
    """A block tensor's bytes ``uint8 [*shape[:-1], row_bytes]`` as a view of the file's
    memory map (nothing read until sliced)."""
    bt = GGML_BY_ID[t.type_id]
    row_bytes = t.shape[-1] // bt.block_size * bt.block_bytes
    arr = t.raw.reshape(*t.shape[:-1], row_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only map: only ever read, and copied when sliced
        return torch.from_numpy(arr)


def _own(w, mapped: torch.Tensor):
    """``w`` with any block data still viewing the memory map ``mapped`` copied out (a
    rank holds its shard in its own memory, as the single-process loader holds its copy)."""
    if isinstance(w, ConcatWeight):
        return ConcatWeight([_own(p, mapped) for p in w.parts])
    if isinstance(w, ColumnPermutedWeight):
        return ColumnPermutedWeight(_own(w.inner, mapped), w.perm)
    if isinstance(w, GGMLWeight) and w.data.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr():
        return GGMLWeight(w.qtype, w.data.clone(), w.shape)
    return w


def _cut_tensor(t: torch.Tensor, cut) -> torch.Tensor:
    if cut is None:
        return t
    dim, ranges = cut
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _row_col_ranges(cut, rows: int, cols: int):
    """(row ranges, column range or None) of a 2-D cut."""
    if cut is None:
        return [(0, rows)], None
    dim, ranges = cut
    if dim == 0:
        return ranges, None
    (a, b), = ranges
    return [(0, rows)], (a, b)


class _ShardLoader:
    def __init__(self, f: GGUFFile, shard: ShardPlan, dtype: torch.dtype, load_mtp: bool):
        self.f, self.shard, self.dtype = f, shard, dtype
        self.config = shard.config
        self.ld = _Loader(f, self.config, dtype)
        self.expected = full_shapes(self.config, mtp=load_mtp)
        self.warned_experts = False

    def _check_shape(self, t: Tensor, local: str, full: tuple[int, ...]) -> None:
        if t.quantized and tuple(t.shape) != tuple(full):
            raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata implies "
                                  f"{list(full)} for {local!r}")

    def part(self, local: str) -> object:
        """This rank's shard of projection weight ``local`` (quantized-contract weight)."""
        t, _ = self.ld.tensor(local)
        full = self.expected[local]
        self._check_shape(t, local, full)
        if not t.quantized:
            vals = names.plain_to_hf(local, t.plain(), self.config, full)
            return FloatWeight(_cut_tensor(vals, self.shard.cut(local, full)).to(self.dtype), t.type_name.lower())
        mapped = _blocks_view(t)
        whole = GGMLWeight(t.type_name.lower(), mapped, t.shape)
        inv = names.row_perm(local, self.config)
        perm = names.column_perm(local, self.config)
        if perm is not None:
            whole = ColumnPermutedWeight(whole, perm)

        def build(plan: ShardPlan, probe: bool):
            rows, cols = _row_col_ranges(plan.cut(local, full), *full)
            if probe:
                rows = [(0, 1)]
            pieces = []
            for a, b in rows:
                if inv is not None:  # the converter's value-head row order: pick HF rows a:b
                    idx = inv[a:b]
                    piece = GGMLWeight(whole.qtype, mapped.index_select(0, idx), (len(idx), full[1]))
                else:
                    piece = whole.rows(a, b)
                if cols is not None:
                    piece = piece.cols(*cols)
                pieces.append(piece if probe else _own(piece, mapped))
            return pieces[0] if len(pieces) == 1 else ConcatWeight(pieces)

        return shard_or_refuse(t.name, t.type_name, tuple(t.shape), self.shard, build)

    def quantize_projections(self, model: Qwen3_5ForServing) -> None:
        tied = self.config.tie_word_embeddings
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, Projection) or (tied and name == "lm_head"):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            pre = f"{parent_name}." if parent_name else ""
            if isinstance(parent, _Fused) and parent._fused_name == leaf:
                parts = [f"{pre}{hf}.weight" for hf, _ in parent._parts]
            else:
                parts = [f"{name}.weight"]
            if not any(self.ld.tensor(local)[0].quantized for local in parts):
                continue
            ws = [self.part(local) for local in parts]
            mod.quantize_(ws[0] if len(ws) == 1 else ConcatWeight(ws))

    def quantize_experts(self, model: Qwen3_5ForServing) -> None:
        c = self.config
        a, b = self.shard._range(c.moe_intermediate_size)
        for name, block in list(model.named_modules()):
            if not isinstance(block, SparseMoeBlock):
                continue
            kinds = {kind: self.ld.tensor(f"{name}.experts.0.{kind}_proj.weight")[0]
                     for kind in ("gate", "up", "down")}
            if not any(t.quantized for t in kinds.values()):
                continue
            full = {"gate": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
                    "up": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
                    "down": (c.num_experts, c.hidden_size, c.moe_intermediate_size)}
            per: dict[str, list] = {}
            for kind, t in kinds.items():
                if tuple(t.shape) != full[kind]:
                    raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata "
                                          f"implies {list(full[kind])}")
                if not t.quantized:
                    vals = t.plain().to(self.dtype)
                    vals = vals[:, a:b] if kind != "down" else vals[:, :, a:b]
                    per[kind] = [FloatWeight(vals[e].contiguous(), t.type_name.lower()) for e in range(c.num_experts)]
                    continue
                mapped = _blocks_view(t)
                qtype = t.type_name.lower()

                def build(plan: ShardPlan, probe: bool, kind=kind, mapped=mapped, qtype=qtype):
                    lo, hi = plan._range(c.moe_intermediate_size)
                    out = []
                    for e in range(1 if probe else c.num_experts):
                        w = GGMLWeight(qtype, mapped[e], full[kind][1:])
                        w = w.cols(lo, hi) if kind == "down" else w.rows(lo, hi)
                        out.append(w if probe else _own(w, mapped))
                    return out

                try:
                    per[kind] = build(self.shard, False)
                except SliceError as e:
                    # The experts' intermediate range cuts through blocks (e.g. a k-quant
                    # down at 4 ranks of a 512-wide expert): each expert's shard is
                    # dequantized at load instead of refusing the size (the MoE layer's
                    # other kinds stay in blocks).
                    if not self.warned_experts:  # once a load: every layer's would say the same
                        self.warned_experts = True
                        logger.warning("%s (%s): %s; tensor_parallel_size=%d holds the experts' shards of "
                                       "such tensors dequantized (%s)", t.name, t.type_name, e,
                                       self.shard.world_size, self.dtype)
                    per[kind] = [self._dequantized_expert(qtype, mapped[e], full[kind][1:], kind, a, b)
                                 for e in range(c.num_experts)]
            block.experts = QuantizedExperts(per["gate"], per["up"], per["down"])

    def _dequantized_expert(self, qtype: str, data: torch.Tensor, shape, kind: str, a: int, b: int) -> FloatWeight:
        w = GGMLWeight(qtype, data, shape)
        if kind == "down":
            vals = w.dequantize(torch.float32)[:, a:b]  # one expert's [H, I] at a time
        else:
            vals = w.rows(a, b).dequantize(torch.float32)
        return FloatWeight(vals.to(self.dtype).contiguous(), qtype)

    def load_floats(self, model: Qwen3_5ForServing) -> None:
        """Fill every float parameter the shard still has with its cut."""
        cache: dict[str, torch.Tensor] = {}  # one 3-D expert tensor read once per layer
        for local, target in model.checkpoint_tensors().items():
            t, expert = self.ld.tensor(local)
            if t.name not in cache:
                cache.clear()
                cache[t.name] = t.dequantize() if t.quantized else t.plain()
            vals = cache[t.name]
            if expert is not None:
                vals = vals[expert]
            full = self.expected[local]
            hf = names.plain_to_hf(local, vals, self.config, full)
            if tuple(hf.shape) != tuple(full):
                raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}; the metadata implies "
                                      f"{list(full)} for {local!r}")
            part = _cut_tensor(hf, self.shard.cut(local, full))
            if tuple(part.shape) != tuple(target.shape):  # a bug in ShardPlan.cut
                raise AssertionError(f"{local}: shard {tuple(part.shape)} != local {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(part.to(self.dtype))


def load_sharded_gguf(path: str | os.PathLike[str], shard: ShardPlan, group: TPGroup,
                      dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                      load_mtp: bool = False) -> Qwen3_5ForServing:
    """This rank's model from a GGUF file: its shard of every tensor (block tensors kept
    in blocks), the vocabulary-parallel embedding / LM head and the all-reduces installed.
    CPU only, as the single-process GGUF path."""
    path = os.fspath(path)
    device = torch.device(device)
    if device.type != "cpu":
        raise ConfigError(f"GGUF checkpoints are served on the CPU (device {device} asked): their block "
                          "kernels are CPU kernels; use device 'cpu' or a safetensors checkpoint")
    dtype = resolve_dtype(dtype)
    f = GGUFFile(path)
    config = shard.config
    if load_mtp and int(config.raw.get("mtp_num_hidden_layers", 0) or 0) < 1:
        raise ConfigError(f"GGUF {path!r} has no MTP (nextn) layer, so speculative decoding with method 'mtp' "
                          "cannot be used: turn speculative decoding off or convert the checkpoint with its MTP layer")
    sl = _ShardLoader(f, shard, dtype, load_mtp)
    model = Qwen3_5ForServing(shard.local_config(), dtype=dtype, device="meta", mtp=load_mtp)
    if load_mtp:
        make_mtp_parallel(model, shard.mtp_fc_columns)
    v0, v1 = shard.vocab_range
    make_vocab_parallel(model, group, v0)
    model.tp_vocab_size = config.vocab_size
    sl.quantize_projections(model)
    sl.quantize_experts(model)
    emb, _ = sl.ld.tensor("embed_tokens.weight")
    qemb = None
    if emb.quantized:
        sl._check_shape(emb, "embed_tokens.weight", sl.expected["embed_tokens.weight"])
        mapped = _blocks_view(emb)
        qemb = _own(GGMLWeight(emb.type_name.lower(), mapped, emb.shape).rows(v0, v1), mapped)
        model.embed_tokens = VocabParallelQuantizedEmbedding(qemb, dtype, v0, group)
    model.to_empty(device=device)
    if config.tie_word_embeddings and qemb is not None:
        model.lm_head.quantize_(qemb)
    model.tie_weights()
    sl.load_floats(model)
    skipped = [n for n in f.tensors if n not in sl.ld.used and not (not load_mtp and _is_mtp(n, config))]
    if skipped:
        warnings.warn(f"ignored {len(skipped)} unexpected tensor(s) in {path}: {skipped[:5]}", stacklevel=2)
    model.store_cpu_layout()
    install_all_reduces(model, group)
    model.eval()
    model.gguf_path = path
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(m.qweight.nbytes for m in model.modules() if getattr(m, "qweight", None) is not None
                and isinstance(m, Projection))
    logger.info("rank %d of %d holds %.1f MiB of GGUF weights", shard.rank, shard.world_size, held / 2**20)
    return model
