"""Defaults that follow the machine (issue 32), driven by a fake memory reading
($HYBRIDSERVE_AVAILABLE_MEMORY) and a fake CPU feature: the CPU arena's budget, the
max_num_seqs the memory plan gives, and what dtype="auto" means on a CPU. Oracles:
the planner's arena arithmetic (tested on its own against hand counts) and the
checkpoint's config."""

from __future__ import annotations

import logging

import pytest
import torch

import hybridserve.engine.device as device_mod
from hybridserve import planner
from hybridserve.config import ModelConfig
from hybridserve.engine.args import CPU_MEMORY_FRACTION, MAX_NUM_SEQS_CAP, EngineArgs
from hybridserve.engine.device import AVAILABLE_MEMORY_ENV, auto_dtype, available_memory_bytes
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.memory.layout import arena_layout
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.sampling import SamplingParams

MiB = 1 << 20


def _engine(model, **kw):
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineArgs(model=str(model), device="cpu", **kw))


def _expected_budget(model, avail, max_model_len, fraction=CPU_MEMORY_FRACTION):
    cfg = ModelConfig.from_json(str(model))
    layout = arena_layout(cfg, 16, "float32")
    useful = MAX_NUM_SEQS_CAP * layout.pages_for_sequence(max_model_len) * layout.page_bytes
    return min(int(avail * fraction), useful), cfg


@pytest.mark.parametrize("avail_mib,max_model_len", [(64, 4096), (48, 2048), (4096, 256)])
def test_cpu_arena_is_a_fraction_of_available_memory(tiny_dirs, monkeypatch, caplog, avail_mib, max_model_len):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, f"{avail_mib}MiB")
    budget, cfg = _expected_budget(tiny_dirs["test-a"], avail_mib * MiB, max_model_len)
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        eng = _engine(tiny_dirs["test-a"], max_model_len=max_model_len)
    want = planner.size_arena(eng.layout_config, budget_bytes=budget, block_size=16, kv_dtype="float32")
    assert eng.num_pages == want.num_pages
    line = next(r.getMessage() for r in caplog.records if "CPU arena budget" in r.getMessage())
    assert f"{CPU_MEMORY_FRACTION} of the {avail_mib:,} MiB available" in line
    # A large machine is bounded by what 256 sequences of max_model_len can use.
    assert ("capped at what 256 sequences" in line) == (budget < avail_mib * MiB * CPU_MEMORY_FRACTION)


def test_budget_and_fraction_override_the_reading(tiny_dirs, monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "64MiB")
    half = _engine(tiny_dirs["test-a"]).num_pages
    quarter = _engine(tiny_dirs["test-a"], cpu_memory_fraction=0.25).num_pages
    fixed = _engine(tiny_dirs["test-a"], kv_cache_memory_bytes=16 * MiB).num_pages
    layout = arena_layout(ModelConfig.from_json(str(tiny_dirs["test-a"])), 16, "float32")
    assert half == layout.num_pages(32 * MiB)
    assert quarter == layout.num_pages(16 * MiB) == fixed


def test_available_memory_reads_the_machine(monkeypatch):
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV, raising=False)
    avail, source = available_memory_bytes()
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    # MemAvailable, or less where a cgroup limit leaves less room.
    assert 0 < avail <= meminfo["MemAvailable"] * 1.05 and source
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "3GiB")
    assert available_memory_bytes()[0] == 3 << 30


@pytest.mark.parametrize("avail_mib", [8, 64])
def test_max_num_seqs_comes_from_the_memory_plan(tiny_dirs, monkeypatch, avail_mib):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, f"{avail_mib}MiB")
    eng = _engine(tiny_dirs["test-a"], max_model_len=512, max_num_batched_tokens=4096)
    fit = eng.num_pages // eng.arena_plan.layout.pages_for_sequence(1)
    want = min(MAX_NUM_SEQS_CAP, fit)
    assert eng.args.max_num_seqs == want
    assert want > 64  # more than the old fixed 64, on either budget
    # The engine really runs that many at once: one step schedules all of them.
    n = min(want, 200)
    for i in range(n):
        eng.add_request(f"r{i}", [1 + i % 200, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert eng.last_step_stats["num_scheduled_seqs"] == n
    while eng.has_unfinished_requests():
        eng.step()
    # An explicit value wins.
    assert _engine(tiny_dirs["test-a"], max_num_seqs=5).args.max_num_seqs == 5


def _write(tmp_path, dtype):
    return write_tiny_checkpoint(tmp_path / dtype, preset="test-a", seed=3, dtype=dtype)


@pytest.mark.parametrize("feature,ckpt,want", [
    ("avx512_bf16", "bfloat16", torch.bfloat16),
    ("amx_bf16", "bfloat16", torch.bfloat16),
    (None, "bfloat16", torch.float32),
    ("avx512_bf16", "float32", torch.float32),
])
def test_engine_auto_dtype_on_cpu(tmp_path, monkeypatch, caplog, feature, ckpt, want):
    model = _write(tmp_path, ckpt)
    assert ModelConfig.from_json(str(model)).torch_dtype == ckpt
    monkeypatch.setattr(device_mod, "cpu_native_bf16", lambda: feature)
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        eng = _engine(model, dtype="auto", num_pages=64, max_num_seqs=2)
    assert eng.dtype == want
    assert next(p.dtype for p in eng.model.parameters()) == want
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype:"))
    assert line.startswith(f"dtype: {str(want).removeprefix('torch.')} (auto: ")
    if ckpt == "bfloat16":
        assert (feature or "without native bfloat16") in line
    # It serves.
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def test_auto_dtype_on_cuda_is_the_checkpoints(tmp_path):
    cfg = ModelConfig.from_json(str(_write(tmp_path, "bfloat16")))
    assert auto_dtype(cfg, torch.device("cuda"), None)[0] == torch.bfloat16
    assert auto_dtype(cfg, torch.device("cpu"), None)[0] == torch.float32


def test_cpu_native_bf16_reads_cpuinfo():
    with open("/proc/cpuinfo") as f:
        words = set(f.read().split())
    found = device_mod.cpu_native_bf16()
    if {"amx_bf16", "avx512_bf16", "bf16"} & words:
        assert found in words
    else:
        assert found is None
