"""The engine's layout (issue 30): start-up is one chain whose steps each take the last
one's result, and ``llm_engine.py`` composes the input processor, the engine core and
the output processor without scheduling, running or sampling anything itself."""

from __future__ import annotations

import ast
import inspect

import pytest

from hybridserve import SamplingParams
from hybridserve.engine import builder, core, llm_engine
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.errors import InvalidRequest

ARGS = dict(dtype="float32", device="cpu", num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
            max_model_len=256, cpu_threads=1)

STEP_FUNCTIONS = [("config", "resolve_config"), ("weights", "load_weights"), ("memory_plan", "plan_memory"),
                  ("arena", "create_arena"), ("runner", "create_runner"), ("graphs", "capture_graphs")]


def test_start_up_runs_its_steps_in_order_each_on_the_last_result(tiny_dirs, monkeypatch):
    calls: list[tuple[str, object, object]] = []
    for name, fn_name in STEP_FUNCTIONS:
        real = getattr(builder, fn_name)

        def wrapped(arg, _real=real, _name=name):
            out = _real(arg)
            calls.append((_name, arg, out))
            return out

        monkeypatch.setattr(builder, fn_name, wrapped)
    args = EngineArgs(model=str(tiny_dirs["test-a"]), **ARGS)
    engine = LLMEngine(args)

    assert [c[0] for c in calls] == list(builder.BUILD_STEPS)
    assert engine.parts.build_log == builder.BUILD_STEPS
    # The first step takes the arguments; every later one exactly the result before it.
    assert calls[0][1] is args
    for (_, _, prev_out), (name, arg, _) in zip(calls, calls[1:]):
        assert arg is prev_out, f"step {name!r} did not take the previous step's result"
    config, weights, plan, arena, ready, parts = (c[2] for c in calls)
    # Each result keeps the one it was built from (nothing reaches back past it).
    assert weights.config is config and plan.weights is weights and arena.plan is plan and ready.arena is arena
    assert parts is engine.parts
    # The engine is made of what the chain built.
    assert engine.model is weights.model and engine.tokenizer is weights.tokenizer
    assert engine.arena_plan is plan.arena_plan and engine.cache is arena.cache
    assert engine.scheduler is arena.scheduler and engine.runner is ready.runner and engine.sampler is ready.sampler
    assert engine.args.max_num_seqs == plan.args.max_num_seqs == 4


def test_start_up_derives_max_num_seqs_in_the_memory_plan_step(tiny_dirs):
    """max_num_seqs left unset is derived from the plan, and the later steps (the
    scheduler's and the runner's sizes) use the derived value."""
    args = dict(ARGS)
    del args["max_num_seqs"]
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), **args))
    derived = engine.args.max_num_seqs
    plan = engine.arena_plan
    assert derived == max(1, min(256, plan.num_pages // plan.layout.pages_for_sequence(1)))
    assert plan.max_num_seqs == derived and engine.core.max_num_seqs == derived
    assert engine.processor.max_num_seqs == derived


def _attribute_names(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_llm_engine_has_no_scheduler_runner_or_sampler_calls_of_its_own():
    """llm_engine.py composes the parts: it names neither the scheduler, the runner nor
    the sampler (its properties delegate by name to the core), and calls none of the
    step loop's operations."""
    names = _attribute_names(llm_engine)
    loop = {"scheduler", "runner", "sampler", "schedule", "execute", "update", "sample_planned", "finish",
            "take_events", "abort_step", "_step", "_after_forward", "_sampling_rows", "_beam_select"}
    assert not names & loop, sorted(names & loop)


def test_the_engine_core_knows_no_text():
    """The core neither tokenizes nor detokenizes: requests come in tokenized and the
    outputs are built by the output processor it is given."""
    names = _attribute_names(core)
    text = {"tokenizer", "encode", "decode", "completion", "append_streaming", "stop_string", "delta_output",
            "to_output", "tokenize"}
    assert not names & text, sorted(names & text)


def test_a_refused_prompt_logprobs_keeps_no_grammar(tiny_dirs):
    """The input processor checks prompt_logprobs before it compiles a request's grammar:
    a refusal leaves no constraint behind."""
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), **ARGS))
    params = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]})
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        engine.add_request("x", [5, 6, 7], params, prompt_logprobs=-1)
    assert engine.structured is None or engine.structured.stats()["active_requests"] == 0
    assert not engine.has_unfinished_requests()
    # The same id is free, and the constrained request then runs to its end.
    engine.add_request("x", [5, 6, 7], params)
    assert engine.structured.stats()["active_requests"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.structured.stats()["active_requests"] == 0


def test_an_engine_is_freed_by_its_last_reference_alone(tiny_dirs):
    """No reference cycle keeps an engine alive: dropping the last reference ends it at
    once, without the cyclic collector (tensor parallelism closes its ranks then, through
    weakref.finalize; a cycle left the ranks open until some later collection, and the
    next engine's process group then failed to start)."""
    import gc
    import weakref

    from hybridserve import LLM

    gc.disable()
    try:
        llm = LLM(tiny_dirs["test-a"], dtype="float32", num_pages=64)
        llm.generate([[5, 6, 7]])
        ref = weakref.ref(llm.engine)
        del llm
        assert ref() is None
    finally:
        gc.enable()
