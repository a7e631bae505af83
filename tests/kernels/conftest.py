"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its
module is imported, so it must be set before any test module here imports one. The
interpreter runs programs one at a time on numpy and has no bfloat16 arithmetic:
tests use float32 (and float16) and small shapes.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


class PagedPool:
    """A stand-in arena for the state kernels: a pool view ``[num_pages, per_page, *item]``
    over one flat buffer with padding between pages (the page stride is not a multiple
    of the item), each sequence's items at a random permutation of pages, starting at
    ``item_base`` so that a layer's items straddle pages, and checkpoint rows on other
    pages. Item addresses are computed here with plain integer arithmetic, independent
    of :mod:`hybridserve.kernels.state_pages`."""

    def __init__(self, n_seqs, n_items, item_shape, gen, *, per_page=3, item_base=2, spare=3,
                 dtype=torch.float32, device="cpu"):
        self.n_items, self.item_shape, self.per_page, self.item_base = n_items, tuple(item_shape), per_page, item_base
        self.item_len = math.prod(item_shape)
        self.page_stride = per_page * self.item_len + 5
        self.cols = -(-(item_base + n_items) // per_page) + 1  # one column this layer never reads
        self.num_pages = 2 * n_seqs * self.cols + spare
        self.buf = torch.randn(self.num_pages * self.page_stride, generator=gen).to(dtype).to(device)
        perm = torch.randperm(self.num_pages, generator=gen)
        n = n_seqs * self.cols
        self.table = perm[:n].view(n_seqs, self.cols).to(torch.int32).to(device)
        self.ck_table = perm[n:2 * n].view(n_seqs, self.cols).to(torch.int32).to(device)

    @property
    def pool(self) -> torch.Tensor:
        strides, acc = [], 1
        for d in reversed(self.item_shape):
            strides.insert(0, acc)
            acc *= d
        return self.buf.as_strided((self.num_pages, self.per_page, *self.item_shape),
                                   (self.page_stride, self.item_len, *strides))

    def clone(self) -> "PagedPool":
        other = object.__new__(PagedPool)
        other.__dict__.update(self.__dict__)
        other.buf = self.buf.clone()
        return other

    def _flat(self, b, h, checkpoint=False):
        table = (self.ck_table if checkpoint else self.table).tolist()
        i = self.item_base + h
        start = table[b][i // self.per_page] * self.page_stride + (i % self.per_page) * self.item_len
        return slice(start, start + self.item_len)

    def item(self, b, h, checkpoint=False) -> torch.Tensor:
        """A view of sequence ``b``'s item ``h`` (or of its checkpoint's)."""
        return self.buf[self._flat(b, h, checkpoint)].view(self.item_shape)

    def items(self, b, checkpoint=False) -> torch.Tensor:
        """``[n_items, *item]`` copy of sequence ``b``'s state (or checkpoint)."""
        return torch.stack([self.item(b, h, checkpoint) for h in range(self.n_items)])

    def set_items(self, b, value, checkpoint=False) -> None:
        for h in range(self.n_items):
            self.item(b, h, checkpoint).copy_(value[h])

    def nan_fill(self, fresh, checkpoints=()) -> None:
        """Fresh sequences' items and the asked-for checkpoints' items hold NaN: a kernel
        that read them would poison its output."""
        for b in fresh:
            self.set_items(b, torch.full((self.n_items, *self.item_shape), float("nan")))
        for b in checkpoints:
            self.set_items(b, torch.full((self.n_items, *self.item_shape), float("nan")), checkpoint=True)


@pytest.fixture
def paged_pool():
    return PagedPool
