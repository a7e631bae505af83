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


def _unwrap_value(raw: str) -> str:
    """A parameter's VALUE: the text between ``<parameter=P>`` and ``</parameter>``
    less the one newline the format puts on each side (a value written without them,
    by an unconstrained model, is taken as it is)."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
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
                    # The template writes one newline each side of a value, and the
                    # tool grammar (structured.grammar.qwen_xml_arguments_format)
                    # allows exactly that: only those two are the format's, the rest
                    # of the whitespace is the value's (as vLLM's qwen3_coder reads it).
                    value = _unwrap_value(p.group(2))
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


class _Emitter:
    """One growing field (reasoning or content) as it streams: the text is stripped at
    both ends in the end, so leading whitespace is dropped and trailing whitespace
    waits until more text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.ws: list[str] = []  # trailing whitespace held back (a list: a long run stays linear)
        self.scanned = 0

    def add(self, s: str) -> str:
        self.scanned += len(s)
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        k = len(s.rstrip())
        if k == 0:
            self.ws.append(s)
            return ""
        out = "".join(self.ws) + s[:k]
        self.ws = [s[k:]]
        return out


def _held(text: str, start: int, end: int, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of text[start:end] that may begin a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, end - start), best, -1):
            if text.startswith(m[:k], end - k, end):
                best = k
                break
    return best


class StreamingParser:
    """The deltas of one streamed choice: ``feed_delta(new text)`` (or ``feed(whole
    text so far)``) returns a list of OpenAI delta objects (reasoning_content / content /
    tool_calls).

    Incremental: between calls it keeps its position, so each call scans only the new
    text plus a bounded lookback (a partly received marker such as ``<tool_call>`` or
    ``</think>``); ``scanned`` counts the characters examined. Text goes out only once
    nothing later can change it, so the pieces are prefixes of the non-streamed parse;
    the final call parses the whole text once (linear) and sends what remains of it.

    Linear in copying too: it keeps only the text it may still need (from the current
    segment's unsent part, or an open call's start) in one buffer; while a call is open
    and the new text cannot close it, the new text waits in a list and is joined once.
    ``copied`` counts the characters copied into that buffer.
    """

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self._sent = {"reasoning": [], "content": []}  # pieces sent (joined once, at the end)
        self.sent_calls = 0
        self.final: Parsed | None = None
        self.scanned = 0
        self._tools = parser.tool_parser is not None
        self._stage = "start"  # start | reasoning | content
        self._lead = 0  # start stage: leading whitespace skipped so far
        self._seg_start = 0  # where the current segment's unprocessed text starts
        self._think_from = 0  # where the next </think> search starts
        self._call_at = -1  # an open <tool_call>'s index, or -1
        self._end_from = 0  # where the next </tool_call> search starts
        self._calls: list[ToolCall] = []
        self._emit = {"reasoning": _Emitter(), "content": _Emitter()}
        self._pieces: list[str] = []  # everything received, joined once for the final parse
        self._tail = ""  # the last characters received (a marker split across deltas)
        self._buf = ""  # the received text still needed; the indexes above are into it
        self._pending: list[str] = []  # text received while an open call cannot close
        self._received = 0
        self.copied = 0

    @property
    def sent_reasoning(self) -> str:
        return "".join(self._sent["reasoning"])

    @property
    def sent_content(self) -> str:
        return "".join(self._sent["content"])

    def _field(self, name: str, piece: str, deltas: list[dict[str, Any]]) -> None:
        piece = self._emit[name].add(piece)
        if not piece:
            return
        self._sent[name].append(piece)
        deltas.append({"reasoning_content": piece} if name == "reasoning" else {"content": piece})

    def _segment(self, text: str, end: int, field_name: str, holds: tuple[str, ...],
                 closed: bool, deltas: list[dict[str, Any]]) -> None:
        """Processes text[self._seg_start:end] of a segment; ``closed``: the segment
        ends at ``end`` (an open call and a held suffix become text)."""
        pos = self._seg_start
        while True:
            if self._call_at >= 0:
                a = max(self._end_from, self._call_at + len(CALL_START))
                j = text.find(CALL_END, a, end)
                self.scanned += max(0, end - a)
                if j < 0:
                    if closed:  # cut off inside the segment: the block is text
                        self._field(field_name, text[self._call_at:end], deltas)
                        self._call_at, pos = -1, end
                    else:
                        self._end_from = max(a, end - len(CALL_END) + 1)
                    break
                body = text[self._call_at + len(CALL_START):j]
                self.scanned += len(body)
                got = self.parser._parse_call(body)
                if got is None:  # malformed: stays text
                    self._field(field_name, text[self._call_at:j + len(CALL_END)], deltas)
                else:
                    for call in got:
                        i = len(self._calls)
                        self._calls.append(call)
                        deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                       "function": {"name": call.name, "arguments": ""}}]})
                        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
                self._call_at, pos = -1, j + len(CALL_END)
                continue
            i = text.find(CALL_START, pos, end) if self._tools else -1
            self.scanned += max(0, end - pos)
            if i >= 0:
                self._field(field_name, text[pos:i], deltas)
                self._call_at, self._end_from = i, i + len(CALL_START)
                pos = i
                continue
            keep = 0 if closed else _held(text, pos, end, holds)
            self._field(field_name, text[pos:end - keep], deltas)
            pos = end - keep
            break
        self._seg_start = pos if self._call_at < 0 else self._call_at

    def _advance(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        n = len(text)
        call_holds = (CALL_START,) if self._tools else ()
        if self._stage == "start":
            while self._lead < n and text[self._lead].isspace():
                self._lead += 1
            self.scanned += 1
            head = text[self._lead:self._lead + len(THINK_START)]
            if len(head) < len(THINK_START) and THINK_START.startswith(head):
                return deltas  # may yet open <think>: wait
            has_think = head == THINK_START
            if self.parser.reasoning or has_think:
                self._stage = "reasoning"
                self._seg_start = self._lead + len(THINK_START) if has_think else 0
                self._think_from = self._seg_start
            else:
                self._stage, self._seg_start = "content", 0
        if self._stage == "reasoning":
            a = self._think_from
            i = text.find(THINK_END, a)
            self.scanned += n - a
            if i < 0:
                self._think_from = max(a, n - len(THINK_END) + 1)
                self._segment(text, n, "reasoning", (THINK_END, *call_holds), False, deltas)
                return deltas
            self._segment(text, i, "reasoning", (), True, deltas)
            self._stage, self._seg_start, self._call_at = "content", i + len(THINK_END), -1
        self._segment(text, n, "content", call_holds, False, deltas)
        return deltas

    def _may_close(self, delta: str) -> bool:
        """Whether ``delta`` may end the open call (or, in the reasoning, the segment)."""
        probe = self._tail + delta[:len(CALL_END)]
        if CALL_END in probe or CALL_END in delta:
            return True
        return self._stage == "reasoning" and (THINK_END in probe or THINK_END in delta)

    def _trim(self) -> None:
        """Drops the buffer's prefix nothing will read again (sent text, skipped
        whitespace), and moves the indexes with it."""
        if self._stage == "start":
            cut = self._lead
        else:
            cut = self._seg_start
            if self._stage == "reasoning":
                cut = min(cut, self._think_from)
        if cut <= 0:
            return
        self._buf = self._buf[cut:]
        self.copied += len(self._buf)
        self._lead = max(0, self._lead - cut)
        self._seg_start -= cut
        self._think_from = max(0, self._think_from - cut)
        self._end_from = max(0, self._end_from - cut)
        if self._call_at >= 0:
            self._call_at -= cut

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """``text``: the whole output so far (the last call's ``text`` and more)."""
        return self.feed_delta(text[self._received:], final)

    def feed_delta(self, delta: str, final: bool) -> list[dict[str, Any]]:
        """``delta``: the output's new text since the last call."""
        self._pieces.append(delta)
        self._received += len(delta)
        if final:
            return self._final("".join(self._pieces))
        deltas: list[dict[str, Any]] = []
        if self._call_at >= 0 and not self._may_close(delta):
            self._pending.append(delta)  # nothing can go out before the call closes
        else:
            self._buf = "".join([self._buf, *self._pending, delta])
            self.copied += len(self._buf)
            self._pending.clear()
            deltas = self._advance(self._buf)
            self._trim()
        self._tail = (self._tail + delta[-len(CALL_END):])[-len(CALL_END):]
        return deltas

    def _final(self, text: str) -> list[dict[str, Any]]:
        p = self.parser.parse(text, final=True)
        self.scanned += len(text)
        for call, sent in zip(p.calls, self._calls):
            call.id = sent.id  # the ids the client already has
        self.final = p
        deltas: list[dict[str, Any]] = []
        for name, key, whole in (("reasoning", "reasoning_content", p.reasoning or ""),
                                 ("content", "content", p.content or "")):
            sent = "".join(self._sent[name])
            if len(whole) > len(sent) and whole.startswith(sent):
                deltas.append({key: whole[len(sent):]})
                self._sent[name] = [whole]
        for i in range(len(self._calls), len(p.calls)):
            call = p.calls[i]
            deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        self.sent_calls = len(p.calls)
        return deltas
