"""Export a training run as a Hugging Face checkpoint directory: ``config.json``,
``model.safetensors`` in bfloat16 (the trunk under ``Qwen3_5ForCausalLM``'s names plus
the ``mtp.*`` tensors, as the released Qwen3.5 checkpoints hold them), the tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with Qwen3.5's chat template) and
``generation_config.json``. HF's loader ignores ``mtp.*`` (``_keys_to_ignore_on_load_
unexpected``); hybridserve's loader skips them; :func:`load_mtp` reads them back.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from hybridserve.train import tokenizer as tk


def export(run_dir: str, out_dir: str, *, dtype: torch.dtype = torch.bfloat16) -> str:
    ck = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    cfg = dict(ck["config"])
    tensors: dict[str, torch.Tensor] = {}
    for k, v in ck["model"].items():
        if k == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # tied to model.embed_tokens.weight
        tensors[k] = v.to(dtype).contiguous()
    for k, v in ck["mtp"].items():
        tensors[f"mtp.{k}"] = v.to(dtype).contiguous()
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg["trained_steps"] = int(ck["step"])
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tok = tk.load_tokenizer(os.path.join(run_dir, "tokenizer"))
    tk.save_tokenizer(tok, tmp, model_max_length=cfg["max_position_embeddings"])
    ids = {s: tok.token_to_id(s) for s in tk.SPECIAL_TOKENS}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                   "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, f, indent=2)
        f.write("\n")
    for f in os.listdir(tmp):  # safetensors writes 0600; package data is world-readable
        os.chmod(os.path.join(tmp, f), 0o644)
    if os.path.exists(out_dir):
        keep = os.path.join(out_dir, "__init__.py")
        if os.path.exists(keep):  # the package marker of hybridserve/default_model
            shutil.copy(keep, os.path.join(tmp, "__init__.py"))
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_trained(model_dir: str, dtype: torch.dtype = torch.float32):
    """(HF ``Qwen3_5ForCausalLM``, :class:`MTP`) of an exported checkpoint."""
    from transformers import AutoConfig, Qwen3_5ForCausalLM
    from hybridserve.train.mtp import MTP
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(model_dir)
    mtp = MTP(config).to(dtype).eval()
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    mtp.load_state_dict({k[4:]: v.to(dtype) for k, v in sd.items() if k.startswith("mtp.")})
    return model, mtp
