"""The OpenAI contract Qwen3.5 applications run on, against a live server on a tiny
random-weight model that has Qwen's markers and Qwen3.5's real chat template: tools,
tool_choice, structured outputs, thinking; the official ``openai`` client as it is.
Outputs are checked by independent oracles (``jsonschema``, ``re.fullmatch``, pydantic,
transformers' own ``apply_chat_template``)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.server import contract

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_END = 260  # the tiny tokenizer's "</think>" (see model.tiny.QWEN_MARKER_TOKENS)


class Pet(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("contract") / "m", preset="test-a", seed=11,
                                 qwen_chat=True)


@pytest.fixture(scope="module")
def srv(qwen_dir, live_server_cls):
    s = live_server_cls(qwen_dir, max_num_batched_tokens=2048, num_pages=512)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_always_gives_valid_calls(client, seed):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       max_tokens=400, temperature=1.0, seed=seed, extra_body=NO_THINK)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    _check_calls(ch.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=400, temperature=0.8, seed=4, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, extra_body=NO_THINK)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls"
        assert [c.function.name for c in ch.message.tool_calls] == ["get_time"]
        _check_calls(ch.message.tool_calls)


def test_auto_tool_choice_answers_or_calls_validly(client):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=60,
                                       temperature=1.0, seed=3, extra_body=NO_THINK)
    ch = r.choices[0]
    if ch.message.tool_calls:
        _check_calls(ch.message.tool_calls)
    else:
        assert ch.message.content is not None and "<think>" not in ch.message.content


def test_streamed_tool_calls_add_up_to_the_non_streamed_ones(client):
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=400,
              temperature=0.0, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_parse_returns_a_pydantic_object(client):
    for extra in (NO_THINK, {"logit_bias": {str(THINK_END): 8}}):
        r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a pet"}],
                                          response_format=Pet, max_tokens=200, temperature=1.0, seed=5,
                                          extra_body=extra)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        assert isinstance(ch.message.parsed, Pet)
        assert ch.message.parsed.kind in ("cat", "dog")


def test_thinking_split_streamed_and_not(srv):
    # Seeded, so the streamed and whole answers are the same text; a bias on </think>
    # ends the reasoning after a few tokens.
    body = {"model": "tiny", "messages": USER, "max_tokens": 80, "temperature": 1.0, "seed": 3,
            "logit_bias": {str(THINK_END): 3}}
    whole = srv.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    # The reasoning ends at the first </think> (an unconstrained noise model may write more later).
    assert whole["reasoning_content"] and whole["content"] and "</think>" not in whole["reasoning_content"]
    raw = srv.post("/v1/chat/completions", {**body, "stream": True}).text
    r = c = ""
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                r += ch["delta"].get("reasoning_content") or ""
                c += ch["delta"].get("content") or ""
    assert r == (whole["reasoning_content"] or "") and c == (whole["content"] or "")
    off = srv.post("/v1/chat/completions", {**body, **NO_THINK}).json()["choices"][0]["message"]
    assert off["reasoning_content"] is None
    # include_reasoning: false drops the reasoning; the answer is the same.
    dropped = srv.post("/v1/chat/completions", {**body, "include_reasoning": False}).json()["choices"][0]["message"]
    assert dropped["reasoning_content"] is None and dropped["content"] == whole["content"]


def test_structured_outputs_on_both_endpoints(srv):
    rx = r"[a-d]{3}-[0-9]{2}"
    for path, extra in (("/v1/completions", {"prompt": "id:"}), ("/v1/chat/completions", {"messages": USER, **NO_THINK})):
        for so, check in (({"regex": rx}, lambda t: re.fullmatch(rx, t)),
                          ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                          ({"json": WEATHER}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None)):
            r = srv.post(path, {"model": "tiny", "max_tokens": 120, "temperature": 1.0, "seed": 2, "n": 2,
                                "structured_outputs": so, **extra})
            assert r.status_code == 200, r.text
            for ch in r.json()["choices"]:
                text = ch["text"] if "text" in ch else ch["message"]["content"]
                assert ch["finish_reason"] == "stop" and check(text), (so, text)
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 60, **NO_THINK,
                                          "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_a_cut_off_call_is_content_with_length(srv):
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "tools": TOOLS,
                                          "tool_choice": "required", "max_tokens": 15, **NO_THINK})
    ch = r.json()["choices"][0]
    assert r.status_code == 200 and ch["finish_reason"] == "length"
    assert ch["message"]["content"].startswith("<tool_call>") and "tool_calls" not in ch["message"]


def test_history_with_tool_calls_renders_as_transformers_does(qwen_dir, client):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = {"messages": history, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    prep = contract.prepare(body, chat=True, reasoning_parser="qwen3", tool_parser="qwen3_coder")
    from hybridserve.server.protocol import chat_messages

    ours = contract.render_chat(tok, chat_messages(body), True, prep)
    oracle_msgs = [dict(m) for m in history]
    oracle_msgs[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    want = tok.apply_chat_template(oracle_msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    assert tok.decode(ours) == want
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in want
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "not a valid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]}, "uniqueItems"),
    ({"tool_choice": "required"}, "tools"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"chat_template_kwargs": "no"}, "chat_template_kwargs"),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(srv, body, needle):
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    ok = srv.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4})
    assert ok.status_code == 200


def test_beam_search_with_a_constraint_is_refused(srv):
    r = srv.post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 4, "n": 2, "temperature": 0,
                                     "use_beam_search": True, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 400 and "beam" in r.json()["error"]["message"]


def test_metrics_count_constrained_requests_compiles_and_masks(srv):
    body = {"model": "tiny", "messages": USER, "max_tokens": 30, **NO_THINK,
            "structured_outputs": {"regex": "[pq]{5,9}"}}
    before = srv.metric_values()
    for _ in range(2):
        assert srv.post("/v1/chat/completions", body).status_code == 200
    after = srv.metric_values()
    key = 'hybridserve:structured_requests_total{kind="regex"}'
    assert after[key] - before.get(key, 0.0) >= 2
    assert after["hybridserve:structured_grammar_cache_hits_total"] > before.get(
        "hybridserve:structured_grammar_cache_hits_total", 0.0)
    assert after["hybridserve:structured_mask_sequence_steps_total"] > before.get(
        "hybridserve:structured_mask_sequence_steps_total", 0.0)
    assert after["hybridserve:structured_grammar_compile_seconds_total"] > 0


def test_parser_flags_turn_parsing_off_and_bad_names_are_refused(qwen_dir, live_server_cls):
    from hybridserve.errors import ConfigError
    from hybridserve.server.app import ServerSettings
    from hybridserve.cli import build_parser
    from hybridserve.server.serve import server_settings

    args = build_parser().parse_args(["serve", str(qwen_dir), "--reasoning-parser", "none",
                                      "--tool-call-parser", "hermes"])
    st = server_settings(args, environ={})
    assert (st.reasoning_parser, st.tool_call_parser) == (None, "hermes")
    s = live_server_cls(qwen_dir, settings=ServerSettings(reasoning_parser=None, tool_call_parser=None))
    try:
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 30,
                                            "temperature": 0.0, "logit_bias": {str(THINK_END): 5}})
        msg = r.json()["choices"][0]["message"]
        assert "reasoning_content" not in msg and "tool_calls" not in msg  # the raw text, as it came
    finally:
        s.stop()
    # build_app checks the names it is given (serve fails at start, naming the flag).
    with pytest.raises(ConfigError, match="tool-call-parser"):
        contract.check_parsers(None, "nosuch")
    with pytest.raises(ConfigError, match="reasoning-parser"):
        contract.check_parsers("deepseek", None)
