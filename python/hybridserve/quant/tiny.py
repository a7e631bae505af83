"""Tiny FP8 and AWQ checkpoints for tests, the device check and benches.

A float tiny checkpoint (:func:`hybridserve.model.tiny.write_tiny_checkpoint`) is
quantized here by a plain quantizer written from the formats' definitions, in the
official tensor names and ``quantization_config``; beside it goes the same checkpoint
with every quantized weight replaced by its dequantization (the formats' definitions
applied to the quantizer's own integers, not to the serving code's), which HF
transformers loads as the oracle.

- FP8: per 128 x 128 block ``scale = amax / 448``, ``fp8 = (w / scale)`` rounded to
  e4m3 (torch's cast, nearest even), stored ``weight`` float8_e4m3fn +
  ``weight_scale_inv`` (the scale: it multiplies).
- AWQ: per group of ``group_size`` inputs and output, asymmetric 4-bit:
  ``scale = (max - min) / 15`` (float16), ``zero = round(-min / scale)`` clamped to
  0..15, ``q = clamp(round(w / scale) + zero, 0, 15)``; packed in AutoAWQ's GEMM order.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from hybridserve.model.tiny import write_tiny_checkpoint

# Projections Qwen's quantized checkpoints leave in bfloat16 (``modules_to_not_convert``):
# the router, the shared expert's gate and the DeltaNet's per-head a / b projections.
NOT_CONVERTED = ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight", "in_proj_b.weight")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (float8_e4m3fn weight, float32 scales per block, dequantized)."""
    out, inp = w.shape
    bo, bi = -(-out // block), -(-inp // block)
    pad = torch.zeros(bo * block, bi * block)
    pad[:out, :inp] = w.float()
    blocks = pad.reshape(bo, block, bi, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(bo * block, bi * block)[:out, :inp]
    return q.reshape(bo * block, bi * block)[:out, :inp].contiguous(), scale.float(), deq.contiguous()


def _awq_pack(v: torch.Tensor) -> torch.Tensor:
    """int values 0..15 ``[R, C]`` -> int32 ``[R, C / 8]`` in AWQ's nibble order."""
    r, c = v.shape
    v = v.to(torch.int64).reshape(r, c // 8, 8)
    packed = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        packed |= v[:, :, col] << (4 * i)
    # Two's complement into int32 (bit 31 set for nibble 7 >= 8).
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)
    return packed.to(torch.int32)


def awq_quantize(w: torch.Tensor, group_size: int = 128):
    """``w [out, in]`` -> (qweight, qzeros, scales, dequantized) in AWQ's GEMM layout."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // group_size, group_size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(out, inp)
    qweight = _awq_pack(q.reshape(out, inp).t().contiguous())          # [in, out/8]
    qzeros = _awq_pack(zero.t().contiguous())                            # [in/g, out/8]
    return qweight, qzeros, scale.t().contiguous().half(), deq


def _is_projection(name: str) -> bool:
    stem, _, leaf = name.rpartition(".")
    return leaf == "weight" and "proj" in stem.rpartition(".")[2]


def _quantizable(name: str, t: torch.Tensor, method: str, group_size: int) -> bool:
    if t.dim() != 2 or not _is_projection(name) or name.endswith(NOT_CONVERTED):
        return False
    if "embed" in name or name == "lm_head.weight":
        return False
    if method == "awq":
        return t.shape[1] % group_size == 0 and t.shape[0] % 8 == 0
    return True


def write_quantized_checkpoint(out_dir: str | os.PathLike[str], method: str, *, preset: str = "test-a",
                               seed: int = 0, group_size: int = 128, **overrides) -> tuple[str, str]:
    """Write ``out_dir/quantized`` (method ``"fp8"`` or ``"awq"``) and ``out_dir/dequantized``
    (float32, the same weights as the quantized one means them) from one tiny float
    checkpoint; returns both paths. ``overrides`` go to the preset's config."""
    out_dir = os.fspath(out_dir)
    base = write_tiny_checkpoint(os.path.join(out_dir, "float"), preset=preset, seed=seed, mtp=False, **overrides)
    qdir, ddir = os.path.join(out_dir, "quantized"), os.path.join(out_dir, "dequantized")
    for d in (qdir, ddir):
        shutil.copytree(base, d, dirs_exist_ok=True)
    tensors = load_file(os.path.join(base, "model.safetensors"))
    qt, dq, skipped = {}, {}, []
    for name, t in tensors.items():
        if not _quantizable(name, t, method, group_size):
            qt[name] = dq[name] = t
            if t.dim() == 2 and _is_projection(name):
                skipped.append(name.rpartition(".")[0])
            continue
        stem = name.rpartition(".")[0]
        if method == "fp8":
            w, s, d = fp8_quantize(t)
            qt[name], qt[f"{stem}.weight_scale_inv"] = w, s
        elif method == "awq":
            qw, qz, sc, d = awq_quantize(t, group_size)
            qt[f"{stem}.qweight"], qt[f"{stem}.qzeros"], qt[f"{stem}.scales"] = qw, qz, sc
        else:
            raise ValueError(f"unknown method {method!r}")
        dq[name] = d
    save_file(qt, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    save_file(dq, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(qdir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    modules = sorted({n.split(".")[-1] for n in skipped} | {"lm_head", "embed_tokens"})
    if method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "modules_to_not_convert": modules}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm", "modules_to_not_convert": modules}
    with open(os.path.join(qdir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return qdir, ddir


# Tiny shapes where every projection the formats cover is quantized: dimensions
# multiples of 128 (AWQ's groups along the inputs) and of 8 (its packing).
DENSE = dict(preset="test-a", hidden_size=128, intermediate_size=256, head_dim=32,
             linear_key_head_dim=32, linear_value_head_dim=32)
MOE = dict(preset="moe-a", hidden_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
           moe_intermediate_size=128, shared_expert_intermediate_size=128)
