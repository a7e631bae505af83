"""Sampling parameters at the edges of their documented ranges give their limit
behaviour, never NaN and never "every token is id 0" (issue 21: float64 values that
over- or underflow in the float32 sampler).

Oracle: the definitions, in float64, per row: a vanishing top_p keeps only the most
likely token (greedy), a huge temperature is uniform over the tokens not masked out,
a repetition penalty divides/multiplies the logits of seen tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.sampler import Sampler, SamplingRow
from hybridserve.sampling import (
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_MAX,
    SamplingParams,
)

VOCAB = 8
LOGITS = torch.tensor([1.0, 3.5, -0.5, 2.0, 0.25, -4.0, 3.0, 0.5])
N = 8000


def _draw(params: SamplingParams, prompt=(), output=(), eos=None, n=N) -> list[int]:
    rows = [SamplingRow(params, list(prompt), list(output), eos_token_id=eos)] * n
    return Sampler()(LOGITS.expand(n, VOCAB), rows).token_ids


def _check_frequencies(tokens: list[int], probs: list[float]) -> None:
    freq = [tokens.count(t) / len(tokens) for t in range(VOCAB)]
    for f, p in zip(freq, probs):
        if p == 0.0:
            assert f == 0.0, (freq, probs)
        else:  # 5 standard deviations
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / len(tokens)) + 1e-9, (freq, probs)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-38, 1e-30, 1e-9])
def test_vanishing_top_p_is_greedy(top_p):
    torch.manual_seed(0)
    tokens = _draw(SamplingParams(temperature=1.0, top_p=top_p), n=500)
    assert set(tokens) == {int(LOGITS.argmax())}


def test_huge_temperature_is_uniform_over_allowed_tokens():
    torch.manual_seed(1)
    # min_tokens bans EOS (5... here 1, the favourite) and the stop token ids: -inf / T
    # must stay -inf, not NaN.
    params = SamplingParams(temperature=TEMPERATURE_MAX, min_tokens=4, stop_token_ids=[6])
    tokens = _draw(params, output=[0], eos=1)
    allowed = [t for t in range(VOCAB) if t not in (1, 6)]
    _check_frequencies(tokens, [1 / len(allowed) if t in allowed else 0.0 for t in range(VOCAB)])


@pytest.mark.parametrize("penalty", [REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_repetition_penalty_at_its_range_ends(penalty, temperature):
    torch.manual_seed(2)
    prompt, output = [1, 2], [6]
    x = LOGITS.double().tolist()
    for t in set(prompt) | set(output):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    tokens = _draw(SamplingParams(temperature=temperature, repetition_penalty=penalty), prompt, output)
    if temperature == 0.0:
        assert set(tokens) == {max(range(VOCAB), key=lambda t: x[t])}
    else:
        m = max(x)
        e = [math.exp(v - m) for v in x]
        _check_frequencies(tokens, [v / sum(e) for v in e])


def test_edge_parameters_together_never_give_nan():
    params = SamplingParams(temperature=TEMPERATURE_MAX, top_p=1e-300, min_p=1e-300,
                            repetition_penalty=REPETITION_PENALTY_MIN, min_tokens=3, stop_token_ids=[1, 3],
                            presence_penalty=2.0, frequency_penalty=-2.0, logit_bias={0: 100.0, 7: -100.0})
    rows = [SamplingRow(params, [0, 1], [0], eos_token_id=1)]
    processed = Sampler().process(LOGITS.unsqueeze(0), rows)
    assert not torch.isnan(processed).any()
    # top_p -> 0 keeps the single most likely token after everything else.
    assert torch.isfinite(processed).sum() == 1
    assert Sampler()(LOGITS.unsqueeze(0), rows).token_ids == [int(processed.argmax())]
