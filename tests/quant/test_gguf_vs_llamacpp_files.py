"""hybridserve on the GGUF files llama.cpp wrote (``tests/fixtures/gguf``) equals HF
transformers on the same files' dequantized weights (issue 35).

For each fixture: the oracle is HF's ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
(config from the generator that made the file) holding the file's tensors dequantized by
the ``gguf`` package (llama.cpp's reader) and mapped back to HF names and layouts
(``tests/fixtures/gguf/hf_to_gguf.py``: the converter's transforms undone). Ours is
``load_model(file.gguf)`` (logits of one prompt) and ``LLM(file.gguf)`` (16 greedy tokens).

Both product paths run (the conftest's ``kernel_path``): the reference products (float
activations: logits within 1e-4 of the largest |logit|, ``LLM`` greedy tokens equal to
HF's outright) and the native block kernels, which round activations to 8 bits per block
as llama.cpp's vec_dot does: there the oracle applies the same rounding at the same
products (gguf_helpers' ``round_like_kernels``), logits within its ``LOGIT_BOUND``,
greedy tokens checked step by step on HF's tokens (differing only where HF's own top-2
margin is within our measured deviation), and ``LLM``'s tokens equal the model's own
greedy decode. (Against plain HF without that rounding, the native path's logits on
these files differ by 0.03-0.06 of the logits' standard deviation: a random tiny model
amplifies the 8-bit rounding.)

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
def test_logits_equal_hf_on_the_dequantized_file(model, spec, fname, tmp_path, kernel_path):
    from gguf_helpers import LOGIT_BOUND, round_like_kernels

    hf = _hf_on_file(spec, fname, tmp_path)
    if kernel_path == "native":
        round_like_kernels(hf, str(FIXTURES / fname))
    n = len(PROMPT)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    got = _our_logits(FIXTURES / fname, n)
    err = (got - want).abs().max().item()
    assert err <= LOGIT_BOUND[kernel_path] * want.abs().max().item(), (fname, err, want.abs().max().item())


@pytest.mark.parametrize("model,spec,fname", list(_files()))
def test_greedy_tokens_equal_hf_on_the_dequantized_file(model, spec, fname, tmp_path, kernel_path):
    from gguf_helpers import LOGIT_BOUND, check_greedy, forced_decode_logits, greedy, hf_greedy, round_like_kernels

    from hybridserve import LLM, SamplingParams
    from hybridserve.model import load_model

    path = str(FIXTURES / fname)
    hf = _hf_on_file(spec, fname, tmp_path)
    if kernel_path == "native":
        round_like_kernels(hf, path)
    want, hf_rows = hf_greedy(hf, PROMPT, 16)
    ours, config = load_model(path, dtype="float32", progress=False)
    ties = check_greedy(forced_decode_logits(ours, config, PROMPT, want), want, hf_rows, LOGIT_BOUND[kernel_path])
    assert ties <= 2, f"{ties} of 16 steps are ties within our deviation: the check says little there"
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    expect = want if kernel_path == "reference" else greedy(ours, config, PROMPT, 16)
    assert list(out[0].outputs[0].token_ids) == expect
