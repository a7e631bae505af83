"""hybridserve on the GGUF files llama.cpp wrote (``tests/fixtures/gguf``) equals HF
transformers on the same files' dequantized weights (issue 35).

For each fixture: the oracle is HF's ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
(config from the generator that made the file) holding the file's tensors dequantized by
the ``gguf`` package (llama.cpp's reader) and mapped back to HF names and layouts
(``tests/fixtures/gguf/hf_to_gguf.py``: the converter's transforms undone). Ours is
``load_model(file.gguf)`` (logits of one prompt) and ``LLM(file.gguf)`` (16 greedy tokens).

Bounds: float files (F16 / BF16) to float32 rounding of the dequantized weights; block
files to the rounding of activations a block kernel may apply (int8 activations per
32-block as llama.cpp's Q8_0 / Q8_K dot products do: ~0.4 % per dot product), stated as
a fraction of the logits' spread.

This test needs ``hybridserve``'s GGUF loader (the ``gguf`` branch); before it lands the
calls below fail (a GGUF path is not a checkpoint directory) -- expected, not skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
_spec = importlib.util.spec_from_file_location("hf_to_gguf", FIXTURES / "hf_to_gguf.py")
H2G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H2G)

PROMPT = [17, 3, 250, 101, 42, 7, 300, 64, 64, 5, 12, 199, 33, 281, 90, 2, 150, 77, 8, 260, 1, 45, 301, 118]
# max |ours - HF| over the logits, as a fraction of HF's logits' standard deviation.
LOGIT_BOUND = {"F16": 1e-3, "BF16": 1e-3, "Q8_0": 0.02, "Q6_K": 0.03, "Q5_K_M": 0.04, "Q4_K_M": 0.05,
               "Q4_0": 0.05}


def _files():
    for model, spec in H2G.manifest()["models"].items():
        for fname in spec.get("files", {}):
            yield pytest.param(model, spec, fname, id=fname)


def _ftype(model: str, fname: str) -> str:
    return fname[len(model) + 1:-len(".gguf")]


def _hf_on_file(spec: dict, fname: str, tmp_path: Path):
    """HF's model with the file's dequantized weights (float32)."""
    import transformers

    from hybridserve.model.tiny import write_tiny_checkpoint

    config = H2G.model_config(spec)
    d = write_tiny_checkpoint(tmp_path / "hf", preset=spec["preset"], seed=spec["seed"], mtp=False,
                              **spec["overrides"])
    cls = transformers.Qwen3_5MoeForCausalLM if config.is_moe else transformers.Qwen3_5ForCausalLM
    hf = cls.from_pretrained(d, dtype=torch.float32).eval()
    r = gguf.GGUFReader(str(FIXTURES / fname), "r")
    tensors = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in r.tensors}
    local = H2G.from_gguf(tensors, config)
    full = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): t for n, t in local.items()}
    if config.is_moe:
        from hybridserve.model.tiny import fuse_experts

        full = fuse_experts(full, config, "model.")
    missing, unexpected = hf.load_state_dict(full, strict=False)
    assert not unexpected, unexpected
    assert all(m == "lm_head.weight" and config.tie_word_embeddings for m in missing), missing
    hf.tie_weights()
    return hf


def _our_logits(path: Path, n: int):
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch, load_model
    from hybridserve.model.cache import dtype_name

    model, config = load_model(str(path), dtype="float32", progress=False)
    bs = 16
    nb = -(-n // bs)
    pages = arena_layout(config, bs, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, bs)
    batch = ForwardBatch.from_lists(
        input_ids=PROMPT[:n], positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


@pytest.mark.parametrize("model,spec,fname", list(_files()))
def test_logits_equal_hf_on_the_dequantized_file(model, spec, fname, tmp_path):
    hf = _hf_on_file(spec, fname, tmp_path)
    n = len(PROMPT)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    got = _our_logits(FIXTURES / fname, n)
    err = (got - want).abs().max().item()
    assert err <= LOGIT_BOUND[_ftype(model, fname)] * want.std().item(), (fname, err, want.std().item())


@pytest.mark.parametrize("model,spec,fname", list(_files()))
def test_greedy_tokens_equal_hf_on_the_dequantized_file(model, spec, fname, tmp_path):
    from hybridserve import LLM, SamplingParams

    hf = _hf_on_file(spec, fname, tmp_path)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(16):  # plain greedy over the whole sequence: no cache, no stop token
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    want = ids[len(PROMPT):]
    llm = LLM(str(FIXTURES / fname), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == want
