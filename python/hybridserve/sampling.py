"""Per-request sampling parameters, with vLLM's field names, defaults and ranges.

``SamplingParams`` is validated once, when it is built: every bad value raises
``hybridserve.errors.InvalidRequest`` whose message names the field, the value given
and the range allowed, so a caller (or the HTTP server, which answers 400 with that
message) knows exactly what to change. After construction the object is treated as
immutable by the engine; the sampler reads it every step without re-checking.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

from hybridserve.errors import InvalidRequest
from hybridserve.stop_strings import StopAutomaton

# Below this temperature a request samples greedily (vLLM's _SAMPLING_EPS): dividing
# logits by such a tiny number would overflow to inf and make softmax produce NaN.
SAMPLING_EPS = 1e-5

# The most top-k alternatives one sampled token may report. vLLM's default server cap
# is 20 (max_logprobs); a larger k costs a top-k over the whole vocabulary per token.
MAX_LOGPROBS = 20

# vLLM's ranges for the additive OpenAI penalties.
_PENALTY_MIN, _PENALTY_MAX = -2.0, 2.0

# The sampler works in float32. Every float parameter has a range inside which its
# float32 value gives the limit behaviour a caller expects, never NaN or inf (which
# make every sampled token id 0): outside the range is an InvalidRequest.
#
# temperature: logits are divided by it; above ~100 sampling is already uniform over
# the tokens left (logits differ by tens), and 1e4 keeps the quotient finite even for
# tokens masked to -inf (-inf / inf would be NaN).
TEMPERATURE_MAX = 1e4
# repetition_penalty: logits are divided or multiplied by it; float32 turns 1e-45 into
# 0 or a denormal, and x / 0 is inf. [1e-3, 1e3] keeps every product finite.
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 1e-3, 1e3
# top_p: any value in (0, 1] is accepted; one below this (which float32 may round to
# 0, keeping nothing) is raised to it. It is below any token's share of the top
# probability (>= 1 / vocabulary size), so the nucleus is the most likely token (and
# its ties): a vanishing top_p is greedy, as its limit is.
TOP_P_MIN = 1e-30


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `n=True` is almost certainly a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


# OpenAI's range for logit_bias values; larger magnitudes are clamped to it.
LOGIT_BIAS_LIMIT = 100.0


def _parse_logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise _bad("logit_bias", value, "None or a mapping of token id to a number in [-100, 100]")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = key
        if isinstance(key, str) and key.strip().isdigit():
            tok = int(key.strip())
        if not _is_int(tok) or tok < 0:
            raise InvalidRequest(
                f"SamplingParams.logit_bias key {key!r} is invalid: keys must be token ids "
                f"(integers >= 0, or strings of digits)"
            )
        if not _is_number(bias):
            raise InvalidRequest(
                f"SamplingParams.logit_bias[{key!r}]={bias!r} is invalid: biases must be finite numbers"
            )
        out[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return out


def _bad(field: str, value: Any, allowed: str) -> InvalidRequest:
    return InvalidRequest(f"SamplingParams.{field}={value!r} is invalid: {field} must be {allowed}")


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM's names and defaults).

    Fields:
      n: completions to generate for the prompt (>= 1). They share the prompt's KV
        blocks and are forked after prefill.
      max_tokens: the most tokens each completion generates (>= 1); None: up to the
        rest of the context (max_model_len - prompt tokens), as in vLLM.
      min_tokens: EOS and ``stop_token_ids`` are masked out, and stop strings are not
        checked, until a completion has this many tokens (0 <= min_tokens <= max_tokens).
      temperature: in [0, TEMPERATURE_MAX=1e4]; below ``SAMPLING_EPS`` (1e-5) the
        request is greedy (argmax after penalties) and top_p/top_k/min_p are ignored;
        a large temperature samples uniformly among the tokens not masked out.
      top_p: nucleus mass in (0, 1]; 1 disables. Values below TOP_P_MIN (1e-30) are
        stored as TOP_P_MIN, which keeps only the most likely token (greedy).
      top_k: keep the k most likely tokens; 0 or -1 disables (vLLM accepts both; -1 is
        stored as 0).
      min_p: in [0, 1]; drop tokens whose probability is below min_p times the top
        token's probability; 0 disables.
      seed: makes sampling reproducible for this request whatever else is in the batch;
        None draws from the global RNG.
      stop: strings that end a completion when they appear in its text (a single
        string is accepted and stored as a one-element list).
      stop_token_ids: token ids that end a completion (the id is kept in token_ids);
        below the model's vocabulary size (checked by :meth:`check_vocab`).
      ignore_eos: keep generating after the tokenizer's EOS token.
      presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logits of
        tokens already generated (once, and once per occurrence respectively).
      repetition_penalty: in [1e-3, 1e3]; logits of tokens in the prompt or the output
        are divided by it when positive and multiplied by it when negative; 1 disables.
      logprobs: None for no logprobs; k in [0, MAX_LOGPROBS] returns the chosen token's
        logprob plus the k most likely alternatives.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      skip_special_tokens: leave special tokens out of the detokenized text.
      logit_bias: None or a mapping token id -> bias added to that token's logit
        before any other processing (OpenAI's field; keys may be strings of digits
        as JSON sends them). Biases are clamped to [-100, 100]; ids must be >= 0 here
        and below the model's vocabulary size (checked by :meth:`check_vocab` when the
        engine accepts the request).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # A constraint on the output (hybridserve.structured.StructuredOutputsParams, or a
    # dict of its fields such as {"json": schema}); None: unconstrained.
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1, or None for the rest of the context")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (
                self.min_tokens if self.max_tokens is None else self.max_tokens):
            raise _bad(
                "min_tokens",
                self.min_tokens,
                f"an integer in [0, max_tokens={self.max_tokens}]",
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature <= TEMPERATURE_MAX:
            raise _bad("temperature", self.temperature,
                       f"a number in [0, {TEMPERATURE_MAX:g}] (0 means greedy; above ~100 it is "
                       "already uniform)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1] (1 disables it)")
        if self.top_p < TOP_P_MIN:
            self.top_p = TOP_P_MIN
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an integer >= 1, or 0 or -1 to disable it")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1] (0 disables it)")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not _PENALTY_MIN <= value <= _PENALTY_MAX:
                raise _bad(name, value, f"a number in [{_PENALTY_MIN}, {_PENALTY_MAX}] (0 disables it)")
        if not _is_number(self.repetition_penalty) or not (
            REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX
        ):
            raise _bad("repetition_penalty", self.repetition_penalty,
                       f"a number in [{REPETITION_PENALTY_MIN:g}, {REPETITION_PENALTY_MAX:g}] (1 disables it)")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise _bad("logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _bad("stop", self.stop, "None, a string or a list of strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "a list of non-empty strings")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise _bad("stop_token_ids", self.stop_token_ids, "None or a list of token ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "a list of integers >= 0")

        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)

        if self.structured_outputs is not None:
            from hybridserve.structured.params import StructuredOutputsParams

            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "true or false")

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidRequest when a token id this request names lies outside the model's
        vocabulary (known only to the engine, so checked when the request arrives)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise InvalidRequest(
                    f"SamplingParams.{name} names token id(s) {bad[:5]} outside the model's "
                    f"vocabulary [0, {vocab_size}); remove them"
                )

    @functools.cached_property
    def stop_automaton(self) -> StopAutomaton:
        """One automaton over all of ``stop``, built once per request and shared by its
        completions (the server builds it off the engine thread by reading this)."""
        return StopAutomaton(self.stop)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-compatible values (lists copied)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "structured_outputs" and value is not None:
                value = dataclasses.asdict(value)
            elif isinstance(value, list):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """Build from a mapping of field names; an unknown key raises InvalidRequest
        naming it and listing the accepted keys (a misspelt option must not be
        silently ignored)."""
        if not isinstance(data, Mapping):
            raise InvalidRequest(
                f"sampling parameters must be a JSON object (mapping), got {type(data).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidRequest(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"accepted parameters are: {', '.join(known)}"
            )
        return cls(**dict(data))


__all__ = ["SamplingParams", "SAMPLING_EPS", "MAX_LOGPROBS", "TEMPERATURE_MAX", "TOP_P_MIN"]
