"""Tiny checkpoints and the HF oracle, shared by the engine and server tests."""

from __future__ import annotations

import pytest
import torch

from hybridserve.model.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-tiny")
    return {p: write_tiny_checkpoint(root / p, preset=p, seed=11) for p in ("test-a", "test-b")}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs):
    import transformers

    return {
        p: transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for p, d in tiny_dirs.items()
    }
