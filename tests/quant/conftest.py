"""Fixtures of the quantized-checkpoint tests.

GGUF: files from the test-side writer
(:mod:`gguf_files`) with their HF oracle directories, and the product path (reference or
native block kernels) each fidelity test runs on. Helpers: :mod:`gguf_helpers`.

FP8 / AWQ: Tiny FP8 and AWQ checkpoints (hybridserve.quant.tiny: a test-side quantizer in the
official tensor names and config), the HF oracle on their dequantized weights, and the
checks test_fp8.py and test_awq.py run for their format (the ``fid`` fixture).

Fidelity: a tiny
quantized checkpoint served by hybridserve against HF ``Qwen3_5ForCausalLM`` (or the
MoE class) on the format's dequantization of the same weights.

Bounds (max |ours - HF| / max(|HF|, 1) over a prompt's logits):
- float32: ``F32_TOL`` 1e-4. The weights are the same numbers on both sides (the
  kernels widen the quantized values exactly and multiply by the same float32 scales);
  only the order of float32 sums differs.
- bfloat16: ``BF16_TOL`` 0.05, the bound the bfloat16 path is held to against HF in
  bfloat16 (tests/model/test_model_bf16.py, the device check's BF16_LOGIT_TOL): the
  kernels round activations to bfloat16 where HF's bfloat16 run does (their inputs
  and outputs), but sum in float32 and round once, while HF's bfloat16 matmul on the
  dequantized (bfloat16-rounded) weights rounds the weights too.

"""

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


# ---- FP8 / AWQ



import random
import sys

import pytest
import torch

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.memory.layout import arena_layout
from hybridserve.model import ForwardBatch, load_model
from hybridserve.model.cache import dtype_name
from hybridserve.sampling import SamplingParams
from hybridserve.quant.tiles import native_max_rows
from hybridserve.quant.tiny import DENSE, MOE, write_quantized_checkpoint

KINDS = {"dense": DENSE, "moe": MOE}


@pytest.fixture(scope="session")
def quant_dirs(tmp_path_factory):
    """(method, kind) -> (quantized dir, dequantized dir), written on first use."""
    root = tmp_path_factory.mktemp("quant")
    made: dict = {}

    def get(method: str, kind: str):
        if (method, kind) not in made:
            made[method, kind] = write_quantized_checkpoint(root / f"{method}-{kind}", method, seed=11,
                                                            **KINDS[kind])
        return made[method, kind]
    return get


@pytest.fixture(scope="session")
def hf_oracle(quant_dirs):
    import transformers

    made: dict = {}

    def get(method: str, kind: str, dtype=torch.float32):
        if (method, kind, dtype) not in made:
            cls = transformers.Qwen3_5MoeForCausalLM if kind == "moe" else transformers.Qwen3_5ForCausalLM
            made[method, kind, dtype] = cls.from_pretrained(quant_dirs(method, kind)[1], dtype=dtype).eval()
        return made[method, kind, dtype]
    return get


@pytest.fixture
def fid():
    """This module's checks (test modules cannot import it under --import-mode=importlib)."""
    return sys.modules[__name__]


F32_TOL = 1e-4
BF16_TOL = 0.05
N_TOKENS = 16


def prompts():
    rng = random.Random(5)
    return [[rng.randrange(259) for _ in range(n)] for n in (9, 30, 4)]


def prompt_logits(model, config, prompt, block_size=16):
    n = len(prompt)
    nb = -(-n // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


def check_logits(qdir, hf, dtype, mode, tol):
    model, config = load_model(qdir, dtype=dtype, progress=False, quant_cpu=mode)
    for p in prompts():
        ours = prompt_logits(model, config, p)
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        err = float((ours - ref).abs().max() / ref.abs().max().clamp(min=1.0))
        assert err <= tol, (len(p), err)
    return model


def hf_greedy(hf, prompt, n=N_TOKENS):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].float().argmax()))
    return ids[len(prompt):]


def engine_greedy(qdir, dtype, ps, n=N_TOKENS):
    """Greedy tokens from the engine: the prompts prefilled and decoded together
    (decode steps of several rows: the few-row kernels)."""
    eng = LLMEngine(EngineArgs(model=qdir, dtype=dtype, device="cpu", max_num_seqs=8, block_size=16,
                               cpu_threads=1))
    for i, p in enumerate(ps):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
    return [got[f"p{i}"] for i in range(len(ps))]


def kernel_cases(weight, dequantized, rows=range(1, 18)):
    """``weight.linear`` against ``x @ W.T`` with the format's dequantized ``W``, for 1..17
    rows (the native kernel up to 16, dequantized tiles past it) and float32 / bfloat16
    activations; returns how many calls the native kernel served."""
    native_calls = 0
    gen = torch.Generator().manual_seed(0)
    for m in rows:
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(m, weight.shape[1], generator=gen).to(dt)
            native = m <= native_max_rows(weight.qtype) and weight.native(x) is not None
            native_calls += native
            y = weight.linear(x)
            assert y.dtype == dt and y.shape == (m, weight.shape[0])
            ref = x.float() @ dequantized.T
            scale = ref.abs().max().clamp(min=1.0)
            # float32: summation order only. bfloat16: the native kernel rounds its
            # float32 sums once (half a bfloat16 step); the tiles' bfloat16 GEMM also
            # rounds the weights to bfloat16, as HF's bfloat16 run on them does.
            tol = 1e-5 if dt == torch.float32 else (2 ** -8 if native else 2 ** -5)
            err = float((y.float() - ref).abs().max() / scale)
            assert err <= tol, (m, dt, err)
    return native_calls
