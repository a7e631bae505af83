"""Constrained decoding in the engine, on random-weight models (noise is the hardest
case for a grammar): every output must parse and validate against its constraint,
checked by independent oracles (``jsonschema``, ``re.fullmatch``, set membership), in
every sampling mode and through preemption, prefix-cache hits and chunked prefill."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from hybridserve import LLM, InvalidRequest, SamplingParams
from hybridserve.model.tiny import write_tiny_checkpoint

# Bounded: enums, strings with maxLength, arrays with maxItems, nested objects, integer
# ranges, anyOf, required and optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id"], "additionalProperties": False},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]
PROMPTS = ["Describe a pet as JSON:", "Another one please", "x" * 45]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "m", preset="test-a", seed=11,
                                 qwen_chat=True)


@pytest.fixture(scope="module")
def llm(qwen_dir):
    return LLM(qwen_dir, dtype="float32", device="cpu", num_pages=96, max_num_seqs=6,
               max_num_batched_tokens=256, max_model_len=512)


def _check_json(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


def _texts(outs):
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("mode", ["greedy", "seeded", "n2", "unseeded"])
def test_json_schema_outputs_always_validate(llm, mode):
    sp = dict(max_tokens=160, structured_outputs={"json": SCHEMA})
    sp.update({"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=7),
               "n2": dict(temperature=1.2, seed=3, n=2), "unseeded": dict(temperature=0.9, top_p=0.95)}[mode])
    outs = llm.generate(PROMPTS, SamplingParams(**sp))
    comps = _texts(outs)
    assert len(comps) == len(PROMPTS) * sp.get("n", 1)
    for c in comps:
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        _check_json(c.text)
    if mode == "n2":  # the samples forked: each followed its own grammar state
        assert any(o.outputs[0].text != o.outputs[1].text for o in outs)


def test_unconstrained_noise_does_not_validate(llm):
    # The oracle can fail: without the mask the random model's text is not such JSON.
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, seed=7))
    for c in _texts(outs):
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            _check_json(c.text)


def test_seeded_constrained_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=42, structured_outputs={"json": SCHEMA})
    a = [c.text for c in _texts(llm.generate(PROMPTS[:2], sp))]
    b = [c.text for c in _texts(llm.generate(PROMPTS[:2], sp))]
    assert a == b


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice(llm, temperature):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=temperature, seed=5, n=2,
                                                structured_outputs={"regex": REGEX}))
    for c in _texts(outs):
        assert re.fullmatch(REGEX, c.text), c.text
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=temperature, seed=5, n=2,
                                                structured_outputs={"choice": CHOICES}))
    for c in _texts(outs):
        assert c.text in CHOICES, c.text


def test_grammar_and_json_object(llm):
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for c in _texts(llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                                                         structured_outputs={"grammar": ebnf}))):
        assert c.finish_reason == "length" or re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", c.text), c.text
    small = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"],
             "additionalProperties": False}
    for c in _texts(llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0,
                                                         structured_outputs={"json": json.dumps(small)}))):
        assert isinstance(json.loads(c.text)["k"], bool)


def test_small_budget_ends_with_length_and_a_valid_prefix(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, structured_outputs={"json": SCHEMA}))
    for c in _texts(outs):
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        assert c.text.lstrip().startswith("{")


def test_reasoning_prefix_is_free_and_the_answer_is_constrained(llm):
    # The output opens inside <think>: free text up to </think>, then the schema.
    tok = llm.get_tokenizer()
    think_end = tok.convert_tokens_to_ids("</think>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "json please"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    # A strong bias towards </think> after a few tokens keeps the test short.
    sp = SamplingParams(max_tokens=200, temperature=1.0, seed=9, logit_bias={think_end: 8.0},
                        structured_outputs={"json": SCHEMA, "reasoning": True})
    for c in _texts(llm.generate([prompt] * 3, sp)):
        assert "</think>" in c.text, c.text
        reasoning, answer = c.text.split("</think>", 1)
        assert "<think>" not in reasoning
        assert answer.startswith("\n\n")
        _check_json(answer.strip())


def test_preemption_prefix_hits_and_chunked_prefill_keep_outputs_valid(qwen_dir, llm):
    sp = SamplingParams(max_tokens=160, temperature=0.0, structured_outputs={"json": SCHEMA})
    prompts = ["p" * 20 + str(i) for i in range(4)]
    want = [c.text for c in _texts(llm.generate(prompts, sp))]
    # Few pages: the four sequences preempt each other (recompute) and must keep
    # their grammar state; a tiny token budget chunks every prefill.
    small = LLM(qwen_dir, dtype="float32", device="cpu", num_pages=22, max_num_seqs=4,
                max_num_batched_tokens=7, max_model_len=256, enable_prefix_caching=True)
    got = [c.text for c in _texts(small.generate(prompts, sp))]
    st = small.engine.stats()
    assert st["preemptions"] > 0, st
    assert got == want
    for t in got:
        _check_json(t)
    # The same prompts again hit the prefix cache.
    again = [c.text for c in _texts(small.generate(prompts, sp))]
    assert again == want
    st = small.engine.stats()
    assert st["prefix_hit_tokens"] > 0, st
    assert st["running_state_pages"] == 0 and st["structured"]["active_requests"] == 0


def test_bad_constraints_are_refused_and_the_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequest, match="regex"):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(InvalidRequest, match="json"):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "nosuchtype"}}))
    # Keywords the grammar would silently ignore are refused, named with their place.
    with pytest.raises(InvalidRequest, match=r"cannot enforce: 'uniqueItems' at \$\.properties\.tags"):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs={"json": {
            "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}))
    with pytest.raises(InvalidRequest, match="'not' at"):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs={"json": {"not": {"type": "null"}}}))
    with pytest.raises(InvalidRequest, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        llm.generate(["a"], SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs={"regex": "a"}))
    assert not llm.engine.requests and llm.engine.structured.stats()["active_requests"] == 0
    out = llm.generate(["a"], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs={"choice": CHOICES}))
    assert out[0].outputs[0].text in CHOICES


def test_compiled_grammars_are_cached(llm):
    st0 = llm.engine.structured.stats()
    llm.generate(["a", "b"], SamplingParams(max_tokens=8, structured_outputs={"regex": "[xyz]{3}"}))
    st1 = llm.engine.structured.stats()
    assert st1["compiles"] - st0["compiles"] == 1 and st1["cache_hits"] - st0["cache_hits"] == 1


def test_a_slow_compile_is_refused_within_the_time_bound(llm):
    # A schema that takes far longer than the bound to compile (a huge enum) is an
    # InvalidRequest naming the bound, at once; the compiler keeps serving others.
    comp = llm.engine.structured_decoding().compiler
    saved = comp.timeout_s
    comp.timeout_s = 0.005
    try:
        huge = {"enum": [f"value-{i}-" + "x" * (i % 37) for i in range(20000)]}
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest, match="did not compile within"):
            llm.generate(["a"], SamplingParams(max_tokens=4, structured_outputs={"json": huge}))
        assert time.perf_counter() - t0 < 5
    finally:
        comp.timeout_s = saved
    assert comp.stats()["compile_timeouts"] >= 1
    out = llm.generate(["a"], SamplingParams(max_tokens=10, temperature=0.0, structured_outputs={"choice": CHOICES}))
    assert out[0].outputs[0].text in CHOICES
    assert not llm.engine.requests


@pytest.mark.parametrize("vocab,width", [(272, 272), (1000, 1003), (70, 96)])
def test_native_mask_matches_plain_torch(vocab, width):
    # The engine's mask (native kernel on the CPU) against bits unpacked in plain torch.
    import torch

    from hybridserve.structured.engine_hook import apply_bitmask

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bm = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
    bm[1] = 0
    bm[2] = -1
    bm[3, ::2] = 0
    logits = torch.randn(5, width, generator=g)
    rows = [0, 1, 3, 4]
    got = logits.clone()
    apply_bitmask(got, bm, rows, vocab)
    bits = ((bm.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1).bool().reshape(5, -1)[:, :vocab]
    want = logits.clone()
    for r in rows:
        want[r, :vocab] = torch.where(bits[r], logits[r, :vocab], torch.tensor(float("-inf")))
    assert torch.equal(got, want)
