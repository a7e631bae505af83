"""CPU memory advised for transparent huge pages, and the weight moves built on it.

Large weights that a few-row GEMM streams whole at every decode step (dense
projections, the LM head, the MoE experts) are kept in anonymous mappings advised
``MADV_HUGEPAGE``: with 4 KiB pages the TLB misses and the hardware prefetcher's stop
at every page boundary cost measurable time (see each function).
"""

from __future__ import annotations

import mmap

import torch


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised CPU tensor in a fresh anonymous mapping advised for transparent
    huge pages (``MADV_HUGEPAGE``: the kernel backs it with 2 MiB pages as it is first
    written), or None where the platform has no such advice. The tensor keeps the
    mapping alive; freeing the tensor unmaps it."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # Private: a shared anonymous mapping is shmem, which THP's madvise mode skips.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled: plain pages are still correct
        pass
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def huge_page_copy(w: torch.Tensor) -> torch.Tensor:
    """``w`` (C-contiguous) moved, past a few MiB on the CPU, into memory advised for
    transparent huge pages: a one-row GEMM streams the whole weight, and with 4 KiB
    pages it takes a TLB miss every 64 lines (measured 1.0-1.4x faster in huge pages
    at one row, float32, benches/gemv.py). The old storage is freed when the caller
    rebinds the parameter, so this is a move, not a second copy."""
    if w.device.type == "cpu" and w.is_contiguous() and w.numel() * w.element_size() >= 4 << 20:
        new = huge_page_empty(tuple(w.shape), w.dtype)
        if new is not None:
            new.copy_(w)
            return new
    return w


def transposed_copy(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the same values and shape, stored transposed; on the CPU, past a few
    MiB, in memory advised for transparent huge pages: the few-row GEMM reads a strip
    of the weight one line per weight row, 4 x out bytes apart, so with 4 KiB pages
    nearly every line is a TLB miss at the LM head's widths (the MoE experts' memory,
    :func:`huge_page_empty`, for the same reason)."""
    if w.device.type == "cpu" and w.numel() * w.element_size() >= 4 << 20:
        new = huge_page_empty((w.shape[1], w.shape[0]), w.dtype)
        if new is not None:
            new.copy_(w.t())
            return new.t()
    return w.t().contiguous().t()
