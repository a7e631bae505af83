"""Training loop of the default model: HF's ``Qwen3_5ForCausalLM`` trunk plus the MTP
layer of :mod:`.mtp`, trained jointly on the stdlib corpus.

Deterministic from ``--seed``: the weights are initialised from it, and the batch of
step s is drawn by a generator seeded from (seed, s), so a run resumed from a checkpoint
takes the same batches as an uninterrupted one. Checkpoints (model, MTP, optimizer,
step) are written atomically every ``--ckpt-every-s`` seconds, at each evaluation and at
the end; ``--time-budget-s`` ends the run early (with a checkpoint) when the next step
would not finish within the budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.train import corpus
from hybridserve.train import tokenizer as tk
from hybridserve.train.mtp import MTP

# The model: the Qwen3.5 layer pattern (3 Gated DeltaNet : 1 gated attention), partial
# rotary (a quarter of head_dim), dense MLP, tied embeddings. ~5.5M trunk parameters:
# one shared core gives ~15 s per step to a 9M model (hidden 256), whose ~300 steps in
# the budget are a third of an epoch; a compute-bound run favours a smaller model that
# sees more tokens.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    },
    # For the smoke tests: a few seconds a step on one core.
    "smoke": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    },
}
MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for the MTP loss early in training


def model_config_dict(preset: str, vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                            "partial_rotary_factor": 0.25},
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        "bos_token_id": None,
        "mtp_num_hidden_layers": 1,
        **MODEL_PRESETS[preset],
    }
    return cfg


def build_model(cfg: dict[str, Any], seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**cfg)
    model = Qwen3_5ForCausalLM(config).float()
    mtp = MTP(config).float()
    # Qwen3.5's RMSNorm scales by (1 + weight): zero is the identity, as HF initialises it.
    for m in mtp.modules():
        if type(m).__name__ == "Qwen3_5RMSNorm":
            torch.nn.init.zeros_(m.weight)
    for name, p in mtp.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=config.initializer_range)
    return model, mtp


# --------------------------------------------------------------------------- data

def prepare(run_dir: str, vocab_size: int, *, root: str | None = None, max_docs: int | None = None) -> None:
    """Tokenizer + token streams in ``run_dir`` (skipped when already there)."""
    data = os.path.join(run_dir, "data")
    if os.path.exists(os.path.join(data, "heldout.npy")):
        return
    os.makedirs(data, exist_ok=True)
    docs = corpus.documents(root)
    if max_docs:
        docs = docs[:max_docs]
    train_docs, held_docs = corpus.split(docs)
    tok = tk.train_tokenizer((d.text for d in train_docs), vocab_size)
    tk.save_tokenizer(tok, os.path.join(run_dir, "tokenizer"))
    eot = tok.token_to_id("<|endoftext|>")
    for name, ds in (("train", train_docs), ("heldout", held_docs)):
        ids: list[int] = []
        for enc in tok.encode_batch([d.text for d in ds]):
            ids.extend(enc.ids)
            ids.append(eot)
        np.save(os.path.join(data, f"{name}.npy.tmp.npy"), np.asarray(ids, dtype=np.uint16))
        with open(os.path.join(data, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(d.relpath for d in ds) + "\n")
    for name in ("train", "heldout"):
        os.replace(os.path.join(data, f"{name}.npy.tmp.npy"), os.path.join(data, f"{name}.npy"))


def token_bytes(tok) -> np.ndarray:
    """Bytes each token id stands for (byte-level BPE: one character per byte); the
    special tokens count as zero bytes (they are not text of the corpus)."""
    n = tok.get_vocab_size()
    out = np.zeros(n, dtype=np.int64)
    specials = set(tk.SPECIAL_TOKENS)
    for i in range(n):
        s = tok.id_to_token(i)
        out[i] = 0 if s in specials else len(s)
    return out


def batch_for_step(data: torch.Tensor, seed: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()


# --------------------------------------------------------------------------- model step

def forward_losses(model, mtp, ids: torch.Tensor, mtp_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(trunk loss on t+1, MTP loss on t+2) for ids [B, T+1], in nats per token."""
    inp, labels = ids[:, :-1], ids[:, 1:]
    h = model.model(input_ids=inp).last_hidden_state  # post final norm (see mtp.py)
    logits = model.lm_head(h)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    if mtp_rows <= 0:
        return loss, None
    r, t = min(mtp_rows, ids.shape[0]), inp.shape[1]
    # Row j: h_j and embed(token j+1) predict token j+2, for j = 0 .. T-2.
    hid = h[:r, :t - 1]
    nxt = model.model.embed_tokens(inp[:r, 1:])
    pos = torch.arange(t - 1).unsqueeze(0).expand(r, -1)
    pe = model.model.rotary_emb(hid, pos)
    m = mtp(hid, nxt, pe, pos)
    mlogits = model.lm_head(m)
    mloss = F.cross_entropy(mlogits.reshape(-1, mlogits.shape[-1]), ids[:r, 2:].reshape(-1))
    return loss, mloss


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(model, mtp, held: torch.Tensor, tbytes: np.ndarray, seq_len: int, n_tokens: int) -> dict[str, float]:
    model.eval(); mtp.eval()
    n_win = max(1, min(n_tokens, len(held) - 1) // seq_len)
    nats = mnats = 0.0
    ntok = mtok = 0
    nbytes = 0
    for w in range(n_win):
        ids = held[w * seq_len: w * seq_len + seq_len + 1].long().unsqueeze(0)
        if ids.shape[1] < 3:
            break
        loss, mloss = forward_losses(model, mtp, ids, 1)
        k = ids.shape[1] - 1
        nats += loss.item() * k; ntok += k
        mnats += mloss.item() * (k - 1); mtok += k - 1
        nbytes += int(tbytes[ids[0, 1:].numpy()].sum())
    model.train(); mtp.train()
    return {"loss": nats / ntok, "mtp_loss": mnats / max(1, mtok),
            "bits_per_byte": nats / math.log(2) / max(1, nbytes), "tokens": ntok}


# --------------------------------------------------------------------------- checkpoints

def save_checkpoint(path: str, model, mtp, opt, step: int, extra: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "mtp": mtp.state_dict(), "opt": opt.state_dict(),
                "step": step, **extra}, tmp)
    os.replace(tmp, path)


def make_optimizer(model, mtp, args):
    decay, no_decay = [], []
    seen = set()
    for mod in (model, mtp):
        for _, p in mod.named_parameters():
            if id(p) in seen:  # the tied embedding / LM head
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(args) -> dict[str, float]:
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.run_dir, exist_ok=True)
    prepare(args.run_dir, args.vocab_size, root=args.stdlib_root, max_docs=args.max_docs)
    tok = tk.load_tokenizer(os.path.join(args.run_dir, "tokenizer"))
    special = {s: tok.token_to_id(s) for s in tk.SPECIAL_TOKENS}
    cfg_path = os.path.join(args.run_dir, "model_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    else:
        cfg = model_config_dict(args.preset, tok.get_vocab_size(), special)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    data = torch.from_numpy(np.load(os.path.join(args.run_dir, "data", "train.npy")).astype(np.int32))
    held = torch.from_numpy(np.load(os.path.join(args.run_dir, "data", "heldout.npy")).astype(np.int32))
    tbytes = token_bytes(tok)

    model, mtp = build_model(cfg, args.seed)
    opt = make_optimizer(model, mtp, args)
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt_path) and not args.fresh:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"]); mtp.load_state_dict(ck["mtp"]); opt.load_state_dict(ck["opt"])
        step = ck["step"]
        print(f"resumed from {ckpt_path} at step {step}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"trunk {n_params / 1e6:.2f}M params, MTP {n_mtp / 1e6:.2f}M; train {len(data):,} tokens, "
          f"held-out {len(held):,}; {args.steps} steps of {args.batch}x{args.seq_len}", flush=True)

    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=step, mininterval=args.tqdm_interval, file=sys.stdout,
               dynamic_ncols=False, ncols=100)
    last_ckpt = time.time()
    step_time = None
    last = {}
    model.train(); mtp.train()

    evals: dict[int, dict[str, float]] = {}

    def do_eval(s):
        ev = evaluate(model, mtp, held, tbytes, args.seq_len, args.eval_tokens)
        evals[s] = ev
        bar.write(f"step {s}: held-out loss {ev['loss']:.4f} nats/token, {ev['bits_per_byte']:.4f} bits/byte, "
                  f"MTP loss {ev['mtp_loss']:.4f} ({time.time() - t0:.0f} s)")
        sys.stdout.flush()
        return ev

    stop_at = min(args.steps, args.stop_at_step or args.steps)
    while step < stop_at:
        if args.time_budget_s and step_time is not None and \
                time.time() - t0 + step_time * 1.2 > args.time_budget_s:
            bar.write(f"time budget of {args.time_budget_s:.0f} s reached at step {step}; saving")
            break
        ts = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        ids = batch_for_step(data, args.seed, step, args.batch, args.seq_len)
        loss, mloss = forward_losses(model, mtp, ids, args.mtp_rows)
        total = loss + (MTP_LOSS_WEIGHT * mloss if mloss is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        step += 1
        last = {"loss": loss.item(), "mtp_loss": mloss.item() if mloss is not None else float("nan")}
        dt = time.time() - ts
        step_time = dt if step_time is None else 0.8 * step_time + 0.2 * dt
        bar.set_postfix(loss=f"{last['loss']:.3f}", mtp=f"{last['mtp_loss']:.3f}", s_step=f"{step_time:.1f}")
        bar.update(1)
        if args.log_every and step % args.log_every == 0:
            bar.write(f"step {step}: loss {last['loss']:.4f} mtp {last['mtp_loss']:.4f} lr {lr_at(step - 1, args):.2e} "
                      f"{step_time:.2f} s/step ({time.time() - t0:.0f} s)")
            sys.stdout.flush()
        if args.eval_every and step % args.eval_every == 0:
            do_eval(step)
            save_checkpoint(ckpt_path, model, mtp, opt, step, {"config": cfg})
            last_ckpt = time.time()
        elif time.time() - last_ckpt > args.ckpt_every_s:
            save_checkpoint(ckpt_path, model, mtp, opt, step, {"config": cfg})
            last_ckpt = time.time()
    bar.close()
    save_checkpoint(ckpt_path, model, mtp, opt, step, {"config": cfg})
    if args.eval_every and step not in evals:
        do_eval(step)
    ev = evals.get(step, {})
    print(f"done at step {step} in {time.time() - t0:.0f} s", flush=True)
    return {**last, **{f"heldout_{k}": v for k, v in ev.items()}, "step": step}


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="default", choices=sorted(MODEL_PRESETS))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mtp-rows", type=int, default=4, help="batch rows that also train the MTP layer")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every-s", type=float, default=300)
    p.add_argument("--time-budget-s", type=float, default=0, help="stop (and save) before this many seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tqdm-interval", type=float, default=30)
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--stop-at-step", type=int, default=0,
                   help="save and stop at this step (the schedule still runs to --steps); resume later")
    p.add_argument("--stdlib-root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)
