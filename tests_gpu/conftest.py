"""GPU-only tests: not collected by CI (pytest's testpaths is tests/); run by
benches/gpu_check.py with HYBRIDSERVE_TEST_DEVICE set (default cuda). On the CPU dry
run the CUDA-only ones are skipped and gpu_check reports them as not run."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(os.environ.get("HYBRIDSERVE_TEST_DEVICE", "cuda"))


@pytest.fixture
def cuda_device(device) -> torch.device:
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    return device


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from hybridserve.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu-tiny") / "test-a", preset="test-a", seed=3)
