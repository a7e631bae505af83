"""The server on a GGUF file (``hybridserve serve model.gguf``): the official ``openai``
client's tests of ``test_server_openai.py`` run again unchanged, the oracle HF's
``Qwen3_5ForCausalLM`` on the file's dequantized weights (tests/quant/gguf_files.py), the
tokenizer from the file's metadata. The products run on the reference path (float
activations), where HF's greedy tokens and logprobs are the server's to float32
rounding; the block kernels' fidelity is tests/quant's."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "quant"))

from gguf_files import write_gguf, write_oracle_dir  # noqa: E402


def _suite(name: str):
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_gguf_{name}", path)
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
test_echo_returns_the_prompt_with_hf_prompt_logprobs_and_text_offsets = \
    _openai.test_echo_returns_the_prompt_with_hf_prompt_logprobs_and_text_offsets


@pytest.fixture(scope="module", autouse=True)
def reference_products():
    from hybridserve.kernels import quant as qk
    from hybridserve.model import native_decode, quant_gemm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qk, "available", lambda: False)
        mp.setattr(quant_gemm, "quant_matmul_kernel", lambda: None)
        mp.setattr(native_decode, "quant_matmul_kernel", lambda: None)
        yield


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-gguf")
    path, text, oracle = write_gguf(root / "model.gguf", preset="test-a", qtype="q8_0", seed=5)
    return path, write_oracle_dir(root / "hf", text, oracle)


@pytest.fixture(scope="module")
def tiny_dir(gguf_files):
    return gguf_files[0]


@pytest.fixture(scope="module")
def hf_tiny(gguf_files):
    import transformers

    return transformers.Qwen3_5ForCausalLM.from_pretrained(gguf_files[1], dtype=torch.float32).eval()


def test_models_lists_the_file(live):
    body = live.request("GET", "/v1/models").json()
    assert [m["id"] for m in body["data"]]
