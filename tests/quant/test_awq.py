"""AWQ int4 checkpoints (GEMM layout, group size 128, zero points): the unpacking
against AutoAWQ's nibble order, the weight class and its native kernel against the
format's definition, a tiny AWQ checkpoint served against HF on its dequantized
weights (dense and MoE, both CPU forms), and the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model import load_model
from hybridserve.quant import ConcatWeight
from hybridserve.quant.awq import AWQWeight, awq_dequantize, awq_unpack
from hybridserve.quant.tiny import awq_quantize


def _weight(out, inp, seed=0, group=128):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    qw, qz, sc, d = awq_quantize(w, group)
    return AWQWeight.from_awq(qw, qz, sc, group), d, (qw, qz, sc)


def test_unpack_follows_autoawq_nibble_order():
    # AutoAWQ packs column AWQ_ORDER[i] = [0, 2, 4, 6, 1, 3, 5, 7][i] into nibble i:
    # nibbles 0..7 holding 0..7 are columns 0, 4, 1, 5, 2, 6, 3, 7.
    packed = torch.tensor([[0x76543210, 0x87654320 - 2 ** 32]], dtype=torch.int32)  # 2nd: bit 31 set
    got = awq_unpack(packed)
    assert got[0, :8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    nibbles = [(0x87654320 >> (4 * i)) & 0xF for i in range(8)]
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    want = [0] * 8
    for i, col in enumerate(order):
        want[col] = nibbles[i]
    assert got[0, 8:].tolist() == want


def test_dequantize_is_the_definition():
    w, d, (qw, qz, sc) = _weight(64, 256, seed=2)
    q = awq_unpack(qw).float()                                    # [in, out]
    z = awq_unpack(qz).float()                                    # [in/128, out]
    ref = torch.empty(256, 64)
    for k in range(256):
        ref[k] = (q[k] - z[k // 128]) * sc[k // 128].float()
    assert torch.equal(awq_dequantize(qw, qz, sc, 128), ref.t())
    assert torch.equal(w.dequantize(), ref.t())
    # The quantizer's own dequantization (what the HF oracle loads) is the same.
    assert torch.equal(d, ref.t())


@pytest.mark.parametrize("shape", [(296, 384), (64, 128), (8, 1024)])
def test_kernel_rows_1_to_17_against_the_definition(shape, fid):
    w, d, _ = _weight(*shape)
    assert fid.kernel_cases(w, d) == 32  # the native kernel served rows 1..16 in both dtypes


def test_group_64_kernel(fid):
    w, d, _ = _weight(40, 192, seed=3, group=64)
    assert fid.kernel_cases(w, d, rows=[1, 2, 16]) == 6


def test_rows_and_concat():
    w, d, _ = _weight(96, 256, seed=4)
    for a, b in [(0, 8), (3, 77), (90, 96)]:
        assert torch.equal(w.rows(a, b).dequantize(), d[a:b])
    c = ConcatWeight([w.rows(0, 40), w.rows(40, 96)])
    x = torch.randn(2, 256)
    torch.testing.assert_close(c.linear(x), x @ d.T, rtol=1e-5, atol=1e-4)


def test_malformed_tensors_are_refused():
    _, _, (qw, qz, sc) = _weight(64, 256)
    with pytest.raises(ValueError, match=r"layer\.x: AWQ tensors do not fit together.*scales \[2, 64\]"):
        AWQWeight.from_awq(qw, qz, sc[:1], 128, name="layer.x")
    with pytest.raises(ValueError, match=r"not a multiple of group_size 96"):
        AWQWeight.from_awq(qw, qz, sc, 96)


def test_kept_model_holds_int4_bytes(quant_dirs):
    model, _ = load_model(quant_dirs("awq", "dense")[0], progress=False, quant_cpu="keep")
    proj = model.layers[3].self_attn.qkv_proj
    assert proj.weight is None and all(isinstance(p, AWQWeight) for p in proj.qweight.parts)
    # Half a byte per weight plus a float32 scale and zero per 128.
    assert proj.qweight.nbytes == proj.out_features * proj.in_features * (0.5 + 8 / 128)


def test_awq_with_other_bits_is_refused(quant_dirs, tmp_path):
    d = shutil.copytree(quant_dirs("awq", "dense")[0], tmp_path / "b8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"bits 4, version 'gemm'.*this one has bits 8"):
        load_model(d, progress=False)


def test_malformed_scales_in_a_checkpoint_name_the_tensor(quant_dirs, tmp_path):
    d = shutil.copytree(quant_dirs("awq", "dense")[0], tmp_path / "bad")
    t = load_file(os.fspath(d / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.scales"
    t[name] = t[name][:, :8].contiguous()
    save_file(t, os.fspath(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj.*scales \[1, 256\]"):
        load_model(d, progress=False)


def test_missing_qzeros_is_refused(quant_dirs, tmp_path):
    d = shutil.copytree(quant_dirs("awq", "dense")[0], tmp_path / "noz")
    t = load_file(os.fspath(d / "model.safetensors"))
    del t["model.layers.0.mlp.up_proj.qzeros"]
    save_file(t, os.fspath(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj' lacks its qzeros"):
        load_model(d, progress=False)
