"""``train mtp --depth D`` end to end on the default model (a few tiny steps): only the
``mtp.*`` tensors change, the trunk's are the same bits, the run is reproducible from its
arguments, and config.json records the tuning (steps, depth, seed, earlier runs)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hybridserve.train import mtp_tune

MODEL = os.path.join(os.path.dirname(mtp_tune.__file__), "..", "default_model")


def _run(out, *extra):
    mtp_tune.main([MODEL, str(out), "--steps", "2", "--batch", "2", "--seq-len", "24", "--warmup", "1",
                   "--max-docs", "12", "--log-every", "0", *extra])
    return load_file(os.path.join(out, "model.safetensors"))


def test_chained_tuning_changes_only_the_mtp_layer_and_is_reproducible(tmp_path):
    base = load_file(os.path.join(MODEL, "model.safetensors"))
    a = _run(tmp_path / "a", "--depth", "3", "--seed", "4")
    b = _run(tmp_path / "b", "--depth", "3", "--seed", "4")
    assert set(a) == set(base)
    trunk = [k for k in base if not k.startswith("mtp.")]
    assert trunk and all(torch.equal(a[k], base[k]) and a[k].dtype == base[k].dtype for k in trunk)
    mtp = [k for k in base if k.startswith("mtp.")]
    assert any(not torch.equal(a[k], base[k]) for k in mtp)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(MODEL, "config.json")) as f:
        before = json.load(f)
    with open(tmp_path / "a" / "config.json") as f:
        cfg = json.load(f)
    assert (cfg["mtp_tuned_steps"], cfg["mtp_tuned_depth"], cfg["mtp_tuned_seed"]) == (2, 3, 4)
    if "mtp_tuned_steps" in before:
        assert cfg["mtp_tuning_history"][-1]["mtp_tuned_steps"] == before["mtp_tuned_steps"]
    # A different depth trains something else from the same batches.
    c = _run(tmp_path / "c", "--depth", "2", "--seed", "4")
    assert any(not torch.equal(a[k], c[k]) for k in mtp)


def test_depth_weights_must_match_the_depth(tmp_path):
    with pytest.raises(ValueError, match="one per pass"):
        _run(tmp_path / "x", "--depth", "3", "--depth-weights", "1,1")
