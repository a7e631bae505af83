"""Tiny checkpoints for the tensor-parallel tests (2 ranks, gloo, CPU)."""

from __future__ import annotations

import pytest

from hybridserve.model.tiny import write_tiny_checkpoint

# Shapes chosen to cover each sharding rule at tensor_parallel_size=2.
TP_CONFIGS = {
    # GQA 2:1 with 2 KV heads (one per rank); 2 value heads per DeltaNet key head.
    "dense-gqa": dict(preset="test-a"),
    # 1 KV head over 2 ranks (replicated); 3 value heads per key head.
    "dense-kv1": dict(preset="test-b", linear_num_key_heads=2, linear_num_value_heads=6,
                      tie_word_embeddings=False),
    # MoE: 7 experts top-3 + shared expert, intermediate dims split; HF's fused 3-D
    # expert tensors (read through get_slice along their middle/last dim).
    "moe": dict(preset="moe-a", fused_experts=True),
    # MoE, top-1, 1 KV head over 2 ranks, 3 value heads per key head, tied embeddings.
    "moe-kv1": dict(preset="moe-b", num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6),
}


@pytest.fixture(scope="session")
def tp_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-tiny")
    return {name: write_tiny_checkpoint(root / name, seed=23, **kw) for name, kw in TP_CONFIGS.items()}
