"""Where an engine runs: its device, its model's dtype, and on the CPU how many
threads torch and the native kernels use (for the model call and for the host work
around it)."""

from __future__ import annotations

import os

import torch

from hybridserve.config import ModelConfig
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


def _resolve_model_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 matmuls on CPU are slow and inexact; the CPU path serves float32.
        return resolve_dtype(config.torch_dtype) if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype)


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
