"""The batched sampler: one token per sample from a step's logits.

It ties the parts together: :mod:`~hybridserve.sampler.rows` stages each call's rows
and keeps their device state, :mod:`~hybridserve.sampler.processors` turns the logits
into what each sample is drawn from (in one float32 work buffer),
:mod:`~hybridserve.sampler.draw` draws and computes logprobs, and
:mod:`~hybridserve.sampler.streams` provides the seeded noise.

Memory per call: the logits, one float32 ``[samples, vocab]`` work buffer, and
column-sliced temporaries (see :data:`~hybridserve.sampler.processors.SLICE_BYTES`;
the candidate draw of :func:`~hybridserve.sampler.draw.race_top_k` works in row
blocks of the same bound);
a batch whose rows are all greedy, with no bias, ban or penalty, is an argmax of the
logits themselves (no copy at all). Host->device: one staging copy (in the engine, the
runner's copy of the step carries it: :meth:`Sampler.plan` then
:meth:`Sampler.sample_planned`); device->host: one copy of the tokens (and the
logprobs when asked).

On the CPU a sampler made with ``native=True`` (the engine's, on a CPU device) draws
with one native call per step instead (:mod:`~hybridserve.sampler.native`: the same
tokens for the same seeds, the torch path being its oracle); with ``steady_rows=True``
a steady decode batch's step also skips every per-row host step (see
:class:`Sampler`).

Constrained decoding's token masks: the engine applies them to the logits before the
draw; a native sampler takes them into its draw instead
(:meth:`Sampler.fuse_token_mask`), which saves a pass over every masked row.

Logprobs: by default (``logprobs_mode="raw"``, vLLM v1's default) the reported numbers
are ``log_softmax`` of the model's logits before any processing; ``"processed"``
reports ``log_softmax`` of the logits after processing (for greedy rows, after
bias, bans and penalties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from hybridserve.sampler import native as native_draw
from hybridserve.sampler.draw import logprob_parts, race, race_top_k
from hybridserve.sampler.processors import cut_top_k_top_p, process
from hybridserve.sampler.rows import Prepared, RowTables, SamplingRow, check_logits


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64): on the CPU through numpy, whose SIMD argmax is
    ~13x faster than torch's at ``[16, 151,936]`` float32 (0.15 vs 2-4 ms, 1 thread:
    2% of a float32 decode step); the same first-maximum rule for ties and NaN."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    """The tokens drawn for a batch of rows.

    ``token_ids`` holds ``num_samples`` tokens per row, rows in order, a row's samples
    in sample order. ``logprobs`` (the chosen tokens' logprobs), ``ranks`` (1 = the most
    likely token) and ``top_logprobs`` (per chosen token, the ``params.logprobs`` most
    likely (token_id, logprob) pairs in descending order; empty for rows that did not
    ask) are None when no row asked for logprobs.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Draws one token per sample from a step's logits, keeping per-row state on the
    device across steps (see :mod:`hybridserve.sampler.rows`).

    ``native``: logits on the CPU are drawn by the native kernel
    (:mod:`~hybridserve.sampler.native`) unless the call wants ``"processed"``
    logprobs; the torch path otherwise. ``steady_rows`` (with ``native``) is a
    caller's promise, the engine's: when :meth:`plan` gets the very list object of
    the previous plan again, and that plan was sampled, the rows are the same rows
    with nothing changed except that each row's ``output_token_ids`` grew by the
    token drawn for it. Such a call reuses the plan as it is: no per-row host work,
    nothing staged, and the per-row host records settled only when the batch
    changes (:class:`~hybridserve.sampler.native.PendingMirrors`).
    """

    def __init__(self, logprobs_mode: str = "raw", native: bool = False, steady_rows: bool = False) -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self._tables = RowTables()
        self.native = native
        self.steady_rows = steady_rows and native
        # (rows list, prep, device) of the plan a steady caller may pass again.
        self._steady: tuple | None = None
        # (rows list, prep) of the last plan, until it is sampled or discarded.
        self._planned: tuple | None = None
        self._pending = native_draw.PendingMirrors()
        # The last plan until it is sampled or discarded, and a token mask offered for
        # its draw (fuse_token_mask): (logits, bitmask, rows, vocab).
        self._next_prep: Prepared | None = None
        self._mask: tuple | None = None

    def _settle(self) -> None:
        """Ends any steady run: the host records brought up to date, the plan dropped."""
        self._pending.settle()
        if self._steady is not None:
            self._steady[1].steady = False
            self._steady = None

    @property
    def num_recounts(self) -> int:
        """Penalty rows rebuilt from their history (new rows, or a history that no
        longer matches the running counts): a test hook and a health signal."""
        return self._tables.num_recounts

    def release(self, key: Hashable) -> None:
        """Forget the row ``key`` (its request finished or was aborted); unknown keys are
        ignored, so releasing twice is harmless."""
        self._settle()
        self._tables.release(key)

    @property
    def num_tracked_rows(self) -> int:
        """Rows with a slot kept across steps (for tests and leak checks)."""
        return len(self._tables.slots)

    # ------------------------------------------------------------------ preparing
    def _plan(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device | str) -> Prepared:
        prep = self._tables.plan(rows, vocab, device)
        if self.native and prep.native is None and self._tables.device.type == "cpu":
            prep.native = native_draw.native_rows(prep)
        return prep

    def _prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Prepared:
        """:meth:`_plan` and the tables' bind with this call's own staging copy."""
        self._settle()
        check_logits(logits, len(rows))
        prep = self._plan(rows, logits.shape[1], logits.device)
        try:
            self._tables.bind(prep, self._tables.stage.stage(prep.segments))
        except BaseException:
            self._tables.finish(prep)
            raise
        return prep

    def _goes_native(self, logits: torch.Tensor, prep: Prepared) -> bool:
        return (prep.native is not None and logits.device.type == "cpu"
                and not (prep.want_logprobs and self.logprobs_mode == "processed"))

    # ------------------------------------------------------------------ processing
    def _work_buffer(self, logits: torch.Tensor, prep: Prepared) -> torch.Tensor:
        if prep.expand:
            return logits.index_select(0, prep.v["row_of"]).to(torch.float32)
        return logits.to(torch.float32, copy=True)

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits each sample is drawn from, float32 ``[num_samples_total, V]``.

        Greedy samples get bias, bans and penalties (their argmax is the token); the
        others every step of :mod:`~hybridserve.sampler.processors` (dropped tokens are
        -inf). ``logits`` is ``[len(rows), V]`` and is not modified; no stream or count
        advances. A native sampler computes them with its kernel.
        """
        prep = self._prepare(logits, rows)
        try:
            if self._goes_native(logits, prep):
                out = np.empty((len(prep.samples), logits.shape[1]), dtype=np.float32)
                native_draw.draw(logits, prep, self._tables, processed=out, advance=False)
                return torch.from_numpy(out)
            x = self._work_buffer(logits, prep)
            process(x, prep, self._tables)
            return x
        finally:
            self._tables.finish(prep)

    # ------------------------------------------------------------------ sampling
    def plan(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device | str) -> Prepared:
        """The host side of a call, before the logits exist: ``prep.segments`` are the
        index lists to send to the device (None: nothing to send). The engine stages
        them with the runner's inputs (one host->device copy per step) and passes the
        views to :meth:`sample_planned`."""
        if self._planned is not None:
            self._settle()  # the last plan was neither sampled nor discarded: no reuse
        self._mask = None
        prep = self._plan_rows(rows, vocab, device)
        self._next_prep = prep
        return prep

    def _plan_rows(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device | str) -> Prepared:
        st = self._steady
        if st is not None and st[0] is rows and st[1].vocab == vocab and st[2] == device:
            self._planned = st
            return st[1]  # a steady batch's step (see steady_rows)
        self._settle()
        prep = self._plan(rows, vocab, device)
        self._planned = (rows, prep, device) if self.steady_rows else None
        return prep

    def sample_planned(self, logits: torch.Tensor, prep: Prepared,
                       views: Sequence[torch.Tensor] | None = None) -> SamplerOutput:
        """Draws for a :meth:`plan`: ``views`` are the device views of its segments
        (None: this call stages them itself)."""
        planned, self._planned = self._planned, None
        self._next_prep = None
        try:
            check_logits(logits, prep.num_rows, prep.vocab)
            if not prep.steady:
                self._tables.bind(prep, views if views is not None else self._tables.stage.stage(prep.segments))
            out = self._sample(logits, prep)
        except BaseException:
            self._settle()
            raise
        finally:
            self._tables.finish(prep)
        if (planned is not None and planned[1] is prep and not prep.steady and prep.native is not None
                and self._goes_native(logits, prep) and not (prep.ephemeral or prep.bans or prep.expand)):
            # The next step of a steady caller may pass the same rows again.
            prep.steady = True
            self._steady = planned
        return out

    def discard(self, prep: Prepared) -> None:
        """Releases a :meth:`plan` that will not be sampled (its one-call slots)."""
        self._planned = None
        self._next_prep = self._mask = None
        self._settle()
        self._tables.finish(prep)

    def fuse_token_mask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab: int) -> bool:
        """Offers constrained decoding's token masks for the draw of the planned step
        (:meth:`plan`, then :meth:`sample_planned` of ``logits``): logits rows ``rows``
        (ascending, distinct) masked by the same rows of ``bitmask`` (int32 ``[>= rows, words]`` on
        the CPU, xgrammar's layout; tokens ``< vocab``). True: the native kernel will
        apply them in its draw, as if they had been applied to ``logits`` first (the same
        tokens, streams and counts), and ``bitmask`` must stay as it is until then.
        False: this draw cannot take them (not native, or logprobs asked for, which are
        computed from the masked logits), and the caller applies them to ``logits``."""
        prep = self._next_prep
        if (prep is None or not self._goes_native(logits, prep) or prep.want_logprobs
                or bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2
                or not bitmask.is_contiguous() or logits.shape[0] != prep.num_rows):
            return False
        self._mask = (logits, bitmask, list(rows), int(vocab))
        return True

    def _take_mask(self, logits: torch.Tensor, prep: Prepared) -> tuple | None:
        """The kernel's mask argument of a fused token mask offered for this draw."""
        m, self._mask = self._mask, None
        if m is None:
            return None
        if m[0] is not logits or not self._goes_native(logits, prep):
            # Offered for other logits (not expected): applied to them as promised.
            from hybridserve.structured.engine_hook import apply_bitmask

            apply_bitmask(m[0], m[1][: m[0].shape[0]], m[2], m[3])
            return None
        return native_draw.mask_arg(prep, m[1], m[2], m[3])

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Draw ``rows[i].num_samples`` tokens from ``logits[i]`` for every row.

        ``logits`` is ``[len(rows), V]`` of any float dtype. It is not modified. Seeded
        rows' streams advance by one draw; keyed rows' device state is kept.
        """
        if not rows:
            return SamplerOutput(token_ids=[])
        prep = self._prepare(logits, rows)
        try:
            return self._sample(logits, prep)
        finally:
            self._tables.finish(prep)

    def _candidates_only(self, x: torch.Tensor, prep: Prepared) -> bool:
        """Whether the draw works on each sampled row's top-k list (see
        :func:`~hybridserve.sampler.draw.race_top_k`): every sampled row has a small
        top_k, nothing reads the cut buffer (processed logprobs), and the buffer is on
        the CPU, where the list's one host read (a tie check) costs nothing; on a GPU
        that read would be a sync inside the step, and the whole-row stages are
        device work there, not host work."""
        return (prep.all_top_k and x.device.type == "cpu" and max(prep.top_ks) <= x.shape[1] // 4
                and not (prep.want_logprobs and self.logprobs_mode == "processed"))

    def _draw_torch(self, logits: torch.Tensor, prep: Prepared) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The torch path's tokens (int64 ``[samples]``) and its work buffer (None for an
        argmax of the logits themselves); counts and streams advanced on the device."""
        t = self._tables
        v = prep.v
        x = None
        if prep.all_greedy and prep.untouched:
            # The argmax of the logits themselves: no copy, no float conversion (the
            # conversion is exact and monotonic, so the token is the same).
            tokens = _argmax_rows(logits)
            if prep.expand:
                tokens = tokens.index_select(0, v["row_of"])
        else:
            x = self._work_buffer(logits, prep)
            drawn = None
            if self._candidates_only(x, prep):
                process(x, prep, t, cut=False)
                fp = t.fp.index_select(0, v["slots"])
                drawn = race_top_k(x, prep, t, fp)
                if drawn is None:
                    cut_top_k_top_p(x, prep, t, fp)
            else:
                process(x, prep, t)
            if len(prep.rand) == x.shape[0] and drawn is not None:
                tokens = drawn
            else:
                tokens = _argmax_rows(x)
                if prep.rand:
                    tokens.index_copy_(0, v["rand"], drawn if drawn is not None else race(x, prep, t))
        if prep.pen:
            t.counts.index_put_(
                (v["pen_pslots"], tokens.index_select(0, v["pen"])),
                torch.ones(len(prep.pen), dtype=torch.float32, device=tokens.device),
                accumulate=True,
            )
        return tokens, x

    def _sample(self, logits: torch.Tensor, prep: Prepared) -> SamplerOutput:
        x = None
        native_tokens = None
        mask = self._take_mask(logits, prep)
        if self._goes_native(logits, prep):
            if mask is None and prep.all_greedy and prep.untouched and logits.dtype == torch.float32:
                # numpy's SIMD argmax of the logits as they are (several times the
                # kernel's portable scan at a large vocabulary); nothing to advance.
                tokens = _argmax_rows(logits)
                if prep.expand:
                    tokens = tokens.index_select(0, torch.from_numpy(prep.native.row_of))
                native_tokens = tokens.numpy()
            else:
                native_tokens = native_draw.draw(logits, prep, self._tables, mask=mask)
                tokens = torch.from_numpy(native_tokens)
        else:
            tokens, x = self._draw_torch(logits, prep)

        samples = prep.samples
        if not prep.want_logprobs:
            token_ids = tokens.tolist()
        else:
            # Raw logprobs read the logits rows themselves (a fork row's samples
            # share one: no [samples, vocab] copy); processed ones the work buffer.
            raw = self.logprobs_mode == "raw" or x is None
            if raw and prep.expand:
                row_of = prep.v["row_of"] if native_tokens is None else torch.from_numpy(prep.native.row_of)
            else:
                row_of = None
            source = logits if raw else x
            ks = [smp.params.logprobs or 0 for smp in samples]
            kmax = max(ks)
            # One device->host transfer for everything the step returns.
            flat = torch.cat(logprob_parts(source, tokens, ks, row_of)).tolist()
            num = len(samples)
            token_ids = [int(tok) for tok in flat[:num]]
            chosen_l = flat[num : 2 * num]
            ranks_l = [int(r) for r in flat[2 * num : 3 * num]]
            top: list[list[tuple[int, float]]] = [[] for _ in ks]
            if kmax > 0:
                ti = flat[3 * num : 3 * num + num * kmax]
                tv = flat[3 * num + num * kmax :]
                for s, k in enumerate(ks):
                    top[s] = [(int(ti[s * kmax + j]), tv[s * kmax + j]) for j in range(k)]

        if prep.steady:
            # A steady step: the host records wait (see PendingMirrors).
            self._pending.add(prep, native_tokens)
        else:
            self._mirror(prep, token_ids)
        if not prep.want_logprobs:
            return SamplerOutput(token_ids=token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen_l, ranks=ranks_l, top_logprobs=top)

    @staticmethod
    def _mirror(prep: Prepared, token_ids: list[int]) -> None:
        """Host mirrors of what the device just did (one pass when every sample is a
        seeded penalty row, the usual sampled batch)."""
        samples = prep.samples
        n = len(samples)
        if len(prep.seeded) == n and len(prep.pen) == n:
            for smp, tok in zip(samples, token_ids):
                slot = smp.slot
                smp.stream.offset += 1
                slot.offset += 1
                slot.counted += 1
                slot.last_tok = tok
        else:
            for j in prep.seeded:
                smp = samples[prep.rand[j]]
                smp.stream.offset += 1
                smp.slot.offset += 1
            for s in prep.pen:
                slot = samples[s].slot
                slot.counted += 1
                slot.last_tok = token_ids[s]


__all__ = ["Sampler", "SamplerOutput"]
