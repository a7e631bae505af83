"""kv_cache_dtype unlike the model's dtype (issue 30): the CPU decode step no longer
crashes on it (the native kernels take only the model's dtype; such a cache runs the
module path, which casts). The oracle is the module path (checked against HF in the
model tests), run with the native step turned off."""

from __future__ import annotations

import pytest

from hybridserve import LLM, SamplingParams


@pytest.mark.parametrize("dtype,kv", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_kv_cache_dtype_unlike_the_model_decodes(tiny_dirs, dtype, kv):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9, 8]]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_dirs["test-a"]), dtype=dtype, kv_cache_dtype=kv, device="cpu", num_pages=64)
    outs = llm.generate(prompts, sp)
    st = llm.engine.stats()
    assert st["failed_steps"] == 0  # no step raised (a retry would hide it otherwise)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 10 for o in outs)
    ref_llm = LLM(str(tiny_dirs["test-a"]), dtype=dtype, kv_cache_dtype=kv, device="cpu", num_pages=64)
    ref_llm.engine.model.native_decode = False
    ref = ref_llm.generate(prompts, sp)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in ref]
