"""Loading one rank's shard of a checkpoint: only its slices are ever read.

Each checkpoint tensor is opened with safetensors' ``get_slice`` and only this rank's
ranges along the cut dimension are read (``ShardPlan.cut``), so a rank never holds a
full projection, expert stack or embedding table, not even transiently: peak extra
memory is one shard of one tensor. Names, presence and shape checks are the
single-process loader's (:mod:`hybridserve.model.loader`), against the full shapes.
A quantized checkpoint's tensors (FP8, AWQ) are read the same way, widened only to the
format's unit (a 128-row/column scale block, an AWQ group or int32 pack) and cut to the
exact range with ``rows`` / ``cols``; a GGUF file has its own loader
(:mod:`hybridserve.parallel.gguf`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from safetensors import safe_open

from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model.cache import resolve_dtype
from hybridserve.model.layers import Projection
from hybridserve.model.loader import (_name_missing, _quant_cpu_mode, _quantize_projections, _quantized_projections,
                                      _refuse_without_mtp, _to_device, checkpoint_entries, checkpoint_files,
                                      local_name)
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.parallel.group import TPGroup
from hybridserve.parallel.layers import install_all_reduces, make_mtp_parallel, make_vocab_parallel
from hybridserve.parallel.shard import ShardPlan
from hybridserve.quant.awq import AWQWeight
from hybridserve.quant.checkpoint import QuantizedTensors, quantization_method
from hybridserve.quant.fp8 import BLOCK, FP8, FP8BlockWeight
from hybridserve.quant.weight import ConcatWeight, SliceError

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


def shard_or_refuse(name: str, qtype: str, full_shape: tuple[int, ...], shard: ShardPlan, build):
    """``build(shard, False)``: this rank's quantized shard of tensor ``name``; a split the
    format cannot make (:class:`SliceError`) becomes a ConfigError that names the tensor,
    its type and the tensor-parallel sizes whose splits it can make (found by
    ``build(plan, True)`` for every rank of each size: a probe that cuts one row only)."""
    try:
        return build(shard, False)
    except SliceError as e:
        n = shard.world_size
        works = []
        for m in range(1, 9):
            try:
                plans = [ShardPlan(shard.config, r, m) for r in range(m)]
                for p in plans:
                    build(p, True)
                works.append(m)
            except (SliceError, ConfigError):
                continue
        raise ConfigError(
            f"tensor_parallel_size={n} cannot split {name!r} ({qtype}, {list(full_shape)}): {e}. "
            f"tensor_parallel_size values up to 8 whose splits fall on its block boundaries: {works} "
            "(1: one process); use one of them, or a checkpoint quantized with smaller blocks (a k-quant's "
            "256 columns -> Q8_0's 32; an AWQ group_size of 64)") from None


def _slice_quantized(qt: QuantizedTensors, handles, name: str, full_shape: tuple[int, int],
                     cut, probe: bool = False):
    """This rank's part of quantized checkpoint weight ``name`` (float name; full
    ``full_shape``, cut ``cut``), reading only the rows and columns it needs (widened to
    whole scale blocks / groups / int32 packs) through ``get_slice``, then cut to the exact
    range with ``rows`` / ``cols``. ``probe``: read one row only (the sizes-that-work probe)."""
    R, C = full_shape
    if cut is None:
        row_ranges, (c0, c1) = [(0, R)], (0, C)
    elif cut[0] == 0:
        row_ranges, (c0, c1) = cut[1], (0, C)
    else:
        (c0, c1), = cut[1]
        row_ranges = [(0, R)]
    if probe:
        row_ranges = [(0, 1)]
    parts = qt.where[name]
    base = name.rpartition(".")[0]

    def read(suffix, *index):
        return handles[parts[suffix]].get_slice(f"{base}.{suffix}")[index]

    pieces = []
    for r0, r1 in row_ranges:
        if qt.method == "fp8":
            ca = c0 // BLOCK * BLOCK
            w = read("weight", slice(r0, r1), slice(ca, c1))
            if w.dtype != FP8:
                raise CheckpointError(f"quantized weight {base!r} has weight_scale_inv but its weight is "
                                      f"{w.dtype}, not float8_e4m3fn")
            s = read("weight_scale_inv", slice(r0 // BLOCK, -(-r1 // BLOCK)), slice(ca // BLOCK, -(-c1 // BLOCK)))
            q = FP8BlockWeight(w, s, r0 % BLOCK)
            if ca != c0:
                q = q.cols(c0 - ca, c1 - ca)
        else:
            g = qt.group_size
            if c0 % g or c1 % g:
                # Refuse before reading (AWQWeight.cols would say the same).
                raise SliceError(f"AWQ int4 holds groups of {g} input columns; columns {c0}:{c1} cut through "
                                 f"one (a split must fall on a multiple of {g})")
            ra, rb = r0 // 8 * 8, min(-(-r1 // 8) * 8, R)
            q = AWQWeight.from_awq(read("qweight", slice(c0, c1), slice(ra // 8, rb // 8)),
                                   read("qzeros", slice(c0 // g, c1 // g), slice(ra // 8, rb // 8)),
                                   read("scales", slice(c0 // g, c1 // g), slice(ra, rb)), g, name=base)
            if (ra, rb) != (r0, r1):
                q = q.rows(r0 - ra, r1 - ra)
        pieces.append(q)
    return pieces[0] if len(pieces) == 1 else ConcatWeight(pieces)


def _quantized_full_shape(qt: QuantizedTensors, handles, name: str) -> tuple[int, int]:
    """The float ``[out, in]`` shape a quantized checkpoint weight stands for."""
    parts = qt.where[name]
    base = name.rpartition(".")[0]
    if qt.method == "fp8":
        return tuple(handles[parts["weight"]].get_slice(f"{base}.weight").get_shape())
    inp, packed = handles[parts["qweight"]].get_slice(f"{base}.qweight").get_shape()
    return (packed * 8, inp)


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
                       load_mtp: bool = False, quant_cpu: str | None = None) -> Qwen3_5ForServing:
    """This rank's model: the local shape, its weights read slice by slice, the
    vocabulary-parallel embedding / LM head and the all-reduce hooks installed.
    ``load_mtp``: the MTP layer too, sharded like a decoder layer (speculative
    decoding; a checkpoint without one is refused as the single-process loader does).
    Quantized checkpoints (FP8, AWQ) are read slice by slice too (:func:`_slice_quantized`)
    and held as the single-process loader holds them (``quant_cpu``); a GGUF file goes to
    :func:`hybridserve.parallel.gguf.load_sharded_gguf`."""
    if os.fspath(model_dir).endswith(".gguf"):
        from hybridserve.parallel.gguf import load_sharded_gguf

        return load_sharded_gguf(model_dir, shard, group, dtype=dtype, device=device, load_mtp=load_mtp)
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir!r} does not exist")
    quant = quantization_method(model_dir)
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
    qt = None
    projections: dict = {}
    quantized: dict[str, object] = {}
    files = checkpoint_files(model_dir)
    with contextlib.ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt", device="cpu")) for p in files}
        if quant is not None:
            qt = QuantizedTensors(quant, {p: list(f.keys()) for p, f in handles.items()})
            # As the single-process loader: the quantized form kept on CUDA and with
            # quant_cpu "keep", else each shard's dequantization loaded as floats.
            if device.type != "cpu" or _quant_cpu_mode(quant_cpu) == "keep":
                projections = _quantized_projections(model)
        for path, f, name, local, from_quant in checkpoint_entries(handles, qt, load_mtp):
            if local in aliases:
                target, covered = aliases[local]
            elif local in params:
                target, covered = params[local], [local]
            else:
                if not (local == "lm_head.weight" and config.tie_word_embeddings):
                    unknown.append(name)
                continue
            if from_quant:
                shape = _quantized_full_shape(qt, handles, name)
            else:
                shape = tuple(f.get_slice(name).get_shape())
            if shape != expected_shapes[local]:
                raise CheckpointError(
                    f"tensor {name!r} in {os.path.basename(path)} has shape {list(shape)}, "
                    f"but config.json implies {list(expected_shapes[local])}; the weights do not "
                    "match this config")
            if from_quant:
                q = shard_or_refuse(
                    name, qt.method, shape, shard,
                    lambda plan, probe: _slice_quantized(qt, handles, name, shape,
                                                         plan.cut(local, shape), probe=probe))
                if tuple(q.shape) != tuple(target.shape):  # a bug in ShardPlan.cut
                    raise AssertionError(f"{local}: shard {tuple(q.shape)} != local {tuple(target.shape)}")
                if local in projections:
                    quantized[local] = q
                else:
                    # A MoE block's weight, or any on the CPU by default: the
                    # format's dequantization of this rank's slice.
                    with torch.no_grad():
                        target.copy_(q.dequantize(torch.float32).to(dtype))
                loaded.update(covered)
                continue
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
    if quantized:
        _quantize_projections(quantized, params, projections)
        if device.type != "cpu":
            for m in model.modules():
                if isinstance(m, Projection) and m.qweight is not None:
                    m.qweight = _to_device(m.qweight, device)
    if device.type == "cpu":
        model.store_cpu_layout()
    install_all_reduces(model, group)
    model.eval()
    # parameters() counts a tied embedding / LM head once.
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(m.qweight.nbytes for m in model.modules() if isinstance(m, Projection) and m.qweight is not None)
    logger.info("rank %d of %d holds %.1f MiB of weights (its shard plus the replicated norms, "
                "router and any replicated KV heads)", shard.rank, shard.world_size, held / 2**20)
    return model
