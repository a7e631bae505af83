"""``serve``, ``bench throughput`` and ``plan`` share vLLM's argument names (issue 32):
each flag reaches EngineArgs, the memory budget has one spelling (old ones warn), and
--block-size and ``tiny:`` names are validated alike in every command."""

from __future__ import annotations

import json
import os

import pytest

import hybridserve
import hybridserve.engine.llm_engine as llm_engine_mod
from hybridserve.cli import main
from hybridserve.config import ModelConfig
from hybridserve.engine.args import EngineArgs
from hybridserve.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20


class _Captured(ConfigError):
    """Raised by the fake engine: the command stops there with exit 2, args in hand."""


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def captured(monkeypatch):
    """The EngineArgs that serve / bench would build an engine from."""
    seen: list[EngineArgs] = []

    class FakeEngine:
        def __init__(self, args):
            seen.append(args)
            raise _Captured("captured")

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.append(EngineArgs.from_kwargs(model, **kwargs))
            raise _Captured("captured")

    monkeypatch.setattr(llm_engine_mod, "LLMEngine", FakeEngine)
    monkeypatch.setattr(hybridserve, "LLM", FakeLLM)
    return seen


def _serve(argv):
    return main(["serve", "--port", "0", "--log-level", "error", *argv])


def _bench(argv):
    return main(["bench", "throughput", "--no-progress", "--num-prompts", "2", *argv])


FLAGS = ["--seed", "7", "--tokenizer", "/some/tokenizer", "--kv-cache-dtype", "bfloat16",
         "--kv-cache-memory-bytes", "3G", "--block-size", "32"]


@pytest.mark.parametrize("run", [_serve, _bench], ids=["serve", "bench"])
def test_each_flag_reaches_engine_args(run, tiny_cache, captured, capsys):
    assert run(["tiny:moe-bench", *FLAGS]) == 2
    assert "captured" in capsys.readouterr().err
    (a,) = captured
    assert a.seed == 7
    assert a.tokenizer == "/some/tokenizer"
    assert a.kv_cache_dtype == "bfloat16"
    assert a.kv_cache_memory_bytes == 3 * GiB
    assert a.block_size == 32
    # tiny:PRESET is generated once into the cache and served from there.
    assert os.path.basename(a.model) == "tiny-moe-bench-seed0"
    assert ModelConfig.from_json(a.model).num_experts == 64


@pytest.mark.parametrize("run", [_serve, _bench], ids=["serve", "bench"])
@pytest.mark.parametrize("spelling", [
    ["--kv-cache-memory-bytes", str(3 * GiB)],
    ["--kv-cache-memory-bytes", "3GiB"],
    ["--kv-cache-memory-bytes", "3072MiB"],
    ["--kv-cache-memory", "3GiB"],  # the old spelling
])
def test_one_budget_however_spelled(run, spelling, tiny_cache, captured, capsys):
    assert run(["tiny:bench", *spelling]) == 2
    err = capsys.readouterr().err
    assert captured[0].kv_cache_memory_bytes == 3 * GiB
    deprecated = spelling[0] == "--kv-cache-memory"
    assert ("--kv-cache-memory is deprecated; use --kv-cache-memory-bytes" in err) == deprecated


def test_vllm_size_suffixes():
    from hybridserve.cli_args import memory_bytes

    assert memory_bytes("4G") == 4 * GiB  # vLLM: upper case is binary
    assert memory_bytes("4g") == 4 * 10**9  # lower case decimal
    assert memory_bytes("512M") == 512 * MiB
    assert memory_bytes("1.5G") == 3 * GiB // 2
    assert memory_bytes("80GB") == 80 * 10**9
    assert memory_bytes("1_000") == 1000


def _plan_json(capsys, argv):
    assert main(["plan", "qwen3.5-27b", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    d.pop("config")
    return d, err


def test_plan_budget_and_kv_dtype_spelled_two_ways_give_one_plan(capsys):
    new, err_new = _plan_json(capsys, ["--kv-cache-memory-bytes", "23859MiB", "--kv-cache-dtype", "float16"])
    old, err_old = _plan_json(capsys, ["--pool-mib", "23859", "--kv-dtype", "float16"])
    raw, _ = _plan_json(capsys, ["--kv-cache-memory-bytes", str(23859 * MiB), "--kv-cache-dtype", "float16"])
    assert new == old == raw
    assert "deprecated" not in err_new
    assert "--pool-mib is deprecated" in err_old and "--kv-dtype is deprecated" in err_old
    # And the budget is the one the plan used (not the device-derived default).
    default, _ = _plan_json(capsys, [])
    assert default != new


def test_budget_given_twice_differently_is_refused(capsys):
    assert main(["plan", "qwen3.5-27b", "--pool-mib", "512", "--kv-cache-memory-bytes", "1GiB"]) == 2
    assert "give it once" in capsys.readouterr().err
    # The same budget twice is not a conflict.
    assert main(["plan", "qwen3.5-27b", "--pool-mib", "1024", "--kv-cache-memory-bytes", "1GiB"]) == 0


@pytest.mark.parametrize("argv", [
    ["plan", "qwen3.5-27b"],
    ["serve", "--port", "0"],
    ["bench", "throughput"],
])
def test_block_size_is_validated_alike_everywhere(argv, capsys, tiny_cache):
    assert main([*argv, "--block-size", "7"]) == 2
    assert "--block-size 7 is not a power of two" in capsys.readouterr().err
    assert main([*argv, "--block-size", "0"]) == 2


@pytest.mark.parametrize("argv", [["plan"], ["serve", "--port", "0"], ["bench", "throughput"]])
def test_unknown_tiny_name_is_refused_alike(argv, capsys, tiny_cache):
    assert main([*argv, "tiny:nope"]) == 2
    assert "unknown tiny model 'nope'" in capsys.readouterr().err


def test_plan_takes_tiny_names(capsys, tiny_cache):
    assert main(["plan", "tiny:moe-bench", "--kv-cache-memory-bytes", "64MiB", "--context", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"] == "tiny:moe-bench"


def test_serve_refuses_a_kv_cache_dtype_it_cannot_hold(capsys, tiny_cache):
    assert main(["serve", "--port", "0", "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype 'fp8' is not supported" in capsys.readouterr().err


# ------------------------------------------------- --device cuda:N under tensor parallelism


def test_rank_device_offsets_from_the_given_device():
    import torch

    from hybridserve.parallel.tensor_parallel import rank_device

    assert [rank_device(torch.device("cuda:1"), r, 2, 4) for r in (0, 1)] == \
        [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert rank_device(torch.device("cuda"), 1, 2, 2) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"needs cuda:3..cuda:4, but it has 4 CUDA device\(s\); give --device cuda:N with N <= 2"):
        rank_device(torch.device("cuda:3"), 0, 2, 4)
    with pytest.raises(ConfigError, match="lower --tensor-parallel-size"):
        rank_device(torch.device("cuda"), 0, 2, 1)


@pytest.fixture
def tp_config(tmp_path):
    from hybridserve.model.tiny import write_tiny_checkpoint

    return ModelConfig.from_json(write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=1))


class _SetDevice(Exception):
    pass


def test_torchrun_rank_takes_the_device_offset_by_local_rank(monkeypatch, tp_config):
    """Under torchrun, rank 1 of 2 with --device cuda:2 runs on cuda:3, not on
    cuda:LOCAL_RANK (= cuda:1, what it silently took before)."""
    import torch

    from hybridserve.parallel.tensor_parallel import TensorParallel

    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    chosen = []

    def set_device(d):
        chosen.append(torch.device(d))
        raise _SetDevice

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    args = EngineArgs(model="unused", device="cuda:2", tensor_parallel_size=2)
    with pytest.raises(_SetDevice):
        TensorParallel.start(args, tp_config, torch.device("cuda:2"))
    assert chosen == [torch.device("cuda", 3)]


def test_driver_refuses_a_device_range_the_host_lacks_before_starting_workers(monkeypatch, tp_config):
    import torch

    import hybridserve.parallel.tensor_parallel as tp_mod

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def no_workers(*a, **k):
        raise AssertionError("workers started for a device range the host lacks")

    monkeypatch.setattr(tp_mod, "WorkerLauncher", no_workers)
    args = EngineArgs(model="unused", device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--device cuda:1 with 2 tensor-parallel ranks"):
        tp_mod.TensorParallel.start(args, tp_config, torch.device("cuda:1"))
