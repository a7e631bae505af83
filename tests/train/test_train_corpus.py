"""The default model's corpus and tokenizer (hybridserve.train.corpus / .tokenizer)."""

from __future__ import annotations

import hashlib
import os

import jinja2
import pytest

from hybridserve.train import corpus
from hybridserve.train import tokenizer as tk

# Qwen3.5's released template; a checkout without the shared fixtures uses the package's
# copy of it (then this checks HF's rendering of the saved tokenizer against jinja2's).
FIXTURE_TEMPLATE = "/work/shared/fixtures/qwen3.5-chat-template.jinja"
if not os.path.exists(FIXTURE_TEMPLATE):
    FIXTURE_TEMPLATE = tk.CHAT_TEMPLATE_PATH


def test_file_list_is_sorted_deterministic_and_without_test_suites():
    a, b = corpus.source_files(), corpus.source_files()
    assert a == b == sorted(a)
    assert "json/decoder.py" in a and "asyncio/events.py" in a
    for rel in a:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), rel
        assert not parts[-1].startswith("test_"), rel
    # The real stdlib has its suites where the rule must find them.
    root = corpus.stdlib_root()
    assert os.path.isdir(os.path.join(root, "test")) or os.path.isdir(os.path.join(root, "unittest"))


def test_file_list_rule_on_a_made_up_tree(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/tests/c.py", "test/d.py", "idlelib/idle_test/e.py",
                "lib2to3/tests/f.py", "site-packages/g.py", "pkg/test_h.py", "notes.txt", "z/y.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x = 1\n")
    assert corpus.source_files(str(tmp_path)) == ["a.py", "pkg/b.py", "z/y.py"]


def test_heldout_split_is_disjoint_fixed_and_about_five_percent():
    docs = corpus.documents()
    train, held = corpus.split(docs)
    t_names, h_names = {d.relpath for d in train}, {d.relpath for d in held}
    assert not t_names & h_names
    assert t_names | h_names == {d.relpath for d in docs}
    assert 0.02 < len(held) / len(docs) < 0.09
    # The rule is a hash of the path alone (independently recomputed here).
    for d in docs:
        h = int.from_bytes(hashlib.sha256(d.relpath.encode()).digest()[:8], "big")
        assert (d.relpath in h_names) == (h % 10_000 < 500)
    # Prose from pydoc_data/topics.py is in, one document per topic.
    topics = [d for d in docs if d.relpath.startswith(corpus.TOPICS_RELPATH + "#")]
    assert len(topics) > 50 and any("for" in d.relpath for d in topics)


@pytest.fixture(scope="module")
def small_tokenizer():
    docs = corpus.documents()[:40]
    return tk.train_tokenizer((d.text for d in docs), 600)


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # ok\r\n",
    "naïve café — 東京 🐍 \x00\x7f",
    "    if a <think> b: </think>\n\n\n",
    "",
])
def test_tokenizer_round_trips_bytes(small_tokenizer, text):
    ids = small_tokenizer.encode(text).ids
    assert small_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(small_tokenizer):
    ids = {s: small_tokenizer.token_to_id(s) for s in tk.SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(tk.SPECIAL_TOKENS)
    assert small_tokenizer.get_vocab_size() == 600
    for s, i in ids.items():
        assert small_tokenizer.encode(f"x{s}y").ids.count(i) == 1
        assert small_tokenizer.encode(s).ids == [i]


MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "", "reasoning_content": "Add them.",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "4", "reasoning_content": "The tool said 4."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_renders_tools_and_thinking_as_the_fixture(tmp_path, small_tokenizer, thinking):
    from transformers import AutoTokenizer

    tk.save_tokenizer(small_tokenizer, str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = hf.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=thinking)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        __import__("json").dumps(v, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                 sort_keys=sort_keys)

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    with open(FIXTURE_TEMPLATE, encoding="utf-8") as f:
        fixture = env.from_string(f.read())
    want = fixture.render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True,
                          enable_thinking=thinking, raise_exception=raise_exception,
                          bos_token=None, eos_token="<|im_end|>")
    assert ours == want
    assert "<tool_call>" in ours and "<tools>" in ours and "<tool_response>" in ours
    assert ours.endswith("<|im_start|>assistant\n" + ("<think>\n" if thinking else "<think>\n\n</think>\n\n"))
    ids = hf(ours, add_special_tokens=False)["input_ids"]
    assert ids.count(small_tokenizer.token_to_id("<tool_call>")) == ours.count("<tool_call>")
    assert hf.decode(ids) == ours
