"""The default model shipped in the wheel (hybridserve/default_model): what the issue
asks of it, checked against HF transformers' Qwen3_5ForCausalLM as the oracle."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import torch
from safetensors import safe_open

from hybridserve import default_model

PROMPTS = ["import os\n\n\ndef ", "class Queue:\n    \"\"\"", "The for statement is used to"]


@pytest.fixture(scope="module")
def model_dir():
    return default_model.path()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_shipped_files_bf16_under_40mb_with_the_mtp_layer(model_dir):
    path = os.path.join(model_dir, "model.safetensors")
    assert os.path.getsize(path) <= 40 * 2**20
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"].count("full_attention") * 4 == cfg["num_hidden_layers"]
    with safe_open(path, "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    mtp = {n.removeprefix("mtp.") for n in names if n.startswith("mtp.")}
    for n in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
              "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_norm.weight",
              "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight"):
        assert n in mtp, n
    assert not any("linear_attn" in n for n in mtp)  # the MTP layer is full attention
    assert "lm_head.weight" not in names  # tied to the embedding, as the config says
    assert cfg["tie_word_embeddings"]


def test_loads_in_hf_and_predicts_stdlib_text(hf, tokenizer):
    import inspect
    text = inspect.getsource(json.dumps)  # stdlib text (may be in the training split; a floor, not a score)
    ids = torch.tensor([tokenizer(text)["input_ids"][:256]])
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    random = Qwen3_5ForCausalLM(hf.config).eval()  # same shapes, random weights
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.item()
        random_loss = random(ids, labels=ids).loss.item()
    # ~2 bits per byte on stdlib prose and code; random weights sit near ln(8192).
    assert random_loss > 8.5 and loss < random_loss - 3.0, (loss, random_loss)


def test_mtp_head_drafts_tokens_the_trunk_agrees_with(model_dir, tokenizer):
    from hybridserve.train.eval import score
    from hybridserve.train.corpus import Document
    from hybridserve.train.export import load_trained
    from hybridserve.train.tokenizer import load_tokenizer

    import inspect
    model, mtp = load_trained(model_dir)
    res = score(model, mtp, load_tokenizer(model_dir), [Document("x", inspect.getsource(json))], seq_len=256)
    # A random head agrees with the trunk on ~1/vocab of tokens.
    assert res["mtp_agreement"] > 0.15, res


def _hf_greedy(hf, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_hybridserve_greedy_equals_hf_on_the_trained_weights(model_dir, hf, tokenizer):
    from hybridserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=512, num_pages=96, max_num_seqs=4)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))
    for p, o in zip(prompts, outs):
        got = list(o.outputs[0].token_ids)
        assert got == _hf_greedy(hf, p, 24), tokenizer.decode(p)
        # And the chosen tokens' log-probabilities match HF's, in float32 tolerance.
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p + got])).logits[0].float(), -1)
        for i, (tok, lp) in enumerate(zip(got, o.outputs[0].logprobs)):
            want = ref[len(p) - 1 + i, tok].item()
            assert abs(lp[tok].logprob - want) < 1e-3 * max(1.0, abs(want)), (i, lp[tok].logprob, want)


def test_serve_without_a_model_serves_it():
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", "--port", "0", "--device", "cpu",
           "--max-num-seqs", "2", "--kv-cache-memory-bytes", "64MiB", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving (\S+) on http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert m.group(1) == default_model.NAME
        url = f"http://127.0.0.1:{m.group(2)}"
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
            assert [x["id"] for x in json.load(r)["data"]] == [default_model.NAME]
        body = json.dumps({"model": default_model.NAME, "prompt": "def read_file(path):\n",
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        text = out["choices"][0]["text"]
        assert out["model"] == default_model.NAME and out["usage"]["completion_tokens"] > 0
        assert text.strip(), out
    finally:
        proc.terminate()
        proc.wait(timeout=60)
