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
    check_stream_adds_up(text, reasoning)


def stream(text, reasoning, fmt="qwen3_coder", step=1):
    sp = StreamingParser(parser(reasoning=reasoning, fmt=fmt))
    deltas = []
    for i in range(step, len(text) + step, step):
        deltas += sp.feed(text[:i], final=False)
    deltas += sp.feed(text, final=True)
    return sp, deltas


def check_stream_adds_up(text, reasoning, fmt="qwen3_coder", step=1):
    whole = parser(reasoning=reasoning, fmt=fmt).parse(text)
    sp, deltas = stream(text, reasoning, fmt, step)
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
    return sp, whole


def hermes_call(name: str, **params) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": params}) + "\n</tool_call>"


def long_output(fmt: str, n: int) -> str:
    """About n characters: reasoning with a call inside, then answers, whitespace runs,
    near-markers, a malformed block, and calls of the given format."""
    call = xml_call if fmt == "qwen3_coder" else hermes_call
    parts = ["Thinking about <tool_ and </thi but not yet. ", call("get_time", tz="R"), " more thought\n"]
    k = 0
    while sum(map(len, parts)) < n // 3:
        parts.append(f"reasoning step {k}: weigh < and > and </ carefully.   \n\n")
        k += 1
    parts.append("</think>\n\n")
    while sum(map(len, parts)) < n:
        parts.append(f"Answer part {k} with a <tool_call> that is broken <tool_call>nope</tool_call>\n" if k % 7 == 0
                     else f"Answer part {k}, <b>bold</b>.\n   \n")
        parts.append(call("get_weather", city=f"City {k}", days=str(k)))
        k += 1
    return "".join(parts)


@pytest.mark.parametrize("fmt", ["qwen3_coder", "hermes"])
def test_long_stream_is_exact_and_linear(fmt):
    text = long_output(fmt, 20_000)
    assert len(text) >= 20_000
    sp, whole = check_stream_adds_up(text, True, fmt)
    assert len(whole.calls) > 50 and whole.reasoning and whole.content
    # Linear: the work per character is bounded (re-parsing the whole text on every
    # character would scan about n^2/2 = 2e8 characters here) ...
    assert sp.scanned <= 40 * len(text), sp.scanned
    # ... and doubling the output about doubles it.
    half = stream(long_output(fmt, 10_000), True, fmt)[0].scanned
    assert sp.scanned <= 2.5 * half, (sp.scanned, half)


@pytest.mark.parametrize("step", [1, 3, 17])
@pytest.mark.parametrize("reasoning", [False, True])
def test_stream_edge_cases_add_up(step, reasoning):
    for text in ["   <think>  a </think>  b  ", "<thi", "  <think", "<tool_call>\n<function=get_time>\n",
                 "x </think> y <tool_call>" + hermes_call("get_time", tz="U")[11:], "a   \n  ",
                 "r <tool_call>abc</think> c " + xml_call("get_time", tz="Q"), "<tool_call></tool_call>"]:
        check_stream_adds_up(text, reasoning, "qwen3_coder", step)
        check_stream_adds_up(text, reasoning, "hermes", step)


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


class _Delta(str):
    """A streamed delta that fails when appended to a long accumulated text: copying
    the whole text so far for every delta is O(n^2) characters over a stream."""

    def __radd__(self, other):
        assert len(other) <= 1024, f"the whole streamed text ({len(other)} characters) is copied for a delta"
        return str.__add__(other, self)


@pytest.mark.parametrize("step", [1, 4])
def test_contract_streaming_copies_linearly(step):
    from hybridserve.server.contract import Contract

    # Long reasoning and answers, and one call whose argument is 20K characters (a file's
    # text): the call stays open for thousands of deltas.
    text = long_output("qwen3_coder", 30_000) + "\n" + xml_call("get_time", tz="x\n" * 10_000)
    c = Contract(reasoning=True, reasoning_parser="qwen3", tool_parser="qwen3_coder", tools=TOOLS)
    deltas = []
    for i in range(0, len(text), step):
        done = i + step >= len(text)
        deltas += [ch["delta"] for ch in c.stream_choices(0, _Delta(text[i:i + step]), "stop" if done else None,
                                                          None)]
    sp = c.streams[0]
    # Each received character is copied into the parser's buffer a bounded number of
    # times (a marker's worth of lookback held per delta; an open call's text once).
    assert sp.copied <= 3 * len(text) + 16 * (len(text) // step), (sp.copied, len(text))
    whole = parser(reasoning=True).parse(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    args_by_index: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            args_by_index[tc["index"]] = args_by_index.get(tc["index"], "") + tc["function"]["arguments"]
    assert [args_by_index[i] for i in sorted(args_by_index)] == [x.arguments for x in whole.calls]
    assert json.loads(whole.calls[-1].arguments) == {"tz": "x\n" * 10_000}
