"""A CPU engine samples with the native kernel (``Sampler(native=True,
steady_rows=True)``): requests arriving and finishing at different steps (the batch
changes, then stays steady for a while) draw exactly the tokens the torch sampler
draws for the same seeds, and the steady steps reuse the sampler's plan."""

from __future__ import annotations

import random

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampler import Sampler
from hybridserve.sampling import SamplingParams


def _engine(tiny_dirs):
    return LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), dtype="float32", device="cpu",
                                num_gpu_blocks=256, num_state_slots=24, max_num_seqs=12,
                                max_num_batched_tokens=128, max_model_len=512))


def _run(engine, plans):
    rng = random.Random(0)
    kinds = [dict(temperature=0.8, top_p=0.9, top_k=20, presence_penalty=0.3, frequency_penalty=0.2,
                  repetition_penalty=1.1), dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=1.1, min_p=0.05, logit_bias={7: 3.0}), dict(temperature=0.7, top_p=0.5)]
    arrivals = {step: [] for step in range(40)}
    for i in range(14):
        arrivals[rng.choice([0, 0, 0, 3, 9, 15])].append(
            (f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(4, 30))],
             SamplingParams(seed=100 + i, max_tokens=rng.randint(3, 25), ignore_eos=True, **kinds[i % 4])))
    tokens = {}
    step = 0
    while step < 40 or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, ()):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return tokens


def test_native_engine_draws_the_torch_samplers_tokens(tiny_dirs, plan_sizes):
    plans = plan_sizes
    native = _engine(tiny_dirs)
    assert native.sampler.native and native.sampler.steady_rows
    got = _run(native, plans)
    native_plans, native_steps = len(plans), native.step_count
    oracle = _engine(tiny_dirs)
    oracle.sampler = Sampler()
    want = _run(oracle, plans)
    assert len(got) == 14 and got == want
    # Most steps reused the plan: only a changed batch planned its rows.
    assert native_plans < native_steps // 2, (native_plans, native_steps)
    assert native.sampler.num_tracked_rows == 0
