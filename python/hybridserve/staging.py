"""One host->device copy per step: a host staging buffer and its device twin.

Every per-step index array (block-table updates, slot mapping, positions, copy lists,
sampler row indices, ...) is written into one int64 host buffer and copied to the
device with a single ``copy_``; the consumers get views of the device buffer. On CUDA
the host buffer is pinned, so the copy is truly asynchronous (``non_blocking=True`` on
pageable memory is a blocking copy through a bounce buffer).

Float values travel bit-cast (float32 bits in the low half of an int64), so one
buffer carries everything.

Reuse: the host buffer is rewritten at the next :meth:`StagingBuffer.stage`; before
that it waits for the event recorded after the previous copy (a host wait on a copy
that normally finished long ago, never a read of device data); the event is made
once and re-recorded.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def h2d_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The one host->device transfer of a staging buffer (a module function so that a
    test can count the calls through a recording shim)."""
    dst.copy_(src, non_blocking=True)


def float_bits(values) -> np.ndarray:
    """float32 values as int64 carrying their bits (see :func:`bits_float`)."""
    return np.asarray(values, dtype=np.float32).view(np.int32).astype(np.int64)


def bits_float(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float_bits` on the device: int64 view -> float32."""
    return t.to(torch.int32).view(torch.float32)


class StagingBuffer:
    """A growable int64 host buffer (pinned on CUDA) and its device twin."""

    def __init__(self, device: torch.device | str, capacity: int = 4096) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._event = None
        # The last stage's segment lengths and views: a steady decode batch stages
        # segments of the same lengths every step, and its views (the same slices of
        # the same buffer) are handed out again instead of being made anew (a tensor
        # per segment per step is a dozen-odd torch calls, each a few microseconds
        # once a forward has evicted their code and data).
        self._views_for: tuple[int, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)
        self.dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self._host_np = self.host.numpy()
        self._views_for = None

    def stage(self, segments: Sequence[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
        """Copy the concatenated ``segments`` to the device in one transfer; return one
        int64 device view per segment (valid until the next ``stage``; a stage of the
        same segment lengths returns the same view objects)."""
        # The segments as they come (int32 plan arrays, bools, int64): np.concatenate
        # casts them into the int64 buffer in one pass, no converted copy each.
        arrays = [a if a.ndim == 1 else a.reshape(-1)
                  for a in (s if isinstance(s, np.ndarray) else np.asarray(s, dtype=np.int64) for s in segments)]
        lens = tuple(a.size for a in arrays)
        total = sum(lens)
        if self._event is not None:
            self._event.synchronize()
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))
        same = lens == self._views_for
        if not same:
            views, at = [], 0
            for n in lens:
                views.append(self.dev[at : at + n])
                at += n
            self._views_for, self._views = lens, views
            self._whole = (self.dev[:total], self.host[:total])
        if total:
            np.concatenate(arrays, out=self._host_np[:total], casting="same_kind")
            h2d_copy(*self._whole)
            if self._pin:
                # One event, re-recorded each time (an event per step is an allocation
                # and a driver call for nothing).
                if self._event is None:
                    self._event = torch.cuda.Event()
                self._event.record()
        return list(self._views)


__all__ = ["StagingBuffer", "h2d_copy", "float_bits", "bits_float"]
