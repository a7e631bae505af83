"""Loading one rank's shard of a checkpoint: only its slices are ever read.

Each checkpoint tensor is opened with safetensors' ``get_slice`` and only this rank's
ranges along the cut dimension are read (``ShardPlan.cut``), so a rank never holds a
full projection, expert stack or embedding table, not even transiently: peak extra
memory is one shard of one tensor. Names, presence and shape checks are the
single-process loader's (:mod:`hybridserve.model.loader`), against the full shapes.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from safetensors import safe_open

from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError
from hybridserve.model.cache import resolve_dtype
from hybridserve.model.loader import (_name_missing, _refuse_quantized, _refuse_without_mtp, checkpoint_files,
                                      local_name)
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.parallel.group import TPGroup
from hybridserve.parallel.layers import install_all_reduces, make_mtp_parallel, make_vocab_parallel
from hybridserve.parallel.shard import ShardPlan

logger = logging.getLogger("hybridserve.parallel")


def _read_cut(f, name: str, full_shape: tuple[int, ...], shard: ShardPlan, mtp: bool = False) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (read through ``get_slice``)."""
    local = local_name(name, mtp=mtp)
    cut = shard.cut(local, full_shape)
    sl = f.get_slice(name)
    if cut is None:
        t = sl[:]
        if shard.row_bias(local) and shard.rank != 0:
            t = torch.zeros_like(t)  # added once, by rank 0, before the all-reduce
        return t
    dim, ranges = cut
    parts = []
    for a, b in ranges:
        index = tuple([slice(None)] * dim + [slice(a, b)])
        parts.append(sl[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def full_shapes(config: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's full shape, fused expert names included (from a
    meta-device model of the full shape: no memory); with ``mtp`` the MTP layer's too."""
    full = Qwen3_5ForServing(config, device="meta", mtp=mtp)
    shapes = full.checkpoint_shapes()
    for alias, (t, _) in full.checkpoint_aliases().items():
        shapes[alias] = tuple(t.shape)
    return shapes


def load_sharded_model(model_dir: str | os.PathLike[str], shard: ShardPlan, group: TPGroup,
                       dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                       load_mtp: bool = False) -> Qwen3_5ForServing:
    """This rank's model: the local shape, its weights read slice by slice, the
    vocabulary-parallel embedding / LM head and the all-reduce hooks installed.
    ``load_mtp``: the MTP layer too, sharded like a decoder layer (speculative
    decoding; a checkpoint without one is refused as the single-process loader does)."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir!r} does not exist")
    _refuse_quantized(model_dir)
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    config = shard.config
    if load_mtp:
        _refuse_without_mtp(model_dir, config, checkpoint_files(model_dir))
    expected_shapes = full_shapes(config, mtp=load_mtp)

    model = Qwen3_5ForServing(shard.local_config(), dtype=dtype, device="meta", mtp=load_mtp)
    if load_mtp:
        make_mtp_parallel(model, shard.mtp_fc_columns)
    make_vocab_parallel(model, group, shard.vocab_range[0])
    # The full vocabulary (the model's config has this rank's share): the drafter's
    # reduced draft vocabulary is cut from the gathered logits.
    model.tp_vocab_size = config.vocab_size
    model.to_empty(device=device)
    model.tie_weights()
    params = model.checkpoint_tensors()
    aliases = model.checkpoint_aliases()
    loaded: set[str] = set()
    unknown: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                local = local_name(name, mtp=load_mtp)
                if local is None:
                    continue
                if local in aliases:
                    target, covered = aliases[local]
                elif local in params:
                    target, covered = params[local], [local]
                else:
                    if not (local == "lm_head.weight" and config.tie_word_embeddings):
                        unknown.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected_shapes[local]:
                    raise CheckpointError(
                        f"tensor {name!r} in {os.path.basename(path)} has shape {list(shape)}, "
                        f"but config.json implies {list(expected_shapes[local])}; the weights do not "
                        "match this config")
                part = _read_cut(f, name, shape, shard, mtp=load_mtp)
                if tuple(part.shape) != tuple(target.shape):  # a bug in ShardPlan.cut
                    raise AssertionError(f"{local}: shard {tuple(part.shape)} != local {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(part.to(dtype))
                loaded.update(covered)
    missing = _name_missing(params, loaded, aliases)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {model_dir!r} is missing {len(missing)} tensor(s): {shown}{more}")
    if unknown:
        warnings.warn(f"ignored {len(unknown)} unexpected tensor(s) in {model_dir}: {unknown[:5]}", stacklevel=2)
    if device.type == "cpu":
        model.store_cpu_layout()
    install_all_reduces(model, group)
    model.eval()
    # parameters() counts a tied embedding / LM head once.
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("rank %d of %d holds %.1f MiB of weights (its shard plus the replicated norms, "
                "router and any replicated KV heads)", shard.rank, shard.world_size, held / 2**20)
    return model
