"""The server on a Qwen3.5 MoE checkpoint: the official ``openai`` client's tests of
``test_server_openai.py`` run again unchanged (oracle: HF ``Qwen3_5MoeForCausalLM``),
and ``/metrics`` reports the routing balance of the steps it served."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hybridserve.model.tiny import write_tiny_checkpoint


def _suite(name: str):
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_moe_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_openai = _suite("test_server_openai")
client = _openai.client
test_completion_with_the_client_matches_hf_greedy = _openai.test_completion_with_the_client_matches_hf_greedy
test_streamed_completion_concatenates_to_the_whole_and_every_chunk_has_created = \
    _openai.test_streamed_completion_concatenates_to_the_whole_and_every_chunk_has_created
test_chat_logprobs_have_the_chat_shape_and_hf_values_streamed_or_not = \
    _openai.test_chat_logprobs_have_the_chat_shape_and_hf_values_streamed_or_not


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("live-moe") / "m", preset="moe-a", seed=5, shards=2)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    import transformers

    return transformers.Qwen3_5MoeForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def test_metrics_report_expert_load(live, client):
    before = live.metric_values().get("hybridserve:moe_expert_load_ratio_count", 0.0)
    client.completions.create(model="tiny", prompt="Hello experts", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    vals = live.wait_idle_and_whole()
    assert vals["hybridserve:moe_expert_load_ratio_count"] >= before + 5  # a prefill and 4 decodes at least
    # The ratio is at least 1 (busiest >= mean) and at most E / k (all rows on one expert).
    n = vals["hybridserve:moe_expert_load_ratio_count"]
    mean = vals["hybridserve:moe_expert_load_ratio_sum"] / n
    assert 1.0 <= mean <= 7 / 3
