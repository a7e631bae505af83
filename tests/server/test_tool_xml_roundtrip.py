"""Qwen3.5's XML tool calls, template -> text -> parser and grammar: string values keep
their own leading / trailing whitespace, and the tool grammar allows exactly the text the
checkpoint's chat template writes (one newline after ``<parameter=P>`` and one before
``</parameter>``), nothing looser. The oracle is the shipped template itself
(../shared/fixtures/qwen3.5-chat-template.jinja), rendered by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.server import contract
from hybridserve.server.tools import OutputParser, StreamingParser

FIXTURE = Path("/work/shared/fixtures/qwen3.5-chat-template.jinja")

EDIT = {"type": "object",
        "properties": {"path": {"type": "string"},
                       "old": {"type": "string"},
                       "new": {"type": "string"},
                       "count": {"type": "integer"},
                       "tag": {"type": "string", "maxLength": 4},
                       "mode": {"enum": [" a", "b "]},
                       "note": {"type": ["string", "null"]}},
        "required": ["path", "old", "new", "count"]}
TOOLS = [{"type": "function", "function": {"name": "edit", "description": "Replace text", "parameters": EDIT}}]

# String values whose whitespace is meaningful (code edits): a format that strips would
# change them.
ARGS = [
    {"path": "a.py", "old": "    return x\n", "new": "\n\n    return y  ", "count": 1, "tag": " \n ",
     "mode": "b ", "note": "  "},
    {"path": " spaced name ", "old": "", "new": "\t", "count": 2},
    {"path": "p", "old": "\n", "new": "x\n\n", "count": 0, "tag": "ab  "},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybridserve.model.tiny import write_tiny_checkpoint

    if not FIXTURE.exists():
        pytest.fail(f"the fixture {FIXTURE} is missing")
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("xml") / "m", preset="test-a", seed=3, qwen_chat=True)
    t = AutoTokenizer.from_pretrained(d)
    t.chat_template = FIXTURE.read_text()  # the checkpoint template, as Qwen ships it
    return t


def _rendered_calls(tok, calls: list[dict]) -> str:
    """The assistant turn's tool-call text as the template writes it."""
    msgs = [{"role": "user", "content": "edit it"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "edit", "arguments": a}}
                for i, a in enumerate(calls)]}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, enable_thinking=False)
    turn = text[text.rindex("<|im_start|>assistant\n"):]
    return turn[turn.index("<tool_call>"):turn.rindex("</tool_call>") + len("</tool_call>")]


def _parser() -> OutputParser:
    return OutputParser(reasoning=False, tool_parser="qwen3_coder", tools={"edit": EDIT})


@pytest.mark.parametrize("args", ARGS)
def test_template_render_then_parse_keeps_string_values_exactly(tok, args):
    text = _rendered_calls(tok, [args])
    assert f"<parameter=new>\n{args['new']}\n</parameter>" in text  # the template's own format
    p = _parser().parse(text)
    assert len(p.calls) == 1 and p.calls[0].name == "edit"
    assert json.loads(p.calls[0].arguments) == args


def test_parallel_calls_round_trip_and_stream_the_same(tok):
    text = _rendered_calls(tok, ARGS)
    whole = _parser().parse(text)
    assert [json.loads(c.arguments) for c in whole.calls] == ARGS
    sp = StreamingParser(_parser())
    pieces: dict[int, str] = {}
    for k in range(1, len(text) + 1):
        for d in sp.feed(text[:k], final=k == len(text)):
            for tc in d.get("tool_calls", []):
                pieces[tc["index"]] = pieces.get(tc["index"], "") + tc["function"]["arguments"]
    assert [json.loads(pieces[i]) for i in range(len(ARGS))] == ARGS


def _grammar(tool_choice):
    import xgrammar as xgr

    prep = contract.prepare({"messages": [], "tools": TOOLS, "tool_choice": tool_choice,
                             "chat_template_kwargs": {"enable_thinking": False}},
                            chat=True, reasoning_parser="qwen3", tool_parser="qwen3_coder")
    spec = contract.constraint(prep, TOOLS)
    return xgr.Grammar.from_structural_tag(json.dumps(spec.structural_tag))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "edit"}}])
def test_tool_grammar_accepts_the_template_text_and_nothing_looser(tok, tool_choice):
    from xgrammar.testing import _is_grammar_accept_string as accepts

    g = _grammar(tool_choice)
    for args in ARGS:
        text = _rendered_calls(tok, [args])
        assert accepts(g, text), text
    good = _rendered_calls(tok, [ARGS[1]])
    # Whitespace the template never writes: every such variant would parse to another
    # value (or be ambiguous), so the grammar must refuse it.
    looser = [
        good.replace("<parameter=path>\n", "<parameter=path>"),            # no newline after the tag
        good.replace("\n</parameter>\n<parameter=old>", "</parameter>\n<parameter=old>"),  # none before
        good.replace("<parameter=count>\n2\n", "<parameter=count>\n 2\n"),  # space around a JSON value
        good.replace("<parameter=count>\n2\n", "<parameter=count>\n\n2\n"),
        good.replace("<parameter=count>\n2\n</parameter>\n", "<parameter=count>\n2\n</parameter>\n\n"),
        good.replace("<function=edit>\n", "<function=edit>\n\n"),          # blank line before a parameter
    ]
    for text in looser:
        assert text != good
        assert not accepts(g, text), repr(text)
    # The length bound counts the value only, not the format's newlines.
    at_bound = _rendered_calls(tok, [{**ARGS[1], "tag": "\n12\n"}])
    assert accepts(g, at_bound)
    assert not accepts(g, _rendered_calls(tok, [{**ARGS[1], "tag": "12345"}]))


def test_a_string_or_other_typed_parameter_accepts_both_writings(tok):
    from xgrammar.testing import _is_grammar_accept_string as accepts

    g = _grammar("required")
    assert accepts(g, _rendered_calls(tok, [{**ARGS[1], "note": " free text "}]))
    assert accepts(g, _rendered_calls(tok, [{**ARGS[1], "note": "null"}]))
    assert json.loads(_parser().parse(_rendered_calls(tok, [{**ARGS[1], "note": " x "}])).calls[0].arguments
                      )["note"] == " x "
