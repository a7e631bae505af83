"""Loading a HF Qwen3.5 checkpoint directory into :class:`Qwen3_5ForServing`."""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
from safetensors import safe_open

from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model.cache import resolve_dtype
from hybridserve.model.layers import Projection, _Fused
from hybridserve.model.moe import SparseMoeBlock
from hybridserve.model.qwen3_5 import Qwen3_5ForServing
from hybridserve.quant import ConcatWeight
from hybridserve.quant.checkpoint import QuantizedTensors, quantization_method
from hybridserve.quant.weight import FloatWeight

# Checkpoint prefixes of the language model: causal-LM naming, then the VL wrapper's.
_LM_PREFIXES = ("model.language_model.", "model.")
# Weights of other parts of a VL / MTP checkpoint that serving text does not use.
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# The MTP layer's tensors. The released checkpoints (causal-LM and VL alike) keep them at
# the top level, ``mtp.*``, beside ``model.*`` / ``model.language_model.*``: vLLM's
# Qwen3_5MTP.load_weights (vllm/model_executor/models/qwen3_5_mtp.py) maps exactly the
# names starting with ``mtp.``. ``model.mtp.*`` is accepted too (a re-saved wrapper's).
_MTP_PREFIXES = ("mtp.", "model.mtp.")


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"shard(s) {missing} named by {index} are missing from {model_dir}")
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(
            f"no safetensors weights in {model_dir!r}: expected model.safetensors or "
            "model.safetensors.index.json with its shards"
        )
    return [os.path.join(model_dir, f) for f in found]


def local_name(name: str, mtp: bool = False) -> str | None:
    """Checkpoint tensor name -> model parameter name; None for tensors serving skips
    (the MTP layer's unless ``mtp``: then ``mtp.*`` -> the model's ``mtp.*``)."""
    if mtp:
        for prefix in _MTP_PREFIXES:
            if name.startswith(prefix):
                return "mtp." + name[len(prefix):]
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in _LM_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def checkpoint_entries(handles: dict, qt, load_mtp: bool):
    """The tensors of open safetensors files as ``(path, handle, name, local, from_quant)``:
    a quantized weight's companions (scales, zero points) skipped, its primary tensor
    named by the weight it makes (``from_quant`` True; ``qt`` a
    :class:`~hybridserve.quant.checkpoint.QuantizedTensors`, or None for a float
    checkpoint), and names this model does not load (``local_name`` None) left out."""
    for path, f in handles.items():
        for name in f.keys():
            if qt is not None and name in qt.companions:
                continue
            primary = qt.primary.get(name) if qt is not None else None
            if primary is not None:
                name = primary
            local = local_name(name, mtp=load_mtp)
            if local is not None:
                yield path, f, name, local, primary is not None


def _quantized_projections(model: Qwen3_5ForServing) -> dict[str, tuple[Projection, list[str]]]:
    """Checkpoint weight name (local) -> (the Projection it is a part of, the names of
    all that Projection's parts in row order). Projections inside a MoE block are left
    out: its fused native kernels read float weights, so a quantized checkpoint's MoE
    weights are dequantized into them at load."""
    moe = [name for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]

    def in_moe(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in moe)

    out: dict[str, tuple[Projection, list[str]]] = {}
    fused_members = set()
    for name, m in model.named_modules():
        if isinstance(m, _Fused) and isinstance(getattr(m, getattr(m, "_fused_name", ""), None), Projection) and not in_moe(name):
            proj = getattr(m, m._fused_name)
            fused_members.add(id(proj))
            names = [f"{name}.{part}.weight" for part, _ in m._parts]
            for n in names:
                out[n] = (proj, names)
    for name, m in model.named_modules():
        if isinstance(m, Projection) and id(m) not in fused_members and not in_moe(name):
            out[f"{name}.weight"] = (m, [f"{name}.weight"])
    return out


def _quantize_projections(quantized: dict, params: dict, projections: dict) -> None:
    """Hand each projection with a quantized part its weight: the parts in row order,
    float ones (left unconverted by the checkpoint) as :class:`FloatWeight`."""
    done = set()
    for name in quantized:
        proj, names = projections[name]
        if id(proj) in done:
            continue
        done.add(id(proj))
        parts = [quantized[n] if n in quantized else FloatWeight(params[n].detach().clone()) for n in names]
        proj.quantize_(parts[0] if len(parts) == 1 else ConcatWeight(parts))


def _copy_checked(f, name: str, path: str, target: torch.Tensor, dtype: torch.dtype) -> None:
    """Copy checkpoint tensor ``name`` into ``target`` (a parameter or a view of one),
    cast to ``dtype``; CheckpointError naming it if its shape differs."""
    shape = tuple(f.get_slice(name).get_shape())
    if shape != tuple(target.shape):
        raise CheckpointError(
            f"tensor {name!r} in {os.path.basename(path)} has shape {list(shape)}, "
            f"but config.json implies {list(target.shape)}; the weights do not "
            "match this config"
        )
    with torch.no_grad():
        target.copy_(f.get_tensor(name).to(dtype))


def _name_missing(expected, loaded: set[str], aliases: dict[str, tuple[torch.Tensor, list[str]]]) -> list[str]:
    """The missing tensors' names; where every tensor a fused expert tensor stands for is
    missing, that one name (with the per-expert alternative) instead of all of them."""
    missing = [n for n in expected if n not in loaded]
    gone = set(missing)
    for alias, (_, covered) in aliases.items():
        if covered and gone.issuperset(covered):
            gone.difference_update(covered)
            gone.add(f"{alias} (or its {len(covered)} per-expert tensors, e.g. {covered[0]})")
    order = {n: i for i, n in enumerate(expected)}
    return sorted(gone, key=lambda n: order.get(n, -1))


def has_mtp_layer(model_dir: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint carries an MTP layer: ``mtp_num_hidden_layers >= 1`` in its
    config and ``mtp.*`` tensors in its files."""
    model_dir = os.fspath(model_dir)
    config = ModelConfig.from_json(model_dir)
    if int(config.raw.get("mtp_num_hidden_layers", 0) or 0) < 1:
        return False
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if any(n.startswith(_MTP_PREFIXES) for n in f.keys()):
                return True
    return False


def _refuse_without_mtp(model_dir: str, config: ModelConfig, files: list[str]) -> None:
    n = int(config.raw.get("mtp_num_hidden_layers", 0) or 0)
    if n < 1:
        raise ConfigError(
            f"checkpoint {model_dir!r} has no MTP layer (its config has mtp_num_hidden_layers "
            f"{config.raw.get('mtp_num_hidden_layers', 'unset')}), so speculative decoding with "
            "method 'mtp' cannot be used: turn speculative decoding off or use a checkpoint that ships mtp.*")
    if n > 1:
        raise ConfigError(f"checkpoint {model_dir!r} has mtp_num_hidden_layers {n}; hybridserve serves "
                          "MTP with one layer (as every Qwen3.5 checkpoint ships it)")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            if any(name.startswith(_MTP_PREFIXES) for name in f.keys()):
                return
    raise ConfigError(
        f"checkpoint {model_dir!r} has no MTP layer (no mtp.* tensors in its weights), so speculative "
        "decoding with method 'mtp' cannot be used: turn speculative decoding off or use a checkpoint "
        "that ships mtp.*")


# How a quantized checkpoint (FP8, AWQ) is held on the CPU: "dequantize" (the default)
# dequantizes it at load into the model's dtype, "keep" keeps each projection in its
# quantized form (half / a quarter of bfloat16's bytes) on the native few-row kernels.
# Dequantizing is the default: the kernels on the quantized form gain at one row (FP8
# 1.1-1.7x, int4 1.45-1.85x the bfloat16 kernel) but lose at 16 (0.52x / 0.57x), and prefill
# goes through dequantized tiles (benches/quant_safetensors.py; README, "Quantized
# checkpoints"). On CUDA the quantized form is always kept (the Triton kernels).
QUANT_CPU_MODES = ("dequantize", "keep")


def _quant_cpu_mode(mode: str | None) -> str:
    mode = mode or os.environ.get("HYBRIDSERVE_QUANT_CPU", "") or "dequantize"
    if mode not in QUANT_CPU_MODES:
        raise ConfigError(f"quantized CPU form {mode!r} (HYBRIDSERVE_QUANT_CPU) is not one of {list(QUANT_CPU_MODES)}")
    return mode


def load_model(model_dir: str | os.PathLike[str], dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", progress: bool = True, load_mtp: bool = False,
               quant_cpu: str | None = None,
               ) -> tuple[Qwen3_5ForServing, ModelConfig]:
    """Load config + weights; every parameter is checked for presence and shape.

    Raises ConfigError (from :class:`ModelConfig`) for an unsupported ``model_type``,
    CheckpointError naming the tensor for a missing or mis-shaped one. Tensors of the
    vision tower and MTP head are skipped; unknown tensors are ignored with a warning.
    ``load_mtp``: also load the MTP layer (``mtp.*``) into ``model.mtp`` (speculative
    decoding's drafter); ConfigError when the checkpoint has none.
    A path ending in ``.gguf`` is a GGUF file (or the first part of a split one):
    :func:`hybridserve.quant.gguf.load.load_gguf_model`.
    Quantized checkpoints (``quantization_config.quant_method`` ``fp8`` or ``awq``): each
    quantized projection is served from a :class:`hybridserve.quant.QuantizedWeight`
    (:meth:`Projection.quantize_`) on CUDA, and on the CPU with ``quant_cpu="keep"``;
    on the CPU by default (``"dequantize"``, or ``HYBRIDSERVE_QUANT_CPU``) its
    dequantization is loaded as floats. A MoE block's weights are always dequantized.
    Weights are cast to ``dtype`` on the way in; peak extra memory is one tensor. MoE
    experts come per expert (``mlp.experts.{e}.gate_proj.weight`` ...) or as HF's fused
    3-D ``mlp.experts.gate_up_proj`` / ``down_proj``; either is copied straight into the
    packed expert parameters (no second copy of the experts at any time).
    """
    model_dir = os.fspath(model_dir)
    if model_dir.endswith(".gguf"):
        # A GGUF file (llama.cpp's), served from its quantized blocks.
        from hybridserve.quant.gguf.load import load_gguf_model

        return load_gguf_model(model_dir, dtype=dtype, device=device, progress=progress, load_mtp=load_mtp)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir!r} does not exist")
    config = ModelConfig.from_json(model_dir)
    quant = quantization_method(model_dir)
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    files = checkpoint_files(model_dir)
    if load_mtp:
        _refuse_without_mtp(model_dir, config, files)

    model = Qwen3_5ForServing(config, dtype=dtype, device="meta", mtp=load_mtp)
    model.to_empty(device=device)
    model.tie_weights()
    # HF name -> the parameter (or rows of a fused one) it fills.
    params = model.checkpoint_tensors()
    expected = {name: tuple(t.shape) for name, t in params.items()}
    # HF's fused 3-D expert tensors, accepted in place of the per-expert ones.
    aliases = model.checkpoint_aliases()
    loaded: set[str] = set()
    unknown: list[str] = []

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    bar = tqdm(total=len(expected), desc=f"Loading {os.path.basename(model_dir.rstrip('/'))}",
               unit="tensor", disable=not progress or tqdm is None) if tqdm else None
    qt = projections = None
    quantized: dict[str, object] = {}
    try:
        with contextlib.ExitStack() as stack:
            handles = {p: stack.enter_context(safe_open(p, framework="pt", device="cpu")) for p in files}
            if quant is not None:
                qt = QuantizedTensors(quant, {p: list(f.keys()) for p, f in handles.items()})
                keep = device.type != "cpu" or _quant_cpu_mode(quant_cpu) == "keep"
                projections = _quantized_projections(model) if keep else {}
            for path, f, name, local, from_quant in checkpoint_entries(handles, qt, load_mtp):
                if local in aliases:
                    target, covered = aliases[local]
                    _copy_checked(f, name, path, target, dtype)
                    loaded.update(covered)
                    if bar is not None:
                        bar.update(len(covered))
                    continue
                if local not in expected:
                    if not (local == "lm_head.weight" and config.tie_word_embeddings):
                        unknown.append(name)
                    continue
                if from_quant:
                    q = qt.build(name, handles, expected[local])
                    if local in projections:
                        quantized[local] = q
                    else:
                        # A MoE block's weight (see _quantized_projections), or
                        # any on the CPU by default: the format's dequantization,
                        # into the float parameter.
                        with torch.no_grad():
                            params[local].copy_(q.dequantize(torch.float32).to(dtype))
                else:
                    _copy_checked(f, name, path, params[local], dtype)
                loaded.add(local)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    missing = _name_missing(expected, loaded, aliases)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint {model_dir!r} is missing {len(missing)} tensor(s): {shown}{more} "
            "(names relative to 'model.' / 'model.language_model.'; the MTP layer's to the top level)"
        )
    if unknown:
        warnings.warn(f"ignored {len(unknown)} unexpected tensor(s) in {model_dir}: {unknown[:5]}",
                      stacklevel=2)
    if quantized:
        _quantize_projections(quantized, params, projections)
        if device.type != "cpu":
            for m in model.modules():
                if isinstance(m, Projection) and m.qweight is not None:
                    m.qweight = _to_device(m.qweight, device)
    if device.type == "cpu":
        model.store_cpu_layout()
    model.eval()
    return model, config


def _to_device(q, device):
    if isinstance(q, ConcatWeight):
        return ConcatWeight([_to_device(p, device) for p in q.parts])
    return q.to(device)
