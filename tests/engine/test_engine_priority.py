"""Priority preemption end to end: the scheduler acts on priority, and the
requests it preempts lose nothing.

Oracle: HF ``Qwen3_5ForCausalLM`` greedy decoding (float32) of each prompt on its
own, i.e. a run without contention.
"""

from __future__ import annotations

import copy

import torch

from hybridserve import SamplingParams
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.metrics import EngineMetrics


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = None  # ignore_eos
    gc.do_sample, gc.max_new_tokens = False, n
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()


def test_urgent_request_preempts_a_full_batch_and_nobody_loses_tokens(tiny_dirs, hf_models):
    # The reproduction: four priority-10 requests fill max_num_seqs=4; an
    # urgent priority -100 request must get its first token within 2 steps.
    engine = LLMEngine(EngineArgs(
        model=tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
        num_pages=64 + 3 * 8, max_num_seqs=4, max_num_batched_tokens=64))
    metrics = EngineMetrics()
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    lows = {f"low{i}": [3 + i, 17, 29 + i, 8, 41, 5 + 2 * i] for i in range(4)}
    for rid, prompt in lows.items():
        engine.add_request(rid, prompt, greedy(20), priority=10, request_class="batch")
    tokens: dict[str, list[int]] = {rid: [] for rid in lows}

    def step():
        outs = engine.step()
        metrics.observe_step(engine, outs)
        for o in outs:
            # Running requests report their new tokens; the finished one, all of them.
            new = list(o.outputs[0].token_ids)
            tokens[o.request_id] = tokens[o.request_id] + new if o.delta else new

    for _ in range(3):
        step()
    assert all(len(tokens[r]) == 3 for r in lows), tokens  # all four are decoding
    urgent = [7, 7, 19, 23, 2, 11, 13]
    engine.add_request("urgent", urgent, greedy(6), priority=-100, request_class="interactive")
    tokens["urgent"] = []
    steps = 0
    while not tokens["urgent"]:
        step()
        steps += 1
        assert steps <= 2, "the urgent request got no token within 2 steps"
    st = engine.stats()
    assert st["preemptions_priority"] == 1 and st["preemptions_blocks"] == 0, st
    while engine.has_unfinished_requests():
        step()

    hf = hf_models["test-a"]
    assert tokens["urgent"] == _hf_greedy(hf, urgent, 6)
    for rid, prompt in lows.items():
        assert tokens[rid] == _hf_greedy(hf, prompt, 20), rid
    st = engine.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0, st
    # Preemptions by cause and by the victim's class.
    metrics.refresh(engine)
    text = metrics.render().decode()
    assert 'hybridserve:preemptions_by_cause_total{cause="priority",request_class="batch"} 1.0' in text, text


def test_equal_priorities_never_preempt_for_priority(tiny_dirs):
    # Same crowding, one priority: the newcomer waits its turn (FCFS), as before.
    engine = LLMEngine(EngineArgs(
        model=tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
        num_pages=64 + 3 * 8, max_num_seqs=2, max_num_batched_tokens=64))
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], p)
    engine.add_request("b", [4, 5, 6], p)
    engine.step()
    engine.add_request("c", [7, 8, 9], p)
    first_token_step = {}
    k = 0
    while engine.has_unfinished_requests():
        k += 1
        for o in engine.step():
            if o.outputs[0].token_ids:
                first_token_step.setdefault(o.request_id, k)
    assert engine.stats()["preemptions"] == 0
    assert first_token_step["c"] > 3  # only after a or b finished (4 tokens each)


def test_preempted_n2_request_prefills_its_prompt_once_and_keeps_its_samples(tiny_dirs):
    # A seeded n=2 request is preempted by an urgent one after forking; on
    # recompute its prompt is prefilled by one sample only, the other forks from
    # it at the prompt's end, and both samples end as in a run without contention.
    def engine():
        return LLMEngine(EngineArgs(
            model=tiny_dirs["test-b"], dtype="float32", device="cpu", block_size=16,
            num_pages=64 + 3 * 4, max_num_seqs=2, max_num_batched_tokens=64,
            enable_prefix_caching=False))

    prompt = [9, 4, 77, 31, 2, 18, 60, 5, 11, 42, 3, 25, 8, 19, 70, 1, 6, 33, 14, 50]  # 20 tokens
    p = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)

    def run(contended):
        eng = engine()
        fed: list[tuple[int, int]] = []  # (sample, position) of every prompt position fed after preemption
        inner = eng.runner.execute
        state = {"preempted": False}

        def execute(plan, *a):
            if "slow" in plan.preempted:
                state["preempted"] = True
            for b, rid in enumerate(plan.request_ids):
                start, k = int(plan.num_computed_tokens[b]), int(plan.num_scheduled_tokens[b])
                if rid == "slow" and state["preempted"]:
                    fed.extend((int(plan.sample_indices[b]), pos) for pos in range(start, start + k)
                               if pos < len(prompt))
            return inner(plan, *a)

        eng.runner.execute = execute
        eng.add_request("slow", prompt, p, priority=5)
        outs = {}
        for _ in range(4):
            for o in eng.step():
                outs[o.request_id] = o
        if contended:
            eng.add_request("urgent", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            priority=-5)
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o
        st = eng.stats()
        assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
        return [c.token_ids for c in outs["slow"].outputs], fed, st

    alone, _, _ = run(False)
    got, fed, st = run(True)
    assert st["preemptions_priority"] == 1, st
    assert got == alone
    assert sorted(pos for _, pos in fed) == list(range(len(prompt))), "prompt not prefilled exactly once"
    assert {s for s, _ in fed} == {0}
