"""Reading the quantized safetensors checkpoints hybridserve serves: Qwen's FP8
(``quant_method: fp8``, e4m3 with 128 x 128 block scales) and AWQ int4 (``awq``,
GEMM layout, group size a multiple of 64, zero points).

:func:`quantization_method` reads and checks ``quantization_config`` (ConfigError
naming what to change for any other method or setting); :class:`QuantizedTensors`
finds, per checkpoint weight name, the tensors that replace it and builds the
:class:`hybridserve.quant.QuantizedWeight` (ValueError naming the tensor for a
malformed one).
"""

from __future__ import annotations

import json
import os

import torch

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.quant.awq import AWQWeight
from hybridserve.quant.fp8 import BLOCK, FP8, FP8BlockWeight

SERVED = ("fp8", "awq")


def read_quantization_config(model_dir: str) -> dict | None:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    quant = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return quant or None


def quantization_method(model_dir: str) -> dict | None:
    """The checked ``quantization_config`` of a checkpoint hybridserve can serve, or
    None for a float checkpoint; ConfigError for anything else."""
    quant = read_quantization_config(model_dir)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"{model_dir!r}: quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method", "?")
    if method == "fp8":
        fmt = quant.get("fmt", "e4m3")
        block = list(quant.get("weight_block_size") or [])
        if fmt != "e4m3" or block != [BLOCK, BLOCK]:
            raise ConfigError(
                f"{model_dir!r}: FP8 checkpoints are served with fmt 'e4m3' and weight_block_size [128, 128] "
                f"(Qwen's official FP8 form); this one has fmt {fmt!r}, weight_block_size {block or None}")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(f"{model_dir!r}: FP8 activation_scheme {quant.get('activation_scheme')!r} is not "
                              "served; hybridserve runs FP8 weights with float activations ('dynamic' checkpoints)")
        return quant
    if method == "awq":
        bits, group = quant.get("bits", quant.get("w_bit")), quant.get("group_size", quant.get("q_group_size"))
        version = str(quant.get("version", "gemm")).lower()
        zero = quant.get("zero_point", True)
        if bits != 4 or version != "gemm" or not zero or not isinstance(group, int) or group <= 0 or group % 64:
            raise ConfigError(
                f"{model_dir!r}: AWQ checkpoints are served with bits 4, version 'gemm', zero_point true and a "
                f"group_size that is a multiple of 64 (128 is the usual); this one has bits {bits}, version "
                f"{version!r}, zero_point {zero}, group_size {group}")
        return quant
    raise ConfigError(
        f"{model_dir!r} is quantized with quant_method {method!r}, which hybridserve does not load; served: "
        "'fp8' (e4m3, 128x128 block scales), 'awq' (int4, GEMM layout) and GGUF files; otherwise use the "
        "unquantized checkpoint")


class QuantizedTensors:
    """The quantized weights of one checkpoint, by the float weight name they replace
    (``...q_proj.weight``): FP8 keeps ``weight`` (float8) and adds ``weight_scale_inv``;
    AWQ replaces ``weight`` by ``qweight``, ``qzeros`` and ``scales``."""

    def __init__(self, quant: dict, names_by_file: dict[str, list[str]]):
        self.method = quant["quant_method"]
        self.group_size = int(quant.get("group_size", quant.get("q_group_size", 0)) or 0)
        # float weight name -> {suffix: file}
        self.where: dict[str, dict[str, str]] = {}
        keys = {n: p for p, names in names_by_file.items() for n in names}
        suffixes = ("weight_scale_inv",) if self.method == "fp8" else ("qweight", "qzeros", "scales")
        for name, path in keys.items():
            base, _, leaf = name.rpartition(".")
            if leaf == suffixes[0]:
                parts = {"weight": keys.get(f"{base}.weight")} if self.method == "fp8" else {}
                parts.update({s: keys.get(f"{base}.{s}") for s in suffixes})
                missing = [s for s, p in parts.items() if p is None]
                if missing:
                    raise CheckpointError(f"quantized weight {base!r} lacks its {', '.join(missing)} tensor(s); "
                                          "the checkpoint is incomplete")
                self.where[f"{base}.weight"] = parts
        # The tensor that stands for each quantized weight (its ``weight`` for FP8, its
        # ``qweight`` for AWQ) -> the float weight name; the others are companions, read
        # with it and never loaded on their own.
        lead = "weight" if self.method == "fp8" else "qweight"
        self.primary = {f"{n.rpartition('.')[0]}.{lead}": n for n in self.where}
        self.companions = {f"{n.rpartition('.')[0]}.{s}" for n in self.where for s in suffixes} - set(self.primary)

    def build(self, name: str, handles, shape: tuple[int, int]):
        """The weight that replaces float ``name`` (expected ``shape``); ``handles``:
        path -> open safetensors file. ValueError naming the tensor when malformed."""
        parts = self.where[name]
        base = name.rpartition(".")[0]

        def get(s):
            return handles[parts[s]].get_tensor(f"{base}.{s}")

        try:
            if self.method == "fp8":
                w = get("weight")
                if w.dtype != FP8:
                    raise ValueError(f"has weight_scale_inv but its weight is {w.dtype}, not float8_e4m3fn")
                q = FP8BlockWeight(w, get("weight_scale_inv"))
            else:
                q = AWQWeight.from_awq(get("qweight"), get("qzeros"), get("scales"), self.group_size, name=base)
        except ValueError as e:
            raise CheckpointError(f"quantized weight {base!r}: {e}") from None
        if tuple(q.shape) != tuple(shape):
            raise CheckpointError(f"quantized weight {base!r} has shape {list(q.shape)}, but config.json implies "
                                  f"{list(shape)}; the weights do not match this config")
        return q
