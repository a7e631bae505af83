"""Qwen's FP8 checkpoints (e4m3, 128 x 128 block scales): the weight class and its
native kernel against the format's definition, a tiny FP8 checkpoint served against
HF on its dequantized weights (dense and MoE, both CPU forms), and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model import load_model
from hybridserve.quant import ConcatWeight
from hybridserve.quant.fp8 import FP8BlockWeight
from hybridserve.quant.tiny import fp8_quantize



def _weight(out, inp, seed=0):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    q, s, d = fp8_quantize(w)
    return FP8BlockWeight(q, s), d


def test_dequantize_is_value_times_block_scale():
    # The definition on every e4m3 value but NaN: byte b of block (i, j) is
    # float8_e4m3fn(b) * scale[i, j].
    b = torch.arange(256, dtype=torch.int32)
    b = b[(b & 0x7F) != 0x7F].to(torch.uint8)
    q = b.repeat(3, 2)[:, :300].contiguous()                    # [3, 300]: 3 column blocks
    scale = torch.tensor([[0.5, 2.0, -3.0]])
    w = FP8BlockWeight(q, scale)
    vals = q.view(torch.float8_e4m3fn).float()
    want = vals * torch.tensor([0.5] * 128 + [2.0] * 128 + [-3.0] * 44)
    assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("shape", [(300, 384), (64, 200), (129, 128)])
def test_kernel_rows_1_to_17_against_the_definition(shape, fid):
    w, d = _weight(*shape)
    assert torch.equal(w.dequantize(), d)
    calls = fid.kernel_cases(w, d)
    assert calls == 32  # the native kernel served rows 1..16 in both dtypes


def test_rows_at_any_offset_keep_the_block_scales():
    w, d = _weight(300, 256, seed=1)
    for a, b in [(0, 128), (5, 140), (127, 300), (130, 131), (256, 300)]:
        part = w.rows(a, b)
        assert part.shape == (b - a, 256)
        assert torch.equal(part.dequantize(), d[a:b])
        x = torch.randn(3, 256)
        torch.testing.assert_close(part.linear(x), x @ d[a:b].T, rtol=1e-5, atol=1e-4)
    c = ConcatWeight([w.rows(0, 100), w.rows(100, 300)])
    assert torch.equal(c.rows(90, 210).dequantize(), d[90:210])


def test_malformed_scale_shape_is_refused():
    q, s, _ = fp8_quantize(torch.randn(256, 256))
    with pytest.raises(ValueError, match=r"weight_scale_inv .* must be \[2, 2\]"):
        FP8BlockWeight(q, s[:1])


def test_kept_model_holds_fp8_bytes(quant_dirs):
    model, _ = load_model(quant_dirs("fp8", "dense")[0], progress=False, quant_cpu="keep")
    proj = model.layers[0].mlp.gate_up_proj
    assert proj.weight is None and isinstance(proj.qweight, ConcatWeight)
    assert all(isinstance(p, FP8BlockWeight) for p in proj.qweight.parts)
    assert proj.qweight.nbytes < proj.in_features * proj.out_features * 2
    # The DeltaNet's a / b rows stay float (modules_to_not_convert) beside FP8 parts.
    types = [p.qtype for p in model.layers[0].linear_attn.in_proj.qweight.parts]
    assert types == ["fp8_e4m3_b128", "fp8_e4m3_b128", "f32", "f32"]


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_unknown_quant_method_is_refused(quant_dirs, tmp_path):
    d = _copy(quant_dirs("fp8", "dense")[0], tmp_path / "gptq")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"quant_method 'gptq'.*'fp8'.*'awq'"):
        load_model(d, progress=False)


def test_fp8_with_other_block_size_is_refused(quant_dirs, tmp_path):
    d = _copy(quant_dirs("fp8", "dense")[0], tmp_path / "b64")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"weight_block_size \[128, 128\]"):
        load_model(d, progress=False)


def test_malformed_scale_in_a_checkpoint_names_the_tensor(quant_dirs, tmp_path):
    d = _copy(quant_dirs("fp8", "dense")[0], tmp_path / "bad")
    t = load_file(os.fspath(d / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    t[name] = t[name][:, :1].contiguous()
    save_file(t, os.fspath(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj.*weight_scale_inv.*must be \[1, 2\]"):
        load_model(d, progress=False)


def test_scale_without_its_weight_is_refused(quant_dirs, tmp_path):
    d = _copy(quant_dirs("fp8", "dense")[0], tmp_path / "noweight")
    t = load_file(os.fspath(d / "model.safetensors"))
    del t["model.layers.0.mlp.down_proj.weight"]
    save_file(t, os.fspath(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj' lacks its weight"):
        load_model(d, progress=False)
