"""``speculative_config``: what the user asks for, checked once at start-up.

vLLM's spelling: ``{"method": "mtp", "num_speculative_tokens": k}``, given to
``LLM(speculative_config=...)`` as a dict or to ``serve``/``bench`` as a JSON string
(``--speculative-config``). Unknown keys are refused, not ignored: a misspelt
``num_speculative_token`` silently running without speculation is the failure this
prevents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from hybridserve.errors import ConfigError

# The drafter is the checkpoint's own multi-token-prediction layer. vLLM accepts the
# architecture-specific names too; they mean the same thing here.
_METHODS = {"mtp": "mtp", "qwen3_5_mtp": "mtp", "qwen3_next_mtp": "mtp"}

# Drafting more than this many tokens with one MTP layer reused k times only lowers the
# mean accepted length per verified token (each further draft is conditioned on the
# layer's own guess); vLLM's docs recommend 1-3 for Qwen3.5.
MAX_SPECULATIVE_TOKENS = 8

# A step with at least this many decoding sequences does not draft: at that batch the
# decode step is no longer bound by reading the weights once, so verifying k+1 rows per
# sequence costs about k+1 times more and the drafts stop paying (benches/spec_decode.py
# measures the crossover; vLLM calls the knob disable_by_batch_size).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16

# A request whose drafts are accepted less often than this, over its last
# ACCEPTANCE_WINDOW drafted tokens, stops drafting for PROBE_AFTER tokens, then tries again.
DEFAULT_MIN_ACCEPTANCE_RATE = 0.2
ACCEPTANCE_WINDOW = 32
PROBE_AFTER = 64

_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", "min_acceptance_rate", "draft_vocab_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with the checkpoint's MTP layer.

    * ``num_speculative_tokens``: drafts per step and sequence (k).
    * ``disable_by_batch_size``: steps with this many decoding sequences or more do not
      draft (0 = never disable).
    * ``min_acceptance_rate``: a request below it stops drafting for a while.
    * ``draft_vocab_size``: drafts are token ids below it (the LM head's first rows; see
      :mod:`hybridserve.spec.proposer`); None: the default for the model's vocabulary.
      Changes acceptance only, never the output.
    """

    method: str = "mtp"
    num_speculative_tokens: int = 1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE
    draft_vocab_size: int | None = None

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """``None``/``{}``/``""`` -> None (off); a dict, a JSON object string or a
        SpeculativeConfig -> a checked config; anything else raises ConfigError."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"speculative_config is not valid JSON ({e.msg}); write it like "
                    "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'") from None
        if not isinstance(value, Mapping):
            raise ConfigError("speculative_config must be a JSON object such as "
                              "{\"method\": \"mtp\", \"num_speculative_tokens\": 2}, "
                              f"got {type(value).__name__}")
        if not value:
            return None
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigError(f"speculative_config has unknown key(s) {unknown}; known keys: {list(_KEYS)}")
        method = value.get("method", "mtp")
        if not isinstance(method, str) or method not in _METHODS:
            raise ConfigError(f"speculative_config method {method!r} is not supported; hybridserve drafts with "
                              "the checkpoint's MTP layer: use \"mtp\"")
        k = value.get("num_speculative_tokens", 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config num_speculative_tokens must be an integer in "
                              f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        d = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if d is None:
            d = 0
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ConfigError(f"speculative_config disable_by_batch_size must be an integer >= 0 "
                              f"(0 = never), got {d!r}")
        r = value.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
            raise ConfigError(f"speculative_config min_acceptance_rate must be a number in [0, 1], got {r!r}")
        n = value.get("draft_vocab_size")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"speculative_config draft_vocab_size must be a positive integer (drafts are the "
                              f"token ids below it) or null for the default, got {n!r}")
        return cls(method=_METHODS[method], num_speculative_tokens=k, disable_by_batch_size=d,
                   min_acceptance_rate=float(r), draft_vocab_size=n)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "disable_by_batch_size": self.disable_by_batch_size,
                "min_acceptance_rate": self.min_acceptance_rate, "draft_vocab_size": self.draft_vocab_size}
