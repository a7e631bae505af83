"""The HF transformers baseline of ``bench throughput --compare-hf``.

The same requests, on the same weights, through ``generate`` (greedy, EOS ignored):

* **static batches**: consecutive requests in groups of ``batch_size``, left-padded
  with an attention mask; a batch runs until its longest member is done, and only
  each request's own ``output_len`` tokens count as useful;
* **one at a time**: each request alone.

Useful output tokens per second of each is what hybridserve's number is divided by.
Greedy tokens are kept so the caller can check hybridserve's are the same.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from hybridserve.bench.workload import BenchRequest


def load_hf_model(model_dir: str) -> Any:
    import json
    import os

    import transformers

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    # The mixture-of-experts models have their own classes (the dense class would load
    # a MoE checkpoint with its MLPs missing).
    moe = {"qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}
    if model_type in moe:
        return moe[model_type].from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        model = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except (ValueError, OSError, AttributeError):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _generation_config(model: Any, max_new_tokens: int, pad_id: int) -> Any:
    cfg = copy.deepcopy(model.generation_config)
    cfg.max_new_tokens = max_new_tokens
    cfg.min_new_tokens = None  # suppressing EOS would change greedy argmax; ignore it instead
    cfg.do_sample = False
    cfg.num_beams = 1
    cfg.eos_token_id = None
    cfg.pad_token_id = pad_id
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if hasattr(cfg, name):
            setattr(cfg, name, None)
    return cfg


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else None
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


@torch.inference_mode()
def hf_generate(
    model: Any, requests: list[BenchRequest], *, batch_size: int, progress: bool = False
) -> dict[str, Any]:
    """Run ``requests`` (token-id prompts) in static left-padded batches of ``batch_size``
    (1 = one at a time); returns wall time, useful tokens/s and each request's tokens."""
    pad = _pad_id(model)
    tokens: dict[str, list[int]] = {}
    useful = 0
    computed = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=f"HF batch {batch_size}", unit="req", leave=False)
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        prompts = [list(r.prompt) for r in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        new = max(r.output_len for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=_generation_config(model, new, pad)
        )
        for i, r in enumerate(batch):
            tokens[r.request_id] = out[i, width : width + r.output_len].tolist()
            useful += r.output_len
        computed += len(batch) * new
        if bar is not None:
            bar.update(len(batch))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return {
        "batch_size": batch_size,
        "wall_s": wall,
        "useful_output_tokens": useful,
        "computed_output_tokens": computed,
        "output_throughput_tok_s": useful / max(wall, 1e-9),
        "tokens": tokens,
    }


def compare_tokens(
    ours: dict[str, list[int]], theirs: dict[str, list[int]]
) -> dict[str, Any]:
    """Per request: identical, or the first index where the greedy tokens differ."""
    mismatches = []
    for rid, want in theirs.items():
        got = ours.get(rid)
        if got == want:
            continue
        if got is None:
            mismatches.append({"request_id": rid, "first_diff": 0, "ours_len": 0, "hf_len": len(want)})
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        mismatches.append({"request_id": rid, "first_diff": first, "ours_len": len(got), "hf_len": len(want),
                           "ours": got[first : first + 4], "hf": want[first : first + 4]})
    return {
        "requests": len(theirs),
        "identical": len(theirs) - len(mismatches),
        "all_identical": not mismatches,
        "mismatches": mismatches,
    }
