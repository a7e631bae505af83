"""The bfloat16 CPU path against HF transformers run in bfloat16 on the same tiny
checkpoints: greedy tokens equal for the first 16 generated tokens (the engine's
batched decode steps, where the native bfloat16 GEMM and DeltaNet mixer run), and
prefill logits within the tolerance the device check uses for bfloat16
(``BF16_LOGIT_TOL`` of benches/gpu_checks/common.py: 0.05 of the largest logit)."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.kernels import native, ops
from hybridserve.model import load_model
from hybridserve.sampling import SamplingParams

BF16_LOGIT_TOL = 0.05  # = benches/gpu_checks/common.py BF16_LOGIT_TOL
N_TOKENS = 16


@pytest.fixture(scope="module")
def hf_bf16(tiny_dirs):
    import transformers

    return {p: transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
            for p, d in tiny_dirs.items()}


def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(259) for _ in range(n)] for n in (7, 33, 5, 20)]


def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].float().argmax()))
    return ids[len(prompt):]


@pytest.fixture
def calls(monkeypatch):
    """Counts the native bfloat16 entry points the model reached."""
    seen = {"linear_bf16": 0, "mixer_bf16": 0}
    real_linear, real_rule = native.linear_bf16, native.gated_delta_rule

    def linear(*a, **kw):
        seen["linear_bf16"] += 1
        return real_linear(*a, **kw)

    def rule(q, *a, **kw):
        if kw.get("z") is not None and ops.native.usable_bf16(q, kw["z"]):  # read in place, no float32 copies
            seen["mixer_bf16"] += 1
        return real_rule(q, *a, **kw)

    monkeypatch.setattr(native, "linear_bf16", linear)
    monkeypatch.setattr(native, "gated_delta_rule", rule)
    return seen


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_bf16_greedy_tokens_equal_hf_bf16(preset, tiny_dirs, hf_bf16, calls):
    prompts = _prompts()
    want = [_hf_greedy(hf_bf16[preset], p, N_TOKENS) for p in prompts]
    eng = LLMEngine(EngineArgs(model=tiny_dirs[preset], dtype="bfloat16", device="cpu", max_num_seqs=8,
                               block_size=16, cpu_threads=1))
    assert eng.dtype == torch.bfloat16
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
    assert [got[f"p{i}"] for i in range(len(prompts))] == want
    # The native bfloat16 kernels did the decode steps (not a silent PyTorch fallback).
    assert calls["linear_bf16"] > 0 and calls["mixer_bf16"] > 0


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_bf16_prefill_logits_within_the_device_checks_tolerance(preset, tiny_dirs, hf_bf16, prompt_logits):
    model, config = load_model(tiny_dirs[preset], dtype="bfloat16", progress=False)
    for p in _prompts():
        ours = prompt_logits(model, config, p)
        with torch.no_grad():
            ref = hf_bf16[preset](torch.tensor([p])).logits[0].float()
        err = float((ours - ref).abs().max() / ref.abs().max().clamp(min=1.0))
        assert err <= BF16_LOGIT_TOL, (preset, len(p), err)
