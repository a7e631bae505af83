"""Fine-tune only the MTP layer of an exported checkpoint, the trunk frozen.

``python -m hybridserve.train mtp MODEL_DIR OUT_DIR [--steps N] [--seed S] ...``

Why: speculative decoding accepts an MTP draft when it equals the *trunk's* token, so
what matters is the layer's agreement with the trunk, not its accuracy on the text. The
joint training (:mod:`.train`) fits the MTP layer to the text's token t+2 with a small
loss weight; here the layer alone is fitted to the trunk's own distribution at t+2
(given the true token t+1), a distillation target: soft cross-entropy against the
trunk's softmax, which is what ``train eval``'s "MTP agreement" counts at its argmax.

The trunk's tensors are written back unchanged (the same bfloat16 bits: every result of
the trunk stays valid); only ``mtp.*`` change. Batches are :func:`.train.batch_for_step`
of the seed over the stdlib training split tokenized with the checkpoint's own
tokenizer, so a run is reproducible from its arguments (``torch.use_deterministic_
algorithms``, one thread by default).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.train import corpus


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="an exported checkpoint (e.g. hybridserve/default_model)")
    p.add_argument("out_dir", help="where the checkpoint with the tuned MTP layer goes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--target", choices=("trunk", "text"), default="trunk",
                   help="trunk: the trunk's distribution at t+2 (distillation); text: the text's token")
    p.add_argument("--depth", type=int, default=1,
                   help="chain the layer this many times as the drafter does (pass d > 1 fed pass d-1's output "
                        "state), each pass fitted to its own position; 1: the layer alone at t+2")
    p.add_argument("--depth-weights", default=None,
                   help="comma-separated loss weight per pass (default: 1 each)")
    p.add_argument("--chain-token", choices=("text", "draft"), default="text",
                   help="the token fed to pass d > 1: text: the sequence's own (a draft that was accepted is "
                        "the sequence's token, the one the trunk's next state saw); draft: the previous pass's "
                        "argmax (what the drafter feeds whether or not it is accepted)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-budget-s", type=float, default=0, help="stop (and save) before this many seconds")
    p.add_argument("--stop-at-step", type=int, default=0,
                   help="save and stop at this step (the schedule is still laid out over --steps): replays a "
                        "run that a time budget stopped (its config.json records mtp_tuned_steps)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stdlib-root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)


def _train_stream(model_dir: str, root: str | None, max_docs: int | None = None) -> torch.Tensor:
    from hybridserve.train.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    docs = corpus.documents(root)
    train_docs, _ = corpus.split(docs[:max_docs] if max_docs else docs)
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in train_docs]):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.from_numpy(np.asarray(ids, dtype=np.int32))


def _lr(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * frac))


def _write(model_dir: str, out_dir: str, mtp, trained_steps: int, record: dict | None = None) -> None:
    """``model_dir`` copied to ``out_dir`` with the ``mtp.*`` tensors replaced (bfloat16),
    every other tensor the same bits."""
    from safetensors.torch import load_file, save_file
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    new = {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
    missing = set(new) - set(sd)
    if missing:
        raise ValueError(f"{model_dir} has no tensors {sorted(missing)[:3]}...; is it an exported checkpoint "
                         "with an MTP layer?")
    for k, v in new.items():
        sd[k] = v.detach().to(sd[k].dtype).contiguous()
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(tmp, "model.safetensors"), 0o644)
    import json
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "mtp_tuned_steps" in cfg:  # a tuning continued from a tuned layer: keep the earlier runs' record
        prev = {k: cfg.pop(k) for k in ("mtp_tuned_steps", "mtp_tuned_depth", "mtp_tuned_seed") if k in cfg}
        cfg["mtp_tuning_history"] = cfg.get("mtp_tuning_history", []) + [prev]
    cfg["mtp_tuned_steps"] = int(trained_steps)
    cfg.update(record or {})
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def tune(a) -> dict:
    from hybridserve.train.export import load_trained
    if a.depth < 1:
        raise ValueError(f"--depth must be at least 1, got {a.depth}")
    weights = [1.0] * a.depth
    if a.depth_weights:
        weights = [float(w) for w in a.depth_weights.split(",")]
        if len(weights) != a.depth:
            raise ValueError(f"--depth-weights has {len(weights)} weights for --depth {a.depth}; give one per pass")
    t0 = time.time()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)
    model, mtp = load_trained(a.model_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    mtp.train()
    data = _train_stream(a.model_dir, a.stdlib_root, a.max_docs)
    from hybridserve.train.train import batch_for_step
    params = list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    print(f"MTP fine-tune of {a.model_dir}: {sum(p.numel() for p in params) / 1e6:.2f}M params, trunk frozen; "
          f"{len(data):,} training tokens; {a.steps} steps of {a.batch}x{a.seq_len}, target {a.target}", flush=True)
    if a.depth > 1:
        print(f"chained: depth {a.depth}, weights {weights}, chain token {a.chain_token}", flush=True)
    step, st, agree_ema = 0, None, None
    stop_at = min(a.steps, a.stop_at_step or a.steps)
    while step < stop_at:
        if a.time_budget_s and st is not None and time.time() - t0 + 1.2 * st > a.time_budget_s:
            print(f"time budget reached at step {step}; saving", flush=True)
            break
        ts = time.time()
        for g in opt.param_groups:
            g["lr"] = _lr(step, a)
        ids = batch_for_step(data, a.seed, step, a.batch, a.seq_len)
        inp = ids[:, :-1]
        t = inp.shape[1]
        if a.depth > 1:
            loss, agree = _chain_step(model, mtp, ids, a, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            agree_ema = agree if agree_ema is None else [0.9 * e + 0.1 * g for e, g in zip(agree_ema, agree)]
            dt = time.time() - ts
            st = dt if st is None else 0.8 * st + 0.2 * dt
            if a.log_every and step % a.log_every == 0:
                print(f"step {step}: loss {loss.item():.4f} train agreement by pass "
                      f"{', '.join(f'{e:.3f}' for e in agree_ema)} lr {_lr(step - 1, a):.2e} "
                      f"{st:.2f} s/step ({time.time() - t0:.0f} s)", flush=True)
            continue
        with torch.no_grad():
            h = model.model(input_ids=inp).last_hidden_state
            # The trunk's token-t+2 distribution after the true t+1 (row j: position j+1).
            teacher = model.lm_head(h[:, 1:]).float()
            nxt = model.model.embed_tokens(inp[:, 1:])
            pos = torch.arange(t - 1).unsqueeze(0).expand(inp.shape[0], -1)
            pe = model.model.rotary_emb(h[:, :t - 1], pos)
        m = mtp(h[:, :t - 1], nxt, pe, pos)
        logits = model.lm_head(m).float()
        flat = logits.reshape(-1, logits.shape[-1])
        if a.target == "trunk":
            loss = F.cross_entropy(flat, teacher.reshape(-1, teacher.shape[-1]).softmax(-1))
        else:
            loss = F.cross_entropy(flat, ids[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
        agree_ema = agree if agree_ema is None else 0.9 * agree_ema + 0.1 * agree
        dt = time.time() - ts
        st = dt if st is None else 0.8 * st + 0.2 * dt
        if a.log_every and step % a.log_every == 0:
            print(f"step {step}: loss {loss.item():.4f} train agreement {agree_ema:.3f} lr {_lr(step - 1, a):.2e} "
                  f"{st:.2f} s/step ({time.time() - t0:.0f} s)", flush=True)
    mtp.eval()
    _write(a.model_dir, a.out_dir, mtp, step, {"mtp_tuned_depth": a.depth, "mtp_tuned_seed": a.seed})
    print(f"done: {step} steps in {time.time() - t0:.0f} s; wrote {a.out_dir}", flush=True)
    return {"steps": step}


def _chain_step(model, mtp, ids: torch.Tensor, a, weights: list[float]) -> tuple[torch.Tensor, list[float]]:
    """The loss of the layer chained ``a.depth`` times (:func:`.mtp.mtp_chain`): pass d's
    row i (the chain pass 1 started at position i) against the trunk's distribution at
    position i + d (its token i + d + 1), or the text's token there. Returns (weighted sum
    of the passes' mean losses, each pass's argmax agreement with the trunk)."""
    from hybridserve.train.mtp import mtp_chain
    inp = ids[:, :-1]
    t = inp.shape[1]
    with torch.no_grad():
        h = model.model(input_ids=inp).last_hidden_state
        emb = model.model.embed_tokens(inp)

    def drafted(d, prev):
        with torch.no_grad():
            return model.model.embed_tokens(model.lm_head(prev).argmax(-1))

    outs = mtp_chain(mtp, h, emb, model.model.rotary_emb, a.depth,
                     drafted if a.chain_token == "draft" else None)
    loss = torch.zeros(())
    agree = []
    for d, (m, w) in enumerate(zip(outs, weights), start=1):
        logits = model.lm_head(m).float()
        flat = logits.reshape(-1, logits.shape[-1])
        with torch.no_grad():
            teacher = model.lm_head(h[:, d:t]).float()
        if a.target == "trunk":
            ce = F.cross_entropy(flat, teacher.reshape(-1, teacher.shape[-1]).softmax(-1))
        else:
            ce = F.cross_entropy(flat, ids[:, d + 1:].reshape(-1))
        loss = loss + w * ce
        with torch.no_grad():
            agree.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return loss, agree


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    tune(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
