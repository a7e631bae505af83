"""The output law under speculation equals the target's: a chi-square test against the
exact joint distribution of the first three generated tokens, computed from HF
transformers' ``Qwen3_5ForCausalLM`` (the oracle), with ``top_k=4`` so the joint has
4**3 = 64 outcomes.

The trained default model is used because its MTP layer drafts well: with k = 2 the
second and third tokens are decided by the acceptance rule (token 1 comes from the
prefill, then drafts for tokens 2 and 3 are verified in one step), so an acceptance
rule that kept drafts too often (or too rarely, biasing the corrections) shows up as a
distorted joint.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hybridserve import LLM, SamplingParams, default_model

N = 2000
TOP_K = 4


def _topk_probs(logits: torch.Tensor) -> dict[int, float]:
    v, i = logits.float().topk(TOP_K)
    p = torch.softmax(v, dim=-1)
    return {int(t): float(q) for t, q in zip(i, p)}


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def joint():
    import transformers

    path = default_model.path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.encode("def main(argv):\n    ")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def probs(seq):
        with torch.no_grad():
            return _topk_probs(hf(torch.tensor([seq])).logits[0, -1])

    out = {}
    for t1, p1 in probs(prompt).items():
        for t2, p2 in probs(prompt + [t1]).items():
            for t3, p3 in probs(prompt + [t1, t2]).items():
                out[(t1, t2, t3)] = p1 * p2 * p3
    assert abs(sum(out.values()) - 1) < 1e-4
    return path, prompt, out


def test_first_three_tokens_follow_the_targets_joint(joint):
    path, prompt, exact = joint
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=64, num_pages=2000,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params)
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        assert key in exact, f"{key} is outside the top-{TOP_K} support"
        counts[key] = counts.get(key, 0) + 1
    st = llm.engine.stats()
    # The acceptance rule really ran: drafts were verified, some kept, some rejected.
    assert st["spec_draft_tokens"] > N // 2
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    # Cells with a small expectation are pooled (the chi-square needs >= 5 expected).
    stat, df, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for key, p in sorted(exact.items(), key=lambda kv: -kv[1]):
        e, o = N * p, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_e += e
            pooled_o += o
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    assert df >= 8
    assert stat < _chi2_critical(df), (stat, df, _chi2_critical(df))
