"""Constrained decoding under tensor parallelism (gloo, two processes): rank 0 masks and
samples, the workers only run the sharded forward. Outputs must equal the single-process
engine's (greedy and seeded) and validate (``jsonschema``, ``re.fullmatch``)."""

from __future__ import annotations

import json
import re

import jsonschema

from hybridserve import LLM, SamplingParams
from hybridserve.model.tiny import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
ENGINE = dict(dtype="float32", cpu_threads=1, block_size=16, max_num_seqs=4, max_num_batched_tokens=48,
              max_model_len=512)


def _run(llm):
    prompts = ["Describe a pet as JSON:", "Another one", "x" * 40, "code:"]
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs={"json": SCHEMA}),
              SamplingParams(max_tokens=80, temperature=0.9, seed=5, structured_outputs={"json": SCHEMA}),
              SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"regex": REGEX}),
              SamplingParams(max_tokens=20, temperature=1.0, seed=9, structured_outputs={"regex": REGEX})]
    return llm.generate(prompts, params)


def test_tp2_constrained_outputs_equal_single_process_and_validate(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=11, qwen_chat=True)
    tp = LLM(str(path), tensor_parallel_size=2, num_pages=40, **ENGINE)
    outs_tp = _run(tp)
    st = tp.engine.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
    del tp
    one = LLM(str(path), num_pages=40, **ENGINE)
    outs_one = _run(one)
    assert [o.outputs[0].token_ids for o in outs_tp] == [o.outputs[0].token_ids for o in outs_one]
    for i, o in enumerate(outs_tp):
        c = o.outputs[0]
        if c.finish_reason != "stop":
            continue
        if i < 2:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, c.text), c.text
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs_tp) >= 2
