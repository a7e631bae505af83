"""The offline API in vLLM's shapes (issue 32): the prompt forms of ``LLM.generate``,
``LLM.chat`` and ``LLM.get_tokenizer``; the oracle is the checkpoint's own tokenizer
(transformers) and the same engine's greedy tokens for the plain form."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.errors import InvalidRequest

QWEN_TEMPLATE = "/work/shared/fixtures/qwen3.5-chat-template.jinja"


@pytest.fixture(scope="module")
def llm(tiny_dirs, tmp_path_factory):
    # The tiny checkpoint with the chat template real Qwen3.5 checkpoints ship (tools,
    # enable_thinking), so that chat_template_kwargs have something to change.
    d = tmp_path_factory.mktemp("dropin") / "ckpt"
    shutil.copytree(tiny_dirs["test-a"], d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    with open(QWEN_TEMPLATE, encoding="utf-8") as f:
        cfg["chat_template"] = f.read()
    cfg_path.write_text(json.dumps(cfg))
    return LLM(str(d), dtype="float32", device="cpu", num_pages=512, max_num_seqs=8, max_model_len=4096)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_four_prompt_forms_give_the_same_tokens(llm):
    text = "hello drop-in"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert ids and all(isinstance(t, int) for t in ids)
    ref = _tokens(llm.generate(ids, GREEDY))
    assert len(ref) == 1 and len(ref[0]) == 6
    for form in (text, ids, {"prompt": text}, {"prompt_token_ids": ids}, np.asarray(ids).tolist()):
        assert _tokens(llm.generate(form, GREEDY)) == ref, form
    # Lists of each form, and a mixed list, come back in order, one output per prompt.
    mixed = [text, {"prompt_token_ids": ids}, ids, {"prompt": text}]
    outs = llm.generate(mixed, GREEDY)
    assert _tokens(outs) == ref * 4
    assert [list(o.prompt_token_ids) for o in outs] == [ids] * 4
    assert _tokens(llm.generate([{"prompt_token_ids": ids}] * 2, GREEDY)) == ref * 2
    assert _tokens(llm.generate([{"prompt": text}] * 2, GREEDY)) == ref * 2


@pytest.mark.parametrize("bad", [
    {"prompt_ids": [1, 2]},
    {"prompt": "a", "prompt_token_ids": [1]},
    {"prompt_token_ids": "abc"},
    {"prompt": 5},
    3.5,
    [1.5, 2.5],
    [{"prompt_token_ids": [1, 2]}, {"text": "x"}],
    [["a"]],
    None,
])
def test_other_prompt_forms_are_refused(llm, bad):
    with pytest.raises(InvalidRequest, match="Accepted|prompt_token_ids"):
        llm.generate(bad, GREEDY)
    # Nothing of the refused call is left in the engine.
    assert not llm.engine.has_unfinished_requests()


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kwargs)
        ids = tok.encode(rendered, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids}, GREEDY)
        got = llm.chat(conv, GREEDY, chat_template_kwargs=kwargs or None)
        assert list(got[0].prompt_token_ids) == ids
        assert _tokens(got) == _tokens(want)
    # enable_thinking reaches the template: the rendered prompts differ.
    on = llm.chat(conv, GREEDY)[0].prompt_token_ids
    off = llm.chat(conv, GREEDY, chat_template_kwargs={"enable_thinking": False})[0].prompt_token_ids
    assert list(on) != list(off)
    # tools reach the template as the server's do.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = llm.chat(conv, GREEDY, tools=tools)[0]
    assert "get_weather" in tok.decode(with_tools.prompt_token_ids)
    # A batch of conversations: one output each, in order.
    conv2 = [{"role": "user", "content": "another"}]
    both = llm.chat([conv, conv2], GREEDY)
    assert [list(o.prompt_token_ids) for o in both] == [list(on), list(llm.chat(conv2, GREEDY)[0].prompt_token_ids)]


def test_chat_refuses_what_is_not_a_conversation(llm):
    for bad in ([], "hello", [{"role": "wizard", "content": "x"}]):
        with pytest.raises(InvalidRequest):
            llm.chat(bad, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_none_is_the_rest_of_the_context(llm):
    ids = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": ids}, params)
    assert len(out.outputs[0].token_ids) == llm.engine.max_model_len - len(ids)
    assert out.outputs[0].finish_reason == "length"
    assert params.max_tokens is None  # the caller's params are not rewritten


def test_output_field_names_match_vllms(llm):
    """Where vLLM has the field, the name is the same (vLLM's docs list them)."""
    import dataclasses

    vllm_sampling = {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "include_stop_str_in_output", "skip_special_tokens",
                     "logit_bias"}
    assert vllm_sampling <= {f.name for f in dataclasses.fields(SamplingParams)}
    (out,) = llm.generate("abc", GREEDY)
    for name in ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"):
        assert hasattr(out, name), name
    for name in ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"):
        assert hasattr(out.outputs[0], name), name


def test_max_tokens_none_with_a_full_context_prompt_is_refused_plainly(llm):
    ids = [7] * llm.engine.max_model_len
    with pytest.raises(InvalidRequest, match="leaves no room for output"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=None))
    assert not llm.engine.has_unfinished_requests()


def test_chat_renders_tool_call_history_as_the_server_does(llm):
    """An assistant tool call with OpenAI's JSON-string arguments and its result: the
    server hands the template the arguments as a mapping (what Qwen's template reads),
    and LLM.chat renders through the same code."""
    tok = llm.get_tokenizer()
    conv = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    as_template_wants = [conv[0], {**conv[1], "content": "", "tool_calls": [
        {**conv[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, conv[2]]
    rendered = tok.apply_chat_template(as_template_wants, add_generation_prompt=True, tokenize=False)
    assert "<parameter=city>" in rendered and "sunny" in rendered
    (out,) = llm.chat(conv, GREEDY)
    assert list(out.prompt_token_ids) == tok.encode(rendered, add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        llm.chat([conv[0], {**conv[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], GREEDY)
