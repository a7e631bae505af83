"""The reasoning and tool-call parsers on fixed texts: both formats, parallel calls,
malformed and partial calls, text before a call, reasoning; and streaming, fed one
character at a time, adds up exactly to the whole message."""

from __future__ import annotations

import json

import pytest

from hybridserve.server.tools import OutputParser, StreamingParser, convert_value, default_parsers

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                             "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                             "tags": {"type": "array", "items": {"type": "string"}},
                                             "note": {"type": ["string", "null"]}}}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}}}


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parser(reasoning=False, fmt="qwen3_coder", tools=TOOLS):
    return OutputParser(reasoning=reasoning, tool_parser=fmt, tools=tools)


def args(call):
    return json.loads(call.arguments)


def test_qwen_xml_call_with_typed_values_and_text_before():
    text = "Let me check.\n" + xml_call("get_weather", city="Paris", days="3", metric="true", ratio="0.5",
                                        tags='["a", "b"]', note="null")
    p = parser().parse(text)
    assert p.content == "Let me check."
    assert [c.name for c in p.calls] == ["get_weather"]
    assert args(p.calls[0]) == {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                                "note": None}


def test_string_parameters_stay_strings():
    p = parser().parse(xml_call("get_weather", city="123", note="multi\nline  text"))
    assert args(p.calls[0]) == {"city": "123", "note": "multi\nline  text"}


def test_parallel_calls_and_no_content():
    text = xml_call("get_weather", city="Oslo") + "\n" + xml_call("get_time", tz="UTC")
    p = parser().parse(text)
    assert [c.name for c in p.calls] == ["get_weather", "get_time"]
    assert p.content is None
    assert len({c.id for c in p.calls}) == 2


def test_hermes_json_calls():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')
    p = parser(fmt="hermes").parse(text)
    assert [(c.name, args(c)) for c in p.calls] == [("get_weather", {"city": "Rome", "days": 2}),
                                                    ("get_time", {"tz": "CET"})]
    assert p.content is None


def test_malformed_and_partial_calls_stay_text():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    p = parser().parse("before " + bad)
    assert p.calls == [] and p.content == "before " + bad
    cut = "ok " + xml_call("get_weather", city="Paris")[:30]  # cut off by max_tokens
    p = parser().parse(cut)
    assert p.calls == [] and p.content == cut


def test_reasoning_split_and_a_call_inside_think_is_not_lost():
    text = "I should call.\n" + xml_call("get_time", tz="UTC") + "\n</think>\n\nDone."
    p = parser(reasoning=True).parse(text)
    assert p.reasoning == "I should call."
    assert p.content == "Done."
    assert [c.name for c in p.calls] == ["get_time"]
    # No </think> at all (cut off): everything is reasoning.
    p = parser(reasoning=True).parse("still thinking")
    assert (p.reasoning, p.content, p.calls) == ("still thinking", None, [])
    # An output that opens <think> itself is split too.
    p = OutputParser(reasoning=False, tool_parser=None, tools=None).parse("<think>hm</think>\n\nyes")
    assert (p.reasoning, p.content) == ("hm", "yes")


def test_no_tool_parsing_without_tools():
    text = xml_call("get_time", tz="UTC")
    p = OutputParser(reasoning=False, tool_parser="qwen3_coder", tools=None).parse(text)
    assert p.calls == [] and p.content == text


@pytest.mark.parametrize("text,reasoning", [
    ("thinking a bit</think>\n\nHello " + xml_call("get_weather", city="Paris", days="2") + "\n" +
     xml_call("get_time", tz="UTC"), True),
    ("Plain answer with a < sign and <tool_ and more", False),
    ("  lead " + xml_call("get_weather", city="X") + " trail  ", False),
    ("r " + xml_call("get_time", tz="A") + "</think>" + xml_call("get_time", tz="B")[:20], True),
])
def test_streaming_adds_up_to_the_whole_message(text, reasoning):
    whole = parser(reasoning=reasoning).parse(text)
    sp = StreamingParser(parser(reasoning=reasoning))
    deltas = []
    for i in range(1, len(text) + 1):
        deltas += sp.feed(text[:i], final=False)
    deltas += sp.feed(text, final=True)
    r = "".join(d.get("reasoning_content", "") for d in deltas)
    c = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            slot["name"] += tc.get("function", {}).get("name", "")
            slot["arguments"] += tc.get("function", {}).get("arguments", "")
    assert r == (whole.reasoning or "")
    assert c == (whole.content or "")
    assert [calls[i] for i in sorted(calls)] == [{"name": x.name, "arguments": x.arguments} for x in whole.calls]


def test_convert_value_falls_back_to_text():
    assert convert_value("abc", {"type": "integer"}) == "abc"
    assert convert_value("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 7
    assert convert_value("x", {"enum": ["x", "y"]}) == "x"
    assert convert_value('{"a": 1}', None) == {"a": 1}


def test_default_parsers_from_templates():
    from hybridserve.model.tiny import qwen_chat_template

    assert default_parsers(qwen_chat_template()) == ("qwen3", "qwen3_coder")
    assert default_parsers("{{ messages }}") == (None, None)
    assert default_parsers("<tool_call>{{ tool | tojson }}</tool_call>") == (None, "hermes")
