"""llama.cpp's greedy tokens against HF transformers' on the same checkpoint.

llama-server's native ``/completion`` with a token-id prompt, ``n_predict`` tokens,
temperature 0 and top-k 1, EOS ignored, ``return_tokens``; HF: ``Qwen3_5ForCausalLM``
arg-max over the full forward at each step (no cache, EOS ignored: the oracle at its
plainest). At bf16 the oracle is HF in float32 over the bf16-rounded weights (llama.cpp
keeps activations in float32 around its bf16 weight GEMMs), and the result is
reported as the matching prefix length rather than required to be whole.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np


def check_prompts(n: int, seed: int = 1234, lo: int = 16, hi: int = 96) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Printable-ASCII byte tokens of the Qwen vocabulary (ids 0-93 are '!'..'~').
    return [rng.integers(0, 94, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def llama_greedy(url: str, prompt: list[int], n_predict: int) -> list[int]:
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                       "ignore_eos": True, "return_tokens": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"{url}/completion", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
    return [int(t) for t in out["tokens"]]


def hf_greedy(hf_dir: Path, prompts: list[list[int]], n_predict: int, round_to_bf16: bool) -> list[list[int]]:
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    if round_to_bf16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(n_predict):
                nxt = model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


def compare(url: str, hf_dir: Path, *, bf16: bool, num_prompts: int = 3, n_predict: int = 16) -> dict[str, Any]:
    prompts = check_prompts(num_prompts)
    ours = [llama_greedy(url, p, n_predict) for p in prompts]
    ref = hf_greedy(hf_dir, prompts, n_predict, round_to_bf16=bf16)
    prefix = []
    for a, b in zip(ours, ref):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    return {"prompts": len(prompts), "n_predict": n_predict, "matching_prefix": prefix,
            "identical": all(k == n_predict for k in prefix),
            "oracle": "HF float32 over bf16-rounded weights" if bf16 else "HF float32",
            "llama_tokens": ours, "hf_tokens": ref}
