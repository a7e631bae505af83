"""The HTTP server's defaults as vLLM's (issue 32): a chat's ``max_tokens`` is the rest
of the context; ``/tokenize`` adds special tokens to a prompt by default (not to
messages), as a completion's prompt is tokenized. Oracles: the checkpoint's own
transformers tokenizer and the engine's max_model_len."""

from __future__ import annotations

import json
import shutil

import pytest

from hybridserve.model.tiny import ENDOFTEXT_ID
from hybridserve.tokenizer import load_tokenizer

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def short_live(tiny_dir, live_server_cls):
    server = live_server_cls(tiny_dir, max_model_len=MAX_MODEL_LEN)
    yield server
    server.stop()


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(short_live):
    msgs = [{"role": "user", "content": "tell me everything"}]
    r = short_live.post("/v1/chat/completions", {"model": "tiny", "messages": msgs, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # An explicit max_tokens still wins; a completion's default stays vLLM's 16.
    r = short_live.post("/v1/chat/completions", {"model": "tiny", "messages": msgs, "ignore_eos": True,
                                                 "max_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5
    r = short_live.post("/v1/completions", {"model": "tiny", "prompt": "abc", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
    short_live.wait_idle_and_whole()


@pytest.fixture(scope="module")
def bos_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with a tokenizer whose post-processor adds a BOS token, as
    many non-Qwen tokenizers do: there add_special_tokens changes the ids."""
    from tokenizers import Tokenizer, processors

    d = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_dir, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", ENDOFTEXT_ID)])
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def bos_live(bos_dir, live_server_cls):
    server = live_server_cls(bos_dir)
    yield server
    server.stop()


def test_tokenize_add_special_tokens_defaults_as_vllm(bos_live, bos_dir):
    hf = load_tokenizer(bos_dir)
    with_special = hf.encode("hello")  # transformers' default: add_special_tokens=True
    without = hf.encode("hello", add_special_tokens=False)
    assert with_special == [ENDOFTEXT_ID] + without  # the fixture does what it says

    r = bos_live.post("/tokenize", {"prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == with_special
    r = bos_live.post("/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert r.json()["tokens"] == without
    # Messages: the template writes the special tokens; none are added by default.
    msgs = [{"role": "user", "content": "hi"}]
    r = bos_live.post("/tokenize", {"messages": msgs})
    rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == hf.encode(rendered, add_special_tokens=False)
    # /tokenize's count is what a completion's prompt costs.
    count = bos_live.post("/tokenize", {"prompt": "hello"}).json()["count"]
    r = bos_live.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == count
    bos_live.wait_idle_and_whole()
