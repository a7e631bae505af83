"""Where an engine runs: its device, its model's dtype, and on the CPU how many
threads torch and the native kernels use (for the model call and for the host work
around it)."""

from __future__ import annotations

import logging
import os

import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.model.cache import resolve_dtype


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted
    once: a second hyperthread adds little to GEMMs and contends for the same core)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                cores.add((f.read().strip(), core))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op thread count and the native kernels' (``requested``, else the
    physical cores) and return it."""
    from hybridserve.kernels import native

    n = requested or physical_cores()
    torch.set_num_threads(n)
    native.set_threads(n)  # the native CPU kernels' pool, the same size
    return torch.get_num_threads()


def cpu_native_bf16() -> str | None:
    """The CPU feature that gives it native bfloat16 arithmetic (``amx_bf16``,
    ``avx512_bf16``, or Arm's ``bf16``), from /proc/cpuinfo; None if it has none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            words = set()
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    words.update(line.split(":", 1)[1].split())
    except OSError:
        return None
    for feature in ("amx_bf16", "avx512_bf16", "bf16"):
        if feature in words:
            return feature
    return None


def auto_dtype(config: ModelConfig, device: torch.device, native_bf16: str | None = None) -> tuple[torch.dtype, str]:
    """``dtype="auto"``: the dtype and the reason, for the start-up line. On CUDA the
    checkpoint's ``torch_dtype``; on a CPU (as vLLM's CPU backend) a bfloat16 checkpoint
    stays bfloat16 where the CPU has native bfloat16 (``native_bf16``, the feature),
    and anything else is float32: without it bfloat16 matmuls are emulated, slow and
    no more exact, and float16 is slow on every CPU."""
    if device.type == "cuda":
        ckpt = resolve_dtype(config.torch_dtype)
        return ckpt, f"the checkpoint's torch_dtype ({config.torch_dtype}) on CUDA"
    try:
        ckpt = resolve_dtype(config.torch_dtype)
    except ConfigError:
        ckpt = torch.float32
    if ckpt == torch.bfloat16 and native_bf16:
        return ckpt, f"the checkpoint's torch_dtype; this CPU has native bfloat16 ({native_bf16})"
    if ckpt == torch.bfloat16:
        return torch.float32, ("float32 on a CPU without native bfloat16 (no amx_bf16, avx512_bf16 or bf16 "
                               "flag); the checkpoint's bfloat16 would be emulated")
    return torch.float32, f"float32 on the CPU (the checkpoint is {config.torch_dtype})"


def _resolve_model_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        resolved, why = auto_dtype(config, device, cpu_native_bf16() if device.type == "cpu" else None)
        logging.getLogger("hybridserve.engine").info(
            "dtype: %s (auto: %s)", str(resolved).removeprefix("torch."), why)
        return resolved
    return resolve_dtype(dtype)


# Where the host memory reading may be replaced (tests, or an operator sharing a machine):
# a size such as 8GiB that available_memory_bytes() reports instead of measuring.
AVAILABLE_MEMORY_ENV = "HYBRIDSERVE_AVAILABLE_MEMORY"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) is not a number


def available_memory_bytes() -> tuple[int, str]:
    """Host memory this process can still take, and where the number comes from: the
    kernel's MemAvailable, lowered to the room left under the cgroup's memory limit (a
    container's limit is often far below the host's memory)."""
    override = os.environ.get(AVAILABLE_MEMORY_ENV)
    if override:
        from hybridserve.planner import parse_size

        return parse_size(override), f"${AVAILABLE_MEMORY_ENV}"
    avail, source = None, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "free pages"
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < (1 << 60) and limit - usage < avail:
            avail, source = max(0, limit - usage), "the cgroup's memory limit less its usage"
            break
    return avail, source


# A CPU engine's host work (the sampler's ops, the staging copy) runs its torch ops on
# one thread when the largest of them, the [max_num_seqs, vocab] logits, has fewer
# elements than this; the model call keeps the engine's thread count. Torch forks its
# intra-op pool for any op past 32K elements: for an op of a few hundred microseconds
# at most, the fork and join cost more than they save, and on a loaded machine the
# op waits for the second thread to get a core (the bench model's seeded sampler:
# 10 -> 100 us per sequence with 2 threads while another process held one of the
# two cores), while the workers' spin after the region takes the core the engine's
# Python (and the event loop's) would use.
HOST_PARALLEL_MIN_ELEMENTS = 1 << 18
