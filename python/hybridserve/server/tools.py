"""Reasoning and tool-call parsing of Qwen models' output (vLLM's ``qwen3`` reasoning
parser, and its ``qwen3_coder`` / ``hermes`` tool parsers).

Formats:

* reasoning: ``...</think>`` when the prompt opened ``<think>`` (Qwen3.5's generation
  prompt does), or ``<think>...</think>`` at the start of the output;
* ``qwen3_coder`` (Qwen3.5, Qwen3-Coder; what Qwen3.5's template teaches)::

      <tool_call>
      <function=NAME>
      <parameter=P>
      VALUE
      </parameter>
      </function>
      </tool_call>

  VALUE is raw text, converted by the type the function's parameter schema gives P;
* ``hermes`` (Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

One function, :meth:`OutputParser.parse`, gives both the whole message and, applied to
a growing text with ``final=False``, the part of it that can no longer change; the
streaming parser sends the differences, so the streamed pieces add up exactly to the
non-streamed message. A block that is malformed (unparsable) stays in the text; one cut
off by ``max_tokens`` comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_PARSERS = ("qwen3_coder", "hermes")
REASONING_PARSERS = ("qwen3",)
THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"

_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>\n?(.*?)</function>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def default_parsers(chat_template: str | None) -> tuple[str | None, str | None]:
    """(reasoning parser, tool parser) for a checkpoint, read off its chat template."""
    t = chat_template or ""
    reasoning = "qwen3" if THINK_START in t or THINK_END in t else None
    if CALL_START in t:
        tool = "qwen3_coder" if "<function=" in t else "hermes"
    else:
        tool = None
    return reasoning, tool


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _schema_types(sub)
    if "enum" in schema and not out:
        vals = schema["enum"]
        if vals and all(isinstance(v, str) for v in vals):
            out = ["string"]
    return out


def _typed_ok(text: str, types: list[str]) -> bool:
    """Whether ``text`` reads as one of the non-string ``types``."""
    for t in types:
        if t == "integer" and re.fullmatch(r"-?\d+", text):
            return True
        if t == "number" and re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text):
            return True
        if t == "boolean" and text.lower() in ("true", "false"):
            return True
        if t == "null" and text.lower() == "null":
            return True
    return False


def convert_value(raw: str, schema: Any) -> Any:
    """A qwen3_coder parameter's raw text as the type its schema gives it."""
    types = _schema_types(schema)
    text = raw.strip()
    if "string" in types and not (text.lower() == "null" and "null" in types):
        if types[0] == "string" or not _typed_ok(text, types):
            return raw
    if text.lower() == "null" and (not types or "null" in types):
        return None
    for t in types:
        if t == "integer":
            try:
                return int(text)
            except ValueError:
                pass
        elif t == "number":
            try:
                v = float(text)
                return int(v) if v.is_integer() and re.fullmatch(r"-?\d+", text) else v
            except ValueError:
                pass
        elif t == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        elif t in ("object", "array"):
            try:
                return json.loads(text)
            except ValueError:
                pass
    try:
        return json.loads(text)
    except ValueError:
        return raw


class OutputParser:
    """Parses one completion's text; ``tools`` maps a function name to its parameter
    schema (None: no tool parsing)."""

    def __init__(self, *, reasoning: bool, tool_parser: str | None,
                 tools: dict[str, Any] | None) -> None:
        self.reasoning = reasoning
        self.tool_parser = tool_parser if tools is not None else None
        self.tools = tools or {}

    # -- one tool-call block
    def _parse_call(self, body: str) -> list[ToolCall] | None:
        b = body.strip()
        if b.startswith("<function="):
            calls = []
            for m in _FUNCTION_RE.finditer(b):
                name = m.group(1).strip()
                props = (self.tools.get(name) or {}).get("properties") or {}
                args = {}
                for p in _PARAM_RE.finditer(m.group(2)):
                    pname = p.group(1).strip()
                    # The whitespace around a value is the format's (Qwen writes one
                    # newline each side; the grammar allows a little more).
                    value = p.group(2).strip()
                    args[pname] = convert_value(value, props.get(pname))
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            return calls or None
        if b.startswith("{"):
            try:
                obj = json.loads(b)
            except ValueError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]
        return None

    def _segment(self, seg: str, final: bool, holds: tuple[str, ...]) -> tuple[str, list[ToolCall]]:
        """Text outside tool-call blocks, and the calls of the complete blocks. Not
        final: an unclosed block and a suffix that may start a marker are held back,
        and so is trailing whitespace (the final text is stripped)."""
        text, calls, pos = [], [], 0
        if self.tool_parser is not None:
            while True:
                i = seg.find(CALL_START, pos)
                if i < 0:
                    break
                j = seg.find(CALL_END, i + len(CALL_START))
                if j < 0:
                    if not final:
                        text.append(seg[pos:i])
                        pos = len(seg)
                        seg = seg[:i]
                    break
                text.append(seg[pos:i])
                got = self._parse_call(seg[i + len(CALL_START):j])
                if got is None:
                    text.append(seg[i:j + len(CALL_END)])  # malformed: stays text
                else:
                    calls += got
                pos = j + len(CALL_END)
        text.append(seg[pos:])
        out = "".join(text)
        if final:
            return out.strip(), calls
        out = out.lstrip()
        for marker in holds:
            for k in range(min(len(marker) - 1, len(out)), 0, -1):
                if out.endswith(marker[:k]):
                    out = out[:-k]
                    break
        return out.rstrip(), calls

    def parse(self, text: str, final: bool = True) -> Parsed:
        call_holds = (CALL_START,) if self.tool_parser is not None else ()
        reasoning = None
        if self.reasoning or text.lstrip().startswith(THINK_START):
            body = text
            stripped = body.lstrip()
            if stripped.startswith(THINK_START):
                body = stripped[len(THINK_START):]
            i = body.find(THINK_END)
            if i < 0:
                r, calls = self._segment(body, final, (THINK_END, *call_holds))
                return Parsed(r if (r or not final) else None, None if final else "", calls)
            reasoning, r_calls = self._segment(body[:i], True, ())
            rest = body[i + len(THINK_END):]
        else:
            r_calls, rest = [], text
        content, calls = self._segment(rest, final, call_holds)
        calls = r_calls + calls
        if final:
            return Parsed(reasoning or None, content if content or not calls else None, calls)
        return Parsed(reasoning, content, calls)


class StreamingParser:
    """The deltas of one streamed choice: ``feed(whole text so far)`` returns a list of
    OpenAI delta objects (reasoning_content / content / tool_calls)."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_calls = 0
        self.final: Parsed | None = None

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        p = self.parser.parse(text, final=final)
        if final:
            self.final = p
        deltas: list[dict[str, Any]] = []
        r = p.reasoning or ""
        if len(r) > len(self.sent_reasoning) and r.startswith(self.sent_reasoning):
            deltas.append({"reasoning_content": r[len(self.sent_reasoning):]})
            self.sent_reasoning = r
        c = p.content or ""
        if len(c) > len(self.sent_content) and c.startswith(self.sent_content):
            deltas.append({"content": c[len(self.sent_content):]})
            self.sent_content = c
        for i in range(self.sent_calls, len(p.calls)):
            call = p.calls[i]
            deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        self.sent_calls = len(p.calls)
        return deltas
