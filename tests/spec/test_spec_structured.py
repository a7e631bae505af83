"""Speculation under grammar constraints: drafts are cut where the grammar stops
allowing them and every verify row is masked after the tokens drawn before it, so the
outputs are those of constrained decoding without drafts (greedy and seeded) and they
parse and validate (``jsonschema``, ``re.fullmatch``: independent oracles)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hybridserve import LLM, SamplingParams, default_model
from hybridserve.model.tiny import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["module", "class", "function"]},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}
REGEX = r"def [a-z_]{1,12}\(self(, [a-z]{1,6}){0,2}\):"
PROMPTS = ["Describe this module as JSON:\n", "import os\n\n# the function as JSON\n", "class A:\n    pass\n"]


@pytest.fixture(scope="module", params=["trained", "random"])
def model_dir(request, tmp_path_factory):
    if request.param == "trained":
        return default_model.path()
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec-structured") / "m", preset="test-a", seed=11,
                                 qwen_chat=True)


def _gen(model_dir, params, k):
    kw = dict(dtype="float32", num_pages=300, max_num_seqs=6, max_model_len=512)
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0}
    llm = LLM(model_dir, **kw)
    return llm, llm.generate(PROMPTS, params)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_constrained_outputs_identical_on_and_off_and_valid(model_dir, kind):
    extra = dict(temperature=0.0) if kind == "greedy" else dict(temperature=0.9, seed=3)
    params = [SamplingParams(max_tokens=120, structured_outputs={"json": SCHEMA}, **extra),
              SamplingParams(max_tokens=60, structured_outputs={"regex": REGEX}, **extra),
              SamplingParams(max_tokens=120, structured_outputs={"json": SCHEMA}, **extra)]
    _, off = _gen(model_dir, params, None)
    llm, on = _gen(model_dir, params, 3)
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]
    for o, p in zip(on, params):
        c = o.outputs[0]
        if c.finish_reason != "stop":
            continue  # cut by max_tokens: a prefix of a valid document
        if p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, c.text), c.text
    st = llm.engine.stats()
    assert st["spec_draft_tokens"] > 0
    if model_dir == default_model.path():
        # The trained drafter's guesses inside the grammar are often right.
        assert st["spec_accepted_tokens"] > 0
