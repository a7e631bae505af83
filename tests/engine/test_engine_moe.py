"""The engine on the Qwen3.5 mixture-of-experts models: everything else unchanged.

The engine suites' HF-checked tests (continuous batching, chunked prefill at a small
token budget, preemption by recompute, n=2 forks, prefix caching with state
checkpoints, beam search, priority preemption) run again here, unchanged, against
tiny MoE checkpoints: this module's fixtures give the presets' keys MoE checkpoints
and HF's MoE classes as the oracle.

* ``test-a`` -> ``moe-a``: top-3 of 7 experts, GQA 1:1, shared expert, causal-LM
  naming (``qwen3_5_moe_text``, oracle ``Qwen3_5MoeForCausalLM``), 2 shards.
* ``test-b`` -> ``moe-b``: top-1 of 5 experts, GQA 3:1, a saturating shared-expert
  gate, VL naming (``qwen3_5_moe``, oracle ``Qwen3_5MoeForConditionalGeneration``),
  3 shards of HF's fused 3-D expert tensors.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from hybridserve.model.tiny import write_tiny_checkpoint

MOE_CHECKPOINTS = {
    "test-a": dict(preset="moe-a", seed=11, shards=2),
    "test-b": dict(preset="moe-b", seed=12, shards=3, vl_naming=True, fused_experts=True,
                   shared_gate_scale=400.0),
}


def _suite(name: str):
    """A sibling test module loaded by path (the tests folder is not a package)."""
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_moe_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_fidelity = _suite("test_engine_fidelity")
_prefix = _suite("test_engine_prefix_cache")
_beams = _suite("test_engine_beam_search")
_priority = _suite("test_engine_priority")

test_batch_of_four_prompts_decoded_together = _fidelity.test_batch_of_four_prompts_decoded_together
test_chunked_prefill_at_awkward_budgets_mixed_with_decodes = _fidelity.test_chunked_prefill_at_awkward_budgets_mixed_with_decodes
test_preemption_by_recompute_gives_the_same_tokens = _fidelity.test_preemption_by_recompute_gives_the_same_tokens
test_n2_samples_fork_after_prefill_and_match_hf = _fidelity.test_n2_samples_fork_after_prefill_and_match_hf
test_shared_system_prompt_skips_compute_and_matches_hf = _prefix.test_shared_system_prompt_skips_compute_and_matches_hf
test_n2_forks_on_a_cached_prefix = _prefix.test_n2_forks_on_a_cached_prefix
test_preempted_request_that_hit_the_cache_recomputes_exactly = _prefix.test_preempted_request_that_hit_the_cache_recomputes_exactly
test_chunked_prefill_with_a_small_budget_resumes_exactly = _prefix.test_chunked_prefill_with_a_small_budget_resumes_exactly
test_beams_equal_hf_generate = _beams.test_beams_equal_hf_generate
test_beam_request_preempted_as_a_unit_still_equals_hf = _beams.test_beam_request_preempted_as_a_unit_still_equals_hf
test_urgent_request_preempts_a_full_batch_and_nobody_loses_tokens = _priority.test_urgent_request_preempts_a_full_batch_and_nobody_loses_tokens


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-tiny-moe")
    return {k: write_tiny_checkpoint(root / k, **kw) for k, kw in MOE_CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    import transformers

    out = {}
    for k, d in tiny_dirs.items():
        with open(os.path.join(d, "config.json")) as f:
            vl = json.load(f)["model_type"] == "qwen3_5_moe"
        cls = transformers.Qwen3_5MoeForConditionalGeneration if vl else transformers.Qwen3_5MoeForCausalLM
        out[k] = cls.from_pretrained(d, dtype=torch.float32).eval()
    return out


def test_the_checkpoints_are_moe(tiny_dirs):
    from hybridserve.config import ModelConfig

    types = {k: ModelConfig.from_json(d).model_type for k, d in tiny_dirs.items()}
    assert types == {"test-a": "qwen3_5_moe_text", "test-b": "qwen3_5_moe"}


def test_metrics_histogram_of_expert_load_per_step(tiny_dirs):
    """``/metrics`` gets one expert-load observation per step that ran the model: the
    busiest expert's rows over the mean, in the worst layer, recomputed here from the
    reference router on the rows each MoE layer actually received."""
    import torch.nn.functional as F

    from hybridserve import SamplingParams
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.kernels.moe import route_ref
    from hybridserve.metrics import EngineMetrics

    engine = LLMEngine(EngineArgs(model=tiny_dirs["test-a"], dtype="float32", device="cpu", block_size=16,
                                  num_gpu_blocks=64, num_state_slots=8, max_num_seqs=4,
                                  max_num_batched_tokens=24))
    metrics = EngineMetrics()
    config = engine.model.config
    step_worst: list[int] = []
    step_rows: list[int] = []
    for layer in engine.model.layers:
        mlp = layer.mlp
        orig = mlp.forward

        def spy(x, orig=orig, mlp=mlp):
            _, ids = route_ref(F.linear(x, mlp.gate.weight), mlp.top_k)
            busiest = int(torch.bincount(ids.reshape(-1), minlength=mlp.num_experts).max())
            if mlp is engine.model.layers[0].mlp:
                step_worst.append(busiest)
                step_rows.append(x.shape[0])
            else:
                step_worst[-1] = max(step_worst[-1], busiest)
            return orig(x)
        mlp.forward = spy
    for i, n in enumerate((5, 30, 11)):
        engine.add_request(f"r{i}", [3 + (7 * j + i) % 250 for j in range(n)],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        metrics.observe_step(engine, engine.step())
        metrics.observe_step(engine, [])  # a second call for the same step observes nothing
        steps += 1
    e, k = config.num_experts, config.num_experts_per_tok
    want = [w * e / (t * k) for w, t in zip(step_worst, step_rows)]
    assert len(want) == steps
    text = metrics.render().decode()
    count = float(text.split("hybridserve:moe_expert_load_ratio_count ")[1].split()[0])
    total = float(text.split("hybridserve:moe_expert_load_ratio_sum ")[1].split()[0])
    assert count == steps
    assert total == pytest.approx(sum(want))
    assert min(want) >= 1.0
