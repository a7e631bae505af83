"""What a request constrains its output to (vLLM's ``structured_outputs`` names).

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
``structural_tag`` is set. ``reasoning`` says the output opens inside a reasoning
block (Qwen3.5's generation prompt already wrote ``<think>``): the text up to
``</think>`` is free (the think tags themselves excluded) and the constraint holds
for what follows ``</think>\\n\\n``. Built and checked without importing the grammar
engine; compiling happens in :mod:`hybridserve.structured.grammar`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from hybridserve.errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on a completion's text.

    Fields:
      json: a JSON schema (a dict, or its JSON text) the output must validate against.
      regex: a regular expression the whole output must match.
      choice: a list of strings; the output is exactly one of them.
      grammar: an EBNF grammar (xgrammar / GBNF dialect, rule ``root`` first).
      json_object: True for any JSON object (OpenAI's ``{"type": "json_object"}``).
      structural_tag: an xgrammar structural tag (a dict or its JSON text); the
        server builds one for tool calls.
      reasoning: the output starts inside ``<think>``; constrain only after ``</think>``.
    """

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs needs exactly one of " + ", ".join(KINDS)
                + (f"; got {given}" if given else "; got none")
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequest(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequest("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequest("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequest("structured_outputs.grammar must be a non-empty EBNF string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequest("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise InvalidRequest("structured_outputs.json_object must be true or false")
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except ValueError as e:
                raise InvalidRequest(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise InvalidRequest("structured_outputs.structural_tag must be an object")
        if not isinstance(self.reasoning, bool):
            raise InvalidRequest("structured_outputs.reasoning must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The compile cache's key: the same constraint gives the same text."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams":
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequest("structured_outputs must be an object such as {\"json\": {...}}, "
                                 f"{{\"regex\": \"...\"}} or {{\"choice\": [...]}}; got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        # vLLM's options that change nothing here are accepted and ignored.
        ignored = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                   "whitespace_pattern", "backend"}
        unknown = sorted(k for k in value if k not in known and k not in ignored)
        if unknown:
            raise InvalidRequest(f"unknown structured_outputs field(s) {unknown}; accepted: {sorted(known)}")
        return cls(**{k: v for k, v in value.items() if k in known})
