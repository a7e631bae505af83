"""SamplingParams: vLLM's defaults, the allowed ranges, and error messages that say
which field is wrong, what was given and what is allowed."""

from __future__ import annotations

import re

import pytest

from hybridserve.errors import InvalidRequest
from hybridserve.sampling import MAX_LOGPROBS, SamplingParams

# vLLM's documented defaults (vllm.SamplingParams), the oracle for this table.
VLLM_DEFAULTS = dict(
    n=1, max_tokens=16, min_tokens=0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
    seed=None, stop=[], stop_token_ids=[], ignore_eos=False, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, logprobs=None,
    include_stop_str_in_output=False, skip_special_tokens=True, logit_bias=None, structured_outputs=None,
)


def test_defaults_are_vllms():
    assert SamplingParams().to_dict() == VLLM_DEFAULTS
    assert not SamplingParams().greedy


BAD = [
    ("n", 0), ("n", -3), ("n", 1.5), ("n", True),
    ("max_tokens", 0), ("max_tokens", "8"),
    ("min_tokens", -1), ("min_tokens", 17),  # > max_tokens=16
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("seed", 1.5), ("seed", "7"),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -9.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    # float32 turns these into 0 / inf, and every sampled token into id 0 (issue 21).
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e-45), ("repetition_penalty", 1e4),
    ("temperature", 1e308), ("temperature", 1e4 + 1),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0),
    ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", "12"), ("stop_token_ids", [1.0]),
    ("ignore_eos", 1), ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_values_name_field_value_and_range(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert f"SamplingParams.{field}=" in msg
    assert repr(value) in msg or repr(value) in msg.replace("'", '"')
    assert "must be" in msg
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still work
    assert info.value.http_status == 400


def test_min_tokens_range_mentions_max_tokens():
    with pytest.raises(InvalidRequest, match=re.escape("[0, max_tokens=4]")):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


GOOD = [
    ("n", 4), ("max_tokens", 1), ("min_tokens", 16), ("temperature", 0), ("temperature", 2.5),
    ("top_p", 1e-9), ("top_p", 1), ("top_k", 1), ("top_k", 0), ("min_p", 0), ("min_p", 1),
    ("seed", 0), ("seed", -5), ("seed", 2**70), ("presence_penalty", -2), ("presence_penalty", 2),
    ("frequency_penalty", 2.0), ("repetition_penalty", 1e-3), ("repetition_penalty", 10),
    ("repetition_penalty", 1e3), ("temperature", 1e4),
    ("logprobs", 0), ("logprobs", MAX_LOGPROBS), ("stop_token_ids", (1, 2)),
]


@pytest.mark.parametrize("field,value", GOOD)
def test_boundary_values_accepted(field, value):
    p = SamplingParams(**{field: value})
    assert getattr(p, field) == (list(value) if isinstance(value, tuple) else value)


def test_normalisations():
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's old "off" spelling
    # A top_p float32 would round to 0 (keeping no token) is raised to the smallest
    # nucleus, which is greedy.
    assert SamplingParams(top_p=1e-300).top_p == 1e-30
    assert SamplingParams(top_p=1e-30).top_p == 1e-30
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize("t,greedy", [(0.0, True), (0, True), (9e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_threshold(t, greedy):
    assert SamplingParams(temperature=t).greedy is greedy


def test_penalty_flag():
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_dict_round_trip():
    p = SamplingParams(n=3, max_tokens=40, min_tokens=2, temperature=0.3, top_p=0.8, top_k=5,
                       min_p=0.1, seed=9, stop=["x", "yy"], stop_token_ids=[3], ignore_eos=True,
                       presence_penalty=0.2, frequency_penalty=-0.2, repetition_penalty=1.1,
                       logprobs=2, include_stop_str_in_output=True, skip_special_tokens=False)
    d = p.to_dict()
    assert SamplingParams.from_dict(d) == p
    d["stop"].append("zzz")  # to_dict copies: the params stay as they were
    assert p.stop == ["x", "yy"]


def test_from_dict_rejects_unknown_keys_and_non_mappings():
    with pytest.raises(InvalidRequest, match=r"unknown sampling parameter\(s\) 'best_of', 'tempreature'") as info:
        SamplingParams.from_dict({"tempreature": 0.5, "best_of": 2, "n": 1})
    assert "temperature" in str(info.value).split("accepted parameters are:")[1]
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        SamplingParams.from_dict([("n", 1)])
    with pytest.raises(InvalidRequest, match=r"SamplingParams\.top_p="):
        SamplingParams.from_dict({"top_p": 2})
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_logit_bias_is_parsed_clamped_and_checked():
    p = SamplingParams(logit_bias={"5": 3, 7: -250.0, " 9": 101})
    assert p.logit_bias == {5: 3.0, 7: -100.0, 9: 100.0}  # OpenAI's [-100, 100]
    assert SamplingParams.from_dict(p.to_dict()) == p
    p.check_vocab(10)
    with pytest.raises(InvalidRequest, match=r"token id\(s\) \[9\] outside the model's vocabulary \[0, 9\)"):
        p.check_vocab(9)
    for bad in ({"x": 1}, {-1: 1}, {1: float("nan")}, {1: "3"}, [1, 2], {True: 1}):
        with pytest.raises(InvalidRequest, match="logit_bias"):
            SamplingParams(logit_bias=bad)
