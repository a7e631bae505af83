"""Start-up errors for sizes that do not shard the model, and the KV-head replication
rule, checked against the shapes written out by hand (no process is started)."""

from __future__ import annotations

import os

import pytest

from hybridserve import LLM
from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.model.tiny import text_config
from hybridserve.parallel import ShardPlan


def _cfg(preset: str, **kw) -> ModelConfig:
    return ModelConfig.from_dict(text_config(preset, **kw))


@pytest.mark.parametrize("preset, overrides, n, dim", [
    ("test-b", {}, 2, "linear_num_key_heads"),                       # 3 key heads
    ("test-a", {"vocab_size": 273}, 2, "vocab_size"),
    ("test-a", {"num_attention_heads": 6, "num_key_value_heads": 2}, 4, "num_attention_heads"),
    ("test-a", {"intermediate_size": 129}, 2, "intermediate_size"),
    ("moe-a", {"moe_intermediate_size": 41}, 2, "moe_intermediate_size"),
    ("moe-a", {"shared_expert_intermediate_size": 49}, 2, "shared_expert_intermediate_size"),
    ("test-a", {"linear_num_value_heads": 6, "linear_num_key_heads": 2}, 4, "linear_num_key_heads"),
])
def test_a_size_that_does_not_divide_names_the_dimension(preset, overrides, n, dim):
    with pytest.raises(ConfigError, match=dim):
        ShardPlan(_cfg(preset, **overrides), 0, n)


def test_kv_heads_replicate_past_their_count():
    # 6 query heads, 1 KV head over 2 ranks: each rank 3 query heads and the one KV head.
    cfg = _cfg("test-b", linear_num_key_heads=2, linear_num_value_heads=6)
    for r in range(2):
        s = ShardPlan(cfg, r, 2)
        assert s.q_heads == (3 * r, 3 * r + 3) and s.kv_heads == (0, 1) and s.replicates_kv
        local = s.local_config()
        assert (local.num_attention_heads, local.num_key_value_heads) == (3, 1)
        assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 3)
        assert local.vocab_size == 136
    # 8 query heads, 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 head 1.
    cfg = _cfg("test-a", num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
               linear_num_value_heads=8)
    assert [ShardPlan(cfg, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # 4 ranks over 3 KV heads: neither a divisor nor a multiple.
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ShardPlan(_cfg("test-b", num_attention_heads=12, num_key_value_heads=3, linear_num_key_heads=4,
                       linear_num_value_heads=4), 0, 4)


def test_llm_refuses_before_starting_any_worker(tmp_path):
    from hybridserve.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "b", preset="test-b")
    before = set(os.listdir("/proc"))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide linear_num_key_heads \(3\)"):
        LLM(path, dtype="float32", num_pages=32, tensor_parallel_size=2)
    import torch.distributed as dist

    assert not dist.is_initialized()
    new = {p for p in set(os.listdir("/proc")) - before if p.isdigit()}
    for pid in new:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                assert "hybridserve.parallel.worker" not in f.read()
        except FileNotFoundError:
            pass
