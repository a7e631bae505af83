"""Fixtures of the quantized-checkpoint tests: GGUF files from the test-side writer
(:mod:`gguf_files`) with their HF oracle directories, and one-prompt logits."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from gguf_files import write_gguf, write_oracle_dir  # noqa: E402

# Shapes whose every projection input holds whole 256-wide k-quant blocks (hidden,
# attention heads x head dim, DeltaNet value dim, the MLPs' intermediates), so a Q4_K /
# Q5_K / Q6_K file really has those types (else the writer falls back to Q8_0, as
# llama-quantize does).
KQUANT_DENSE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64,
                    linear_value_head_dim=64)
KQUANT_MOE = dict(hidden_size=256, num_attention_heads=4, head_dim=64, linear_value_head_dim=64,
                  moe_intermediate_size=256, shared_expert_intermediate_size=256)


@pytest.fixture(scope="session")
def gguf_case(tmp_path_factory):
    """``gguf_case(name, **write_gguf kwargs)`` -> (gguf path, HF text config, oracle dir),
    written once per name."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, tuple[str, dict, str]] = {}

    def make(name: str, **kw):
        if name not in made:
            os.makedirs(root / name, exist_ok=True)
            path, text, oracle = write_gguf(root / name / "model.gguf", **kw)
            made[name] = (path, text, write_oracle_dir(root / name / "hf", text, oracle))
        return made[name]

    return make


def hf_oracle(oracle_dir: str):
    import transformers

    from hybridserve.config import ModelConfig

    cls = (transformers.Qwen3_5MoeForCausalLM if ModelConfig.from_json(oracle_dir).is_moe
           else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(oracle_dir, dtype=torch.float32).eval()


def prompt_logits(model, config, prompt, block_size=16):
    """Our logits ``[n, vocab]`` for one whole prompt in one forward."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    n = len(prompt)
    nb = -(-n // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


def greedy(model, config, prompt, steps, block_size=16, logits=None):
    """Our greedy continuation of ``prompt``: one prefill, then one decode per token
    (each step's logits row appended to ``logits`` when a list is given)."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    total = len(prompt) + steps
    nb = -(-total // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    tables, state = [list(range(nb))], [list(range(nb, nb + pages))]
    tokens = list(prompt)
    n = len(prompt)
    batch = ForwardBatch.from_lists(
        input_ids=tokens, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=tables, state_pages=state, has_initial_state=[False], logits_indices=[n - 1], device="cpu")
    out = []
    with torch.no_grad():
        for _ in range(steps):
            row = model(batch, cache)[0]
            if logits is not None:
                logits.append(row.clone())
            tok = int(row.argmax())
            out.append(tok)
            p = len(tokens)
            tokens.append(tok)
            batch = ForwardBatch.from_lists(
                input_ids=[tok], positions=[p], slot_mapping=[p], query_start_loc=[0, 1], seq_lens=[p + 1],
                block_tables=tables, state_pages=state, has_initial_state=[True], logits_indices=[0],
                device="cpu")
    return out
