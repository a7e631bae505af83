"""The CPU draw as one native call: :func:`hybridserve._core.kernels.sample_rows`.

On the CPU the torch path (:mod:`~hybridserve.sampler.processors` then
:mod:`~hybridserve.sampler.draw`) is a chain of a few dozen torch ops over the step's
``[samples, vocab]`` work buffer, each costing microseconds of dispatch whatever its
size. The native kernel runs the same processors, cuts and draw row by row in one
reused buffer (the same numbers: see ``rust/kernels/src/sample.rs``), reading each
sample's parameters from :class:`~hybridserve.sampler.rows.RowTables`' persistent
tables in place and doing the draw's bookkeeping there (seeded streams' offsets,
penalty counts).

What a call needs besides the tables is a few per-sample arrays
(:class:`NativeRows`): made once per plan with numpy, and reused as long as the plan
is (a steady batch's plan is). The torch path stays the GPU's and the oracle; rows
that ask for ``"processed"`` logprobs (which read the processed work buffer) take it
on the CPU too. Raw logprobs (the default) read the logits themselves and are
computed by :func:`~hybridserve.sampler.draw.logprob_parts` after the draw.

Constrained decoding's token masks can ride along (``mask``): the kernel reads a
masked sample's row as if the mask had been applied to the logits first, in the pass
it makes over the row anyway, so the mask costs no pass of its own (see
:meth:`~hybridserve.sampler.batch_sampler.Sampler.fuse_token_mask`).

Unseeded samples draw from a splitmix64 stream keyed by one 63-bit number per call
taken from torch's global generator (so ``torch.manual_seed`` still makes a run
repeatable), not from ``torch.Tensor.exponential_``.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridserve._core import kernels as _kernels
from hybridserve.sampler.rows import Prepared, RowTables

GREEDY, SEEDED, UNSEEDED = 0, 1, 2


class NativeRows:
    """One plan's per-sample arrays for the kernel (all contiguous numpy)."""

    __slots__ = ("row_of", "slots", "kinds", "pslots", "biased", "ban_samples", "ban_tokens", "any_unseeded")

    def __init__(self, prep: Prepared, ban_samples, ban_tokens) -> None:
        n = len(prep.samples)
        self.slots = np.asarray(prep.slot_ids, dtype=np.int64)
        self.row_of = (np.asarray([smp.row for smp in prep.samples], dtype=np.int64) if prep.expand
                       else np.arange(n, dtype=np.int64))
        kinds = np.zeros(n, dtype=np.uint8)
        if prep.rand:
            rand = np.asarray(prep.rand, dtype=np.int64)
            if prep.seeded:
                kinds[rand[np.asarray(prep.seeded, dtype=np.int64)]] = SEEDED
            if prep.unseeded:
                kinds[rand[np.asarray(prep.unseeded, dtype=np.int64)]] = UNSEEDED
        self.kinds = kinds
        self.any_unseeded = bool(prep.unseeded)
        pslots = np.full(n, -1, dtype=np.int64)
        if prep.pen:
            pslots[np.asarray(prep.pen, dtype=np.int64)] = np.asarray(prep.pen_pslots, dtype=np.int64)
        self.pslots = pslots
        biased = np.zeros(n, dtype=np.uint8)
        if prep.bias:
            biased[np.asarray(prep.bias, dtype=np.int64)] = 1
        self.biased = biased
        self.ban_samples = np.asarray(ban_samples, dtype=np.int64)
        self.ban_tokens = np.asarray(ban_tokens, dtype=np.int64)


def native_rows(prep: Prepared) -> NativeRows:
    """The kernel's arrays of a freshly planned ``prep`` (before its segments are
    staged: the min_tokens bans are read from them)."""
    segs = prep.segments
    return NativeRows(prep, segs[14], segs[15])


def logits_view(logits: torch.Tensor) -> np.ndarray:
    """The logits as the kernel reads them: float32 or bfloat16 bits, rows with unit
    column stride (any other dtype converted to float32 first, as the torch path's
    work buffer is)."""
    src = logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.to(torch.float32)
    if src.stride(-1) != 1 or (src.shape[0] > 1 and src.stride(0) < src.shape[1]):
        src = src.contiguous()  # e.g. an expanded row (stride 0)
    if src.dtype == torch.bfloat16:
        src = src.view(torch.uint16)
    return src.detach().numpy()


def mask_arg(prep: Prepared, bitmask: torch.Tensor, rows, vocab: int) -> tuple:
    """The kernel's ``mask`` argument: logits rows ``rows`` (ascending, distinct) of
    ``prep`` masked by the same rows of ``bitmask`` (int32 ``[>= rows, words]``,
    xgrammar's layout), tokens ``< vocab``."""
    nr: NativeRows = prep.native
    if len(rows) == prep.num_rows and rows[0] == 0 and rows[-1] == len(rows) - 1:
        # Every row masked (rows ascending and distinct): each by its own bitmask row.
        return bitmask.numpy(), nr.row_of, int(vocab)
    by_row = np.full(prep.num_rows, -1, dtype=np.int64)
    at = np.asarray(rows, dtype=np.int64)
    by_row[at] = at
    return bitmask.numpy(), by_row[nr.row_of], int(vocab)


def draw(logits: torch.Tensor, prep: Prepared, t: RowTables, processed: np.ndarray | None = None,
         advance: bool = True, mask: tuple | None = None) -> np.ndarray:
    """int64 ``[samples]`` tokens of ``prep`` drawn by the kernel; with ``advance`` the
    seeded streams' device offsets and the penalty counts move on (the host mirrors
    are the caller's). ``processed`` (float32 ``[samples, vocab]``) receives the
    processed logits. ``mask``: :func:`mask_arg`'s token masks, applied in the draw."""
    nr: NativeRows = prep.native
    key = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)) if nr.any_unseeded else 0
    tokens = np.empty(len(nr.slots), dtype=np.int64)
    _kernels.sample_rows(
        logits_view(logits), nr.row_of, nr.slots, nr.kinds, nr.pslots, nr.biased, nr.ban_samples,
        nr.ban_tokens, key, t.fp.numpy(), t.ip.numpy(), t.counts.numpy(),
        t.prompt_seen.numpy().view(np.uint8), t.bias_tok.numpy(), t.bias_val.numpy(), tokens, processed,
        advance, mask,
    )
    return tokens


class PendingMirrors:
    """The host mirrors of a run of steady steps, settled at once.

    On a steady step (the engine's batch unchanged) the per-row host records of the
    draw (each seeded stream's offset, each penalty row's counted length and last
    token) are not touched: the step adds one to a counter and keeps its tokens, and
    :meth:`settle` brings every record up to date (adding the step count, so a
    caller's own move of a stream is kept) before anything reads them."""

    __slots__ = ("prep", "steps", "last")

    def __init__(self) -> None:
        self.prep: Prepared | None = None
        self.steps = 0
        self.last: np.ndarray | None = None

    def add(self, prep: Prepared, tokens: np.ndarray) -> None:
        if self.prep is not prep:
            self.settle()
            self.prep = prep
        self.steps += 1
        self.last = tokens

    def settle(self) -> None:
        prep, n = self.prep, self.steps
        self.prep, self.steps = None, 0
        if prep is None or n == 0:
            return
        samples = prep.samples
        for j in prep.seeded:
            smp = samples[prep.rand[j]]
            smp.stream.offset += n
            smp.slot.offset += n
        if prep.pen:
            last = self.last.tolist()
            for s in prep.pen:
                slot = samples[s].slot
                slot.counted += n
                slot.last_tok = last[s]
        self.last = None


__all__ = ["NativeRows", "native_rows", "draw", "mask_arg", "logits_view", "PendingMirrors"]
