"""The OpenAI contract around tools, structured outputs and thinking, for the server.

``prepare`` reads a request's ``response_format``, vLLM's ``structured_outputs``,
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and ``chat_template_kwargs``,
checks them (every problem a 400 naming it), renders the chat prompt with the
checkpoint's own template (tools included) and sets the request's constraint on its
``SamplingParams``. The returned :class:`Contract` turns the engine's text into the
OpenAI message (``reasoning_content``, ``content``, ``tool_calls``), whole or streamed.

Constraints: ``response_format`` / ``structured_outputs`` compile to a grammar; with
tools, ``tool_choice="required"`` or a named function is enforced by xgrammar's Qwen
structural tag (the call is always well formed, its arguments follow the schema), and
``"auto"`` constrains a call's arguments once the model opens ``<tool_call>``. When the
prompt opened ``<think>`` (Qwen3.5 with thinking on), the constraint starts after
``</think>``: the reasoning is free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hybridserve.errors import InvalidRequest
from hybridserve.server.tools import REASONING_PARSERS, TOOL_PARSERS, OutputParser, StreamingParser
from hybridserve.structured.params import StructuredOutputsParams

def _bad(message: str, param: str) -> InvalidRequest:
    from hybridserve.server.protocol import ApiError

    return ApiError(message, param=param)


def _check_schema(schema: Any, where: str, param: str) -> None:
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON schema (an object), got {type(schema).__name__}", param)
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - the grammar compiler still checks it
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise _bad(f"{where} is not a valid JSON schema: {e.message}", param) from None


def _response_format(body: dict[str, Any]) -> StructuredOutputsParams | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                   "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise _bad("response_format.json_schema must be an object with a 'schema' (and a 'name')",
                   "response_format")
    _check_schema(js["schema"], "response_format.json_schema.schema", "response_format")
    return StructuredOutputsParams(json=js["schema"])


def _tools(body: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                       "\"parameters\": {...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise _bad(f"tools[{i}].function.name must be a non-empty string without '<', '>' or newlines",
                       "tools")
        if name in out:
            raise _bad(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        _check_schema(params, f"tools[{i}].function.parameters", "tools")
        if params.get("type", "object") != "object":
            raise _bad(f"tools[{i}].function.parameters must be an object schema (\"type\": \"object\")", "tools")
        from hybridserve.structured.grammar import unenforced_keywords

        bad = unenforced_keywords(params)
        if bad:
            raise _bad(f"tools[{i}].function.parameters uses keywords the engine cannot enforce: "
                       + ", ".join(bad[:8]), "tools")
        out[name] = params
    return out


def _tool_choice(body: dict[str, Any], tools: dict[str, Any] | None) -> str | dict[str, Any]:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise _bad("tool_choice \"required\" needs a non-empty 'tools' list", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools or name not in tools:
            raise _bad(f"tool_choice names the function {name!r}, which is not in 'tools' "
                       f"({sorted(tools or [])})", "tool_choice")
        return choice
    raise _bad("tool_choice must be \"none\", \"auto\", \"required\" or "
               "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: tool-call arguments as mappings."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "tool" and not m.get("tool_call_id"):
            raise _bad(f"messages[{i}] has role 'tool' but no 'tool_call_id'", "messages")
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"messages[{i}].tool_calls[{j}] needs function.name and function.arguments",
                               "messages")
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                   "messages") from None
                calls.append({**c, "function": {**fn, "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


@dataclass
class Contract:
    """What one request needs after generation: how to read its output."""

    reasoning: bool = False  # the output opens inside <think>
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools: dict[str, Any] | None = None  # name -> parameter schema, when calls are parsed
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops reasoning_content
    streams: dict[int, StreamingParser] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tools is not None

    def _parser(self) -> OutputParser:
        return OutputParser(reasoning=self.reasoning, tool_parser=self.tool_parser, tools=self.tools)

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """Rewrites a non-streamed chat body's messages into reasoning / content / tool calls."""
        if not self.active:
            return body
        for ch in body["choices"]:
            p = self._parser().parse(ch["message"]["content"] or "", final=True)
            msg: dict[str, Any] = {"role": "assistant", "content": p.content}
            if self.reasoning_parser is not None:
                msg["reasoning_content"] = p.reasoning if self.include_reasoning else None
            if p.calls:
                msg["tool_calls"] = [c.to_openai() for c in p.calls]
                if ch["finish_reason"] == "stop":
                    ch["finish_reason"] = "tool_calls"
            elif msg["content"] is None:
                msg["content"] = ""
            ch["message"] = msg
        return body

    def stream_choices(self, index: int, text: str, finish_reason: str | None,
                       logprobs: Any) -> list[dict[str, Any]]:
        """The streamed choice objects for ``text`` (the choice's new text), each to go
        out in its own chunk; the last one carries the finish reason."""
        sp = self.streams.get(index)
        if sp is None:
            sp = self.streams[index] = StreamingParser(self._parser())
        done = finish_reason is not None
        # The new text only: the parser keeps what it still needs (re-joining the whole
        # text here on every delta would copy O(n^2) characters over a long stream).
        deltas = sp.feed_delta(text, final=done)
        if not self.include_reasoning:
            deltas = [d for d in deltas if "reasoning_content" not in d]
        if done and sp.final is not None and sp.final.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if logprobs is not None:
            if out:
                out[0]["logprobs"] = logprobs
            else:
                out.append({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None})
        if done:
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason})
        return out


@dataclass
class Prepared:
    contract: Contract
    spec: StructuredOutputsParams | None  # before the reasoning flag is known
    template_kwargs: dict[str, Any]
    tool_choice: Any
    parallel_tool_calls: bool


def prepare(body: dict[str, Any], *, chat: bool, reasoning_parser: str | None,
            tool_parser: str | None) -> Prepared:
    """Checks the contract's fields of a request body (400s naming the problem)."""
    spec = _response_format(body)
    so = body.get("structured_outputs")
    if so is not None:
        if spec is not None:
            raise _bad("give response_format or structured_outputs, not both", "structured_outputs")
        if isinstance(so, dict) and so.get("json") is not None and not isinstance(so["json"], str):
            _check_schema(so["json"], "structured_outputs.json", "structured_outputs")
        spec = StructuredOutputsParams.coerce(so)
    if not chat:
        if body.get("use_beam_search") and spec is not None:
            raise _bad("use_beam_search cannot be combined with a constraint (response_format / "
                       "structured_outputs): each beam would need its own grammar state", "use_beam_search")
        return Prepared(Contract(), spec, {}, "none", True)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    ptc = body.get("parallel_tool_calls", True)
    if not isinstance(ptc, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if spec is not None and (choice == "required" or isinstance(choice, dict)):
        raise _bad("response_format / structured_outputs asks for an answer in a format, and tool_choice "
                   f"{choice if isinstance(choice, str) else 'naming a function'} asks for a tool call: "
                   "drop one, or use tool_choice \"auto\" or \"none\"", "tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs must be an object (e.g. {\"enable_thinking\": false})",
                   "chat_template_kwargs")
    reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "tokenize", "conversation"})
    if reserved:
        raise _bad(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    include_reasoning = body.get("include_reasoning", True)
    if not isinstance(include_reasoning, bool):
        raise _bad("include_reasoning must be true or false", "include_reasoning")
    template_kwargs = dict(kwargs)
    if tools:
        template_kwargs["tools"] = [{"type": "function", "function": t["function"]} for t in body["tools"]]
    contract = Contract(reasoning_parser=reasoning_parser, tool_parser=tool_parser,
                        include_reasoning=include_reasoning,
                        tools=tools if tools and choice != "none" and tool_parser else None)
    return Prepared(contract, spec, template_kwargs, choice, ptc)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                prep: Prepared) -> list[int]:
    """The prompt's token ids, rendered by the checkpoint's own template (tools and
    chat_template_kwargs included); records whether it opened ``<think>``."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this checkpoint's tokenizer has no chat_template; send a plain prompt")
    msgs = _template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **prep.template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages
        raise InvalidRequest(f"the chat template cannot render these messages: {e}") from None
    prep.contract.reasoning = (prep.contract.reasoning_parser is not None
                               and text.rstrip().endswith("<think>") and add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def constraint(prep: Prepared, tools_json: list[dict[str, Any]] | None) -> StructuredOutputsParams | None:
    """The request's constraint, once the prompt is rendered (it depends on whether the
    output opens inside the reasoning)."""
    c = prep.contract
    if prep.spec is not None:
        prep.spec.reasoning = c.reasoning
        return StructuredOutputsParams.coerce(prep.spec.__dict__)
    if c.tools is None or c.tool_parser is None:
        return None
    from hybridserve.structured.grammar import _require_xgrammar

    from hybridserve.structured.grammar import JSON_MAX_WHITESPACE

    xgr = _require_xgrammar()
    model = "qwen_3_5" if c.tool_parser == "qwen3_coder" else "qwen_3"
    try:
        tag = xgr.get_model_structural_tag(
            model, tools=tools_json, tool_choice=prep.tool_choice,
            reasoning="enabled" if c.reasoning else "disabled",
            parallel_tool_calls=prep.parallel_tool_calls, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    except Exception as e:  # noqa: BLE001 - xgrammar's ValueError / validation errors
        raise _bad(f"cannot build the tool-call grammar: {e}", "tools") from None
    tag = json.loads(tag.model_dump_json())
    if model == "qwen_3_5":
        _exact_qwen_xml(tag)
    if prep.tool_choice == "required":
        _calls_only(tag)
    return StructuredOutputsParams(structural_tag=tag)


def _exact_qwen_xml(node: Any) -> None:
    """Each call's arguments exactly as Qwen3.5's template writes them (one newline
    after ``<parameter=P>`` and before ``</parameter>``, strings raw), in place of
    xgrammar's "qwen_xml" style, which lets whitespace in around every value: the
    parser then takes exactly one newline off each side, and a string's own
    leading / trailing whitespace survives the round trip."""
    from hybridserve.structured.grammar import qwen_xml_arguments_format

    if isinstance(node, dict):
        content = node.get("content")
        if (node.get("type") == "tag" and isinstance(content, dict) and content.get("type") == "json_schema"
                and content.get("style") == "qwen_xml"):
            m = re.search(r"<function=([^>\n]+)>\n$", node.get("begin") or "")
            name = m.group(1) if m else "?"
            try:
                node["content"] = qwen_xml_arguments_format(content["json_schema"],
                                                            f"tools: function {name!r}")
            except InvalidRequest as e:
                raise _bad(str(e), "tools") from None
            # The template closes the last parameter's line itself: "</parameter>\n</function>".
            end = node.get("end")
            if isinstance(end, str) and end.startswith("\n</function>"):
                node["end"] = end[1:]
            return
        for v in node.values():
            _exact_qwen_xml(v)
    elif isinstance(node, list):
        for v in node:
            _exact_qwen_xml(v)


def _calls_only(node: Any) -> None:
    """"required": the answer is the calls and nothing else (xgrammar's tag lets free
    text follow the first call, which an untrained or rambling model fills to max_tokens):
    its triggered tags become tags separated by a newline."""
    if isinstance(node, dict):
        if node.get("type") == "triggered_tags":
            stop = node.get("stop_after_first", False)
            tags = node["tags"]
            node.clear()
            node.update(type="tags_with_separator", tags=tags, separator="\n", at_least_one=True,
                        stop_after_first=stop)
            return
        for v in node.values():
            _calls_only(v)
    elif isinstance(node, list):
        for v in node:
            _calls_only(v)


def check_parsers(reasoning_parser: str | None, tool_parser: str | None) -> None:
    from hybridserve.errors import ConfigError

    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ConfigError(f"--reasoning-parser {reasoning_parser!r} is not one of {list(REASONING_PARSERS)}")
    if tool_parser not in (None, *TOOL_PARSERS):
        raise ConfigError(f"--tool-call-parser {tool_parser!r} is not one of {list(TOOL_PARSERS)}")
