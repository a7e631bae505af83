"""``python -m hybridserve.train mtp``: fine-tuning only the MTP layer toward the trunk.

On a smoke-sized trained-and-exported checkpoint: the trunk's tensors come back with the
same bits (every trunk result stays valid), the MTP tensors change, the distillation loss
(KL divergence of the MTP layer's t+2 distribution from the trunk's, on held-out
text, recomputed here from the written checkpoint) falls, and two runs with the same
arguments write the same tensors."""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hybridserve.train import corpus
from hybridserve.train import mtp_tune
from hybridserve.train import train as tr
from hybridserve.train.export import export, load_trained
from hybridserve.train.tokenizer import load_tokenizer


def _exported(tmp_path):
    p = argparse.ArgumentParser()
    tr.add_train_args(p)
    run = tmp_path / "run"
    tr.train(p.parse_args([str(run), "--preset", "smoke", "--vocab-size", "400", "--max-docs", "40",
                           "--seq-len", "32", "--batch", "4", "--mtp-rows", "2", "--warmup", "2", "--lr", "3e-3",
                           "--eval-every", "0", "--log-every", "0", "--tqdm-interval", "1000", "--steps", "30"]))
    return export(str(run), str(tmp_path / "model"))


def _tune(model_dir, out, steps):
    p = argparse.ArgumentParser()
    mtp_tune.add_args(p)
    mtp_tune.tune(p.parse_args([model_dir, str(out), "--steps", str(steps), "--batch", "4", "--seq-len", "32",
                                "--lr", "3e-3", "--warmup", "2", "--max-docs", "40", "--log-every", "0"]))
    return str(out)


@torch.no_grad()
def _distill_loss(model_dir):
    model, mtp = load_trained(model_dir)
    tok = load_tokenizer(model_dir)
    _, held = corpus.split(corpus.documents()[:40])
    ids = torch.tensor([t for d in held for t in tok.encode(d.text).ids][:257])[None]
    inp = ids[:, :-1]
    t = inp.shape[1]
    h = model.model(input_ids=inp).last_hidden_state
    teacher = model.lm_head(h[:, 1:]).float().softmax(-1)
    pos = torch.arange(t - 1)[None]
    m = mtp(h[:, :t - 1], model.model.embed_tokens(inp[:, 1:]), model.model.rotary_emb(h[:, :t - 1], pos), pos)
    # KL(trunk || MTP): the soft cross-entropy less the trunk's own entropy (its floor).
    logp = model.lm_head(m).float()[0].log_softmax(-1)
    return F.kl_div(logp, teacher[0], reduction="batchmean").item()


def test_mtp_tune_changes_only_the_mtp_layer_and_lowers_its_distillation_loss(tmp_path):
    src = _exported(tmp_path)
    out = _tune(src, tmp_path / "tuned", 25)
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys()
    trunk = [k for k in a if not k.startswith("mtp.")]
    assert trunk and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in trunk)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("mtp."))
    before, after = _distill_loss(src), _distill_loss(out)
    assert after < 0.8 * before, (before, after)
    import json
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["mtp_tuned_steps"] == 25
    # Seeded and deterministic: the same arguments write the same tensors.
    again = load_file(os.path.join(_tune(src, tmp_path / "again", 25), "model.safetensors"))
    assert all(torch.equal(again[k], b[k]) for k in b)
    assert np.array_equal(np.sort(list(b)), np.sort(list(again)))
