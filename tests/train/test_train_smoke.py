"""A few steps of ``python -m hybridserve.train train`` on a tiny config: the held-out
loss falls, and a run stopped and resumed from its checkpoint ends bit-identical to an
uninterrupted one (same batches, same optimizer state)."""

from __future__ import annotations

import argparse
import os

import torch

from hybridserve.train import train as tr


def _args(run_dir, *extra):
    p = argparse.ArgumentParser()
    tr.add_train_args(p)
    return p.parse_args([str(run_dir), "--preset", "smoke", "--vocab-size", "400", "--max-docs", "40",
                         "--seq-len", "32", "--batch", "4", "--mtp-rows", "2", "--warmup", "2",
                         "--lr", "3e-3", "--eval-every", "0", "--eval-tokens", "2048", "--log-every", "0",
                         "--tqdm-interval", "1000", *extra])


def _ckpt(run_dir):
    return torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=False)


def test_a_few_steps_lower_the_heldout_loss(tmp_path):
    before = tr.train(_args(tmp_path, "--steps", "0", "--eval-every", "1"))
    after = tr.train(_args(tmp_path, "--steps", "30", "--eval-every", "30"))
    ck = _ckpt(tmp_path)
    assert ck["step"] == 30
    # 30 steps of a random model on real text: well below the uniform ln(400) = 5.99.
    ev = tr.evaluate  # recomputed from the saved weights, not the training loop's number
    model, mtp = tr.build_model(ck["config"], 0)
    model.load_state_dict(ck["model"]); mtp.load_state_dict(ck["mtp"])
    import numpy as np
    from hybridserve.train import tokenizer as tk
    held = torch.from_numpy(np.load(os.path.join(tmp_path, "data", "heldout.npy")).astype(np.int32))
    tbytes = tr.token_bytes(tk.load_tokenizer(os.path.join(tmp_path, "tokenizer")))
    res = ev(model, mtp, held, tbytes, 32, 2048)
    assert res["loss"] < before["heldout_loss"] - 0.5, (before, res)
    assert res["mtp_loss"] < before["heldout_mtp_loss"] - 0.3, (before, res)
    assert abs(res["loss"] - after["heldout_loss"]) < 1e-5


def test_resumed_run_equals_uninterrupted(tmp_path):
    tr.train(_args(tmp_path / "whole", "--steps", "8"))
    tr.train(_args(tmp_path / "split", "--steps", "8", "--stop-at-step", "3"))
    assert _ckpt(tmp_path / "split")["step"] == 3
    tr.train(_args(tmp_path / "split", "--steps", "8"))
    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "split")
    assert a["step"] == b["step"] == 8
    for part in ("model", "mtp"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])
    # And the seed matters: another seed gives other weights.
    tr.train(_args(tmp_path / "other", "--steps", "1", "--seed", "1"))
    c = _ckpt(tmp_path / "other")
    assert not torch.equal(c["model"]["model.embed_tokens.weight"], a["model"]["model.embed_tokens.weight"])
