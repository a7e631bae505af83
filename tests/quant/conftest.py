"""Fixtures of the quantized-checkpoint tests: GGUF files from the test-side writer
(:mod:`gguf_files`) with their HF oracle directories, and the product path (reference or
native block kernels) each fidelity test runs on. Helpers: :mod:`gguf_helpers`."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from gguf_files import write_gguf, write_oracle_dir  # noqa: E402


@pytest.fixture(scope="session")
def gguf_case(tmp_path_factory):
    """``gguf_case(name, **write_gguf kwargs)`` -> (gguf path, HF text config, oracle dir),
    written once per name."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, tuple[str, dict, str]] = {}

    def make(name: str, **kw):
        if name not in made:
            os.makedirs(root / name, exist_ok=True)
            path, text, oracle = write_gguf(root / name / "model.gguf", **kw)
            made[name] = (path, text, write_oracle_dir(root / name / "hf", text, oracle))
        return made[name]

    return make


@pytest.fixture(params=["reference", "native"])
def kernel_path(request, monkeypatch):
    """Every fidelity test runs twice: on the reference products (``F.linear`` on the
    gguf package's dequantized weights: float activations, so HF's numbers to float32
    summation order) and on the native block kernels (activations rounded to 8 bits per
    block, the oracle rounded alike: :func:`round_like_kernels`)."""
    from hybridserve.kernels import quant as qk
    from hybridserve.model import native_decode, quant_gemm

    if request.param == "reference":
        monkeypatch.setattr(qk, "available", lambda: False)
        monkeypatch.setattr(quant_gemm, "quant_matmul_kernel", lambda: None)
        monkeypatch.setattr(native_decode, "quant_matmul_kernel", lambda: None)
    else:
        assert qk.available(), "the extension was built without the quantized kernels (quant_matmul)"
    return request.param
