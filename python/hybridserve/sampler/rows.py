"""Row preparation: what each sample row needs on the device, kept across steps.

Every sample row has a *slot* in persistent device tables of its parameters
(temperature, top-p/k, min-p, penalties, seed stream, logit bias). A row given a
``key`` (the engine uses ``(request_id, sample_index)``) keeps its slot across steps
and its parameters are written to the device only when the slot is created or the
row's parameters change; rows without a key get a slot for one call. Rows with
penalties keep running per-row token counts on the device (``[rows, vocab]``),
incremented with the sampled tokens; they are rebuilt from the row's
``output_token_ids`` only when the slot is new or the host's list no longer matches
what was counted (so a caller that rewrites a row's history is still right).

All per-call host->device data (row slots, changed parameters, positions of the rows
each stage applies to, min_tokens bans) goes in one staging copy: :meth:`RowTables.plan`
builds it on the host before the logits exist, so the engine sends it in the runner's
copy of the step, and :meth:`RowTables.bind` takes the device views; the decisions that
pick code paths (is any row seeded? the largest top_k?) are made from the host's own
copy of the parameters, so no device data is read before the tokens come back.

The steady state (a keyed row whose slot, parameters and stream are unchanged, no
min_tokens ban pending, counts up to date) costs a dictionary lookup and a few
comparisons per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from hybridserve.sampler.streams import SeedStream, signed64
from hybridserve.sampling import SamplingParams
from hybridserve.staging import StagingBuffer, bits_float, float_bits

# Columns of the float and int parameter tables.
F_TEMP, F_TOPP, F_MINP, F_PRES, F_FREQ, F_REP = range(6)
NF = 6
I_TOPK, I_KEY, I_OFF = range(3)
NI = 3


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits tensor and how to sample from it.

    ``num_samples`` > 1 only at the fork step of an n > 1 request: that many tokens
    are drawn independently from this row; each sample then uses its own stream, given
    as ``generators`` (one per sample, None for the global RNG). Otherwise a single
    ``generator`` (None: global RNG) is used. ``eos_token_id`` is needed only to
    enforce ``params.min_tokens``. ``key`` (or ``keys``, one per sample of a fork row)
    names the sample across steps so that the sampler keeps its device state; the
    caller ends it with :meth:`Sampler.release`.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: SeedStream | None = None
    num_samples: int = 1
    generators: Sequence[SeedStream | None] | None = None
    eos_token_id: int | None = None
    key: Hashable | None = None
    keys: Sequence[Hashable] | None = None

    def sample_generators(self) -> list[SeedStream | None]:
        """One stream (or None) per sample of this row."""
        if self.num_samples < 1:
            raise ValueError(f"SamplingRow.num_samples must be >= 1, got {self.num_samples}")
        if self.generators is not None:
            if self.generator is not None:
                raise ValueError("give SamplingRow either generator or generators, not both")
            if len(self.generators) != self.num_samples:
                raise ValueError(
                    f"SamplingRow.generators has {len(self.generators)} entries but "
                    f"num_samples={self.num_samples}; give one generator (or None) per sample"
                )
            return list(self.generators)
        if self.num_samples > 1 and self.generator is not None:
            raise ValueError(
                "a SamplingRow with num_samples > 1 needs generators=[...] (one per sample, "
                "e.g. make_generator(seed, i)), not a single shared generator"
            )
        return [self.generator] * self.num_samples

    def sample_keys(self) -> list[Hashable | None]:
        if self.keys is not None:
            if len(self.keys) != self.num_samples:
                raise ValueError(
                    f"SamplingRow.keys has {len(self.keys)} entries but num_samples={self.num_samples}"
                )
            return list(self.keys)
        if self.num_samples > 1 and self.key is not None:
            raise ValueError("a SamplingRow with num_samples > 1 needs keys=[...], one per sample")
        return [self.key] * self.num_samples


def check_logits(logits: torch.Tensor, num_rows: int, vocab: int | None = None) -> None:
    if logits.dim() != 2 or logits.shape[0] != num_rows or (vocab is not None and logits.shape[1] != vocab):
        want = f"[num_rows={num_rows}, {'vocab' if vocab is None else f'vocab={vocab}'}]"
        raise ValueError(f"logits must be {want}, got shape {tuple(logits.shape)}")


def check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    if len(ids) and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(
            f"{what} contain a token id outside [0, {vocab}) (the logits' vocabulary); "
            f"got range [{min(ids)}, {max(ids)}]"
        )


class Slot:
    """Host record of one row's device state (and the host's copy of its parameters)."""

    __slots__ = ("index", "params", "stream_key", "offset", "pslot", "counted", "last_tok", "greedy")

    def __init__(self, index: int) -> None:
        self.index = index
        self.params: SamplingParams | None = None
        self.stream_key: int | None = None
        self.offset = 0
        self.pslot = -1
        self.counted = -1  # output tokens in the device counts; -1: not built
        self.last_tok = -1
        self.greedy = True


class Sample:
    """One sample drawn this call: its logits row, parameters, stream and slot."""

    __slots__ = ("row", "params", "stream", "key", "src", "slot")

    def __init__(self, row: int, params: SamplingParams, stream: SeedStream | None, key: Hashable | None,
                 src: SamplingRow) -> None:
        self.row, self.params, self.stream, self.key, self.src = row, params, stream, key, src
        self.slot: Slot | None = None


@dataclass
class Prepared:
    """One call's samples and the device views of its staged index lists.

    ``pen``/``bias``/``topp``/``rand`` are positions in ``samples`` of the rows each
    stage applies to; ``seeded``/``unseeded`` are positions in ``rand``. ``top_ks`` and
    ``top_p_limits`` are the host's copy of the rows' top-k values (for code-path
    decisions), ``any_temp``/``any_min_p`` whether any sampled row needs that stage."""

    samples: list[Sample]
    ephemeral: list[Slot]
    v: dict[str, torch.Tensor]
    pen: list[int]
    bias: list[int]
    topp: list[int]
    rand: list[int]
    seeded: list[int]
    unseeded: list[int]
    expand: bool
    bans: bool
    want_logprobs: bool
    any_temp: bool
    any_min_p: bool
    top_ks: list[int]
    top_p_limits: list[int]
    # Index lists to stage (until bound), and the call's shape.
    segments: list | None = None
    num_rows: int = 0
    vocab: int = 0
    # Every sampled row has a top_k below the vocabulary (the draw may then work on
    # the top-k candidates only).
    all_top_k: bool = False
    # (first, end) when the penalty rows' count-table rows are consecutive, in order
    # (the penalties then read a slice of the tables, not a gather).
    pen_span: tuple[int, int] | None = None
    # Each sample's slot and each penalty row's count-table row (host lists, kept so
    # that the next call of a steady batch can stage them again).
    slot_ids: list[int] | None = None
    pen_pslots: list[int] | None = None
    # The steady batch's index lists as int64 arrays, made at its first reuse and
    # passed on (a list of 256 ints costs ~10 us to convert for the staging copy).
    steady_arrays: list | None = None
    # The native kernel's per-sample arrays (:class:`~hybridserve.sampler.native.NativeRows`),
    # made once per plan on a native sampler and passed on with the plan.
    native: object = None
    # Reused as is by a steady caller (no staging, no table writes, host mirrors
    # settled later: see Sampler's ``steady_rows``).
    steady: bool = False

    @property
    def all_greedy(self) -> bool:
        return not self.rand

    @property
    def untouched(self) -> bool:
        """No processor changes any greedy row's logits (argmax of the raw logits)."""
        return not (self.pen or self.bias or self.bans)


_STAGED = ("slots", "row_of", "chg_slots", "chg_f", "chg_i", "bias_slots", "bias_tok", "bias_val",
           "rc_pslots", "rc_rows", "rc_toks", "pm_pslots", "pm_rows", "pm_toks", "ban_rows", "ban_toks",
           "pen", "pen_pslots", "bias", "topp", "rand", "seeded", "unseeded")


class RowTables:
    """The persistent device tables of every row's parameters, counts and biases."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.vocab = 0
        self.slots: dict[Hashable, Slot] = {}
        # Penalty rows rebuilt from their history (new rows, or a history that no
        # longer matches the running counts): a test hook and a health signal.
        self.num_recounts = 0

    def reset(self, device: torch.device, vocab: int) -> None:
        """(Re)build the tables for a device/vocabulary (first call, or a change)."""
        self.device, self.vocab = device, vocab
        self.slots.clear()
        self._last: tuple | None = None
        self._free: list[int] = []
        self._cap = 0
        self._pfree: list[int] = []
        self._pcap = 0
        self.bias_width = 0
        self.fp = torch.zeros(0, NF, dtype=torch.float32, device=device)
        self.ip = torch.zeros(0, NI, dtype=torch.int64, device=device)
        self.bias_tok = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.bias_val = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.stage = StagingBuffer(device)
        self.neg_inf = torch.full((), float("-inf"), device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)

    @staticmethod
    def _grow_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
        new = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        new[: t.shape[0]] = t
        return new

    def _new_slot(self) -> Slot:
        if not self._free:
            cap = max(16, 2 * self._cap)
            self.fp = self._grow_rows(self.fp, cap)
            self.ip = self._grow_rows(self.ip, cap)
            if self.bias_width:
                self.bias_tok = self._grow_rows(self.bias_tok, cap)
                self.bias_val = self._grow_rows(self.bias_val, cap)
            self._free = list(range(cap - 1, self._cap - 1, -1))
            self._cap = cap
        return Slot(self._free.pop())

    def _new_pslot(self) -> int:
        if not self._pfree:
            cap = max(4, 2 * self._pcap)
            self.counts = self._grow_rows(self.counts, cap)
            self.prompt_seen = self._grow_rows(self.prompt_seen, cap)
            self._pfree = list(range(cap - 1, self._pcap - 1, -1))
            self._pcap = cap
        return self._pfree.pop()

    def _ensure_bias_width(self, width: int) -> None:
        if width <= self.bias_width:
            return
        width = max(width, 2 * self.bias_width, 8)
        tok = torch.zeros(self._cap, width, dtype=torch.int64, device=self.device)
        val = torch.zeros(self._cap, width, dtype=torch.float32, device=self.device)
        if self.bias_width:
            tok[:, : self.bias_width] = self.bias_tok
            val[:, : self.bias_width] = self.bias_val
        self.bias_tok, self.bias_val, self.bias_width = tok, val, width

    def drop(self, slot: Slot) -> None:
        if slot.pslot >= 0:
            self._pfree.append(slot.pslot)
            slot.pslot = -1
        self._free.append(slot.index)

    def release(self, key: Hashable) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.drop(slot)

    # ------------------------------------------------------------------ preparing
    def prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Prepared:
        """:meth:`plan` and :meth:`bind` with this call's own staging copy."""
        check_logits(logits, len(rows))
        prep = self.plan(rows, logits.shape[1], logits.device)
        try:
            self.bind(prep, self.stage.stage(prep.segments))
        except BaseException:
            self.finish(prep)
            raise
        return prep

    def _plan_steady(self, rows: Sequence[SamplingRow]) -> Prepared | None:
        """The last call's plan again, when nothing about it can have changed: the same
        row objects in the same order, each with the same parameters, stream, key and
        kept slot, its stream and counts exactly where the device's are (one draw and
        one counted token later), and no min_tokens ban pending; None otherwise (the
        full :meth:`plan` then runs). A decode step of a steady batch is such a call:
        this costs a few attribute reads per row instead of the full row preparation."""
        last = self._last
        if last is None:
            return None
        last_rows, lp = last
        if len(rows) != len(last_rows) or lp.expand:
            return None
        for a, b in zip(rows, last_rows):
            if a is not b:
                return None
        slots = self.slots
        for smp in lp.samples:
            row, slot = smp.src, smp.slot
            p, stream = row.params, row.generator
            if (p is not smp.params or stream is not smp.stream or row.key is not smp.key
                    or slots.get(smp.key) is not slot or slot.params is not p):
                return None
            if stream is not None and (stream.key != slot.stream_key or stream.offset != slot.offset):
                return None
            if p.min_tokens or slot.pslot >= 0:
                out = row.output_token_ids
                if p.min_tokens and len(out) < p.min_tokens:
                    return None
                if slot.pslot >= 0 and (slot.counted != len(out) or (slot.counted > 0 and out[-1] != slot.last_tok)):
                    return None
        prep = Prepared(lp.samples, [], {}, lp.pen, lp.bias, lp.topp, lp.rand, lp.seeded, lp.unseeded, False,
                        False, lp.want_logprobs, lp.any_temp, lp.any_min_p, lp.top_ks, lp.top_p_limits)
        arrays = lp.steady_arrays
        if arrays is None:
            arrays = [np.asarray(a, dtype=np.int64) for a in (lp.slot_ids, lp.pen, lp.pen_pslots, lp.bias, lp.topp,
                                                               lp.rand, lp.seeded, lp.unseeded)]
        prep.steady_arrays = arrays
        slot_ids, pen, pen_pslots, bias, topp, rand, seeded, unseeded = arrays
        empty = arrays[-1][:0]
        prep.segments = [
            slot_ids, empty, empty, empty, empty, empty, empty, empty,
            empty, empty, empty, empty, empty, empty, empty, empty,
            pen, pen_pslots, bias, topp, rand, seeded, unseeded,
        ]
        prep.num_rows, prep.vocab = lp.num_rows, lp.vocab
        prep.all_top_k, prep.pen_span = lp.all_top_k, lp.pen_span
        prep.slot_ids, prep.pen_pslots = lp.slot_ids, lp.pen_pslots
        prep.native = lp.native
        self._last = (last_rows, prep)
        return prep

    def plan(self, rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> Prepared:
        """The host side of a call: slots, code-path decisions and the index lists to
        stage (``prep.segments``); no device work. Call :meth:`bind` with the device
        views of the segments (from any staging copy) before sampling."""
        device = torch.device(device)
        if self.device != device or self.vocab != vocab:
            self.reset(device, vocab)
        prep = self._plan_steady(rows)
        if prep is not None:
            return prep
        self._last = None

        samples: list[Sample] = []
        for i, row in enumerate(rows):
            if row.num_samples == 1 and row.generators is None and row.keys is None:
                samples.append(Sample(i, row.params, row.generator, row.key, row))  # the common row
                continue
            for gen, key in zip(row.sample_generators(), row.sample_keys()):
                samples.append(Sample(i, row.params, gen, key, row))

        ephemeral: list[Slot] = []
        chg_slots: list[int] = []
        chg_f: list[float] = []
        chg_i: list[int] = []
        bias_slots: list[int] = []
        bias_tok: list[int] = []
        bias_val: list[float] = []
        rc_pslots: list[int] = []
        rc_rows: list[int] = []
        rc_toks: list[int] = []
        pm_pslots: list[int] = []
        pm_rows: list[int] = []
        pm_toks: list[int] = []
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        pen: list[int] = []
        bias: list[int] = []
        topp: list[int] = []
        rand: list[int] = []
        seeded: list[int] = []
        unseeded: list[int] = []
        slot_ids: list[int] = []
        top_ks: list[int] = []
        top_p_limits: list[int] = []
        want_logprobs = any_temp = any_min_p = rand_without_k = False
        slots = self.slots
        try:
            for s, smp in enumerate(samples):
                p, key, stream = smp.params, smp.key, smp.stream
                slot = slots.get(key) if key is not None else None
                stream_key = stream.key if stream is not None else None
                stream_off = stream.offset if stream is not None else 0
                if slot is None or slot.params is not p or slot.stream_key != stream_key \
                        or slot.offset != stream_off:
                    fresh = slot is None or slot.params is not p
                    if slot is None:
                        slot = self._new_slot()
                        if key is None:
                            ephemeral.append(slot)
                        else:
                            slots[key] = slot
                    slot.params, slot.stream_key, slot.offset = p, stream_key, stream_off
                    g = slot.greedy = p.greedy
                    chg_slots.append(slot.index)
                    chg_f.extend((
                        1.0 if g else p.temperature, 1.0 if g else p.top_p, 0.0 if g else p.min_p,
                        p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                    ))
                    chg_i.extend((0 if g else p.top_k, signed64(stream_key or 0), stream_off))
                    if p.logit_bias:
                        self._ensure_bias_width(len(p.logit_bias))
                        bias_slots.append(slot.index)
                        toks = list(p.logit_bias)
                        check_ids(toks, vocab, "logit_bias token ids")
                        pad = self.bias_width - len(toks)
                        bias_tok.extend(toks + [0] * pad)
                        bias_val.extend([p.logit_bias[t] for t in toks] + [0.0] * pad)
                    if fresh:
                        slot.counted = -1
                smp.slot = slot
                slot_ids.append(slot.index)
                if p.logprobs is not None:
                    want_logprobs = True
                if p.logit_bias:
                    bias.append(s)
                if p.min_tokens and len(smp.src.output_token_ids) < p.min_tokens:
                    banned = list(p.stop_token_ids or [])
                    eos = smp.src.eos_token_id
                    if eos is not None and not p.ignore_eos:
                        banned.append(eos)
                    for t in banned:
                        if 0 <= t < vocab:  # a stop id beyond the vocab can never be drawn
                            ban_rows.append(s)
                            ban_toks.append(t)
                if p.has_penalties:
                    out = smp.src.output_token_ids
                    pen.append(s)
                    if slot.pslot < 0:
                        slot.pslot = self._new_pslot()
                        slot.counted = -1
                    if slot.counted < 0:
                        prompt = list(smp.src.prompt_token_ids) if p.repetition_penalty != 1.0 else []
                        check_ids(prompt, vocab, "prompt_token_ids")
                        pm_pslots.append(slot.pslot)
                        pm_rows.extend([slot.pslot] * len(prompt))
                        pm_toks.extend(prompt)
                    if slot.counted != len(out) or (slot.counted > 0 and out[-1] != slot.last_tok):
                        toks = list(out)
                        check_ids(toks, vocab, "output_token_ids")
                        rc_pslots.append(slot.pslot)
                        self.num_recounts += 1
                        rc_rows.extend([slot.pslot] * len(toks))
                        rc_toks.extend(toks)
                        slot.counted = len(toks)
                        slot.last_tok = toks[-1] if toks else -1
                if slot.greedy:
                    top_ks.append(0)
                    continue
                rand.append(s)
                (seeded if stream is not None else unseeded).append(len(rand) - 1)
                k = p.top_k if 0 < p.top_k < vocab else 0
                top_ks.append(k)
                if not k:
                    rand_without_k = True
                if p.temperature != 1.0:
                    any_temp = True
                if p.min_p > 0:
                    any_min_p = True
                if p.top_p < 1.0:
                    topp.append(s)
                    top_p_limits.append(k or vocab)

            expand = len(samples) != len(rows)
            pen_pslots = [samples[s].slot.pslot for s in pen]
            segs = [
                slot_ids, [smp.row for smp in samples] if expand else [],
                chg_slots, float_bits(chg_f), chg_i, bias_slots, bias_tok, float_bits(bias_val),
                rc_pslots, rc_rows, rc_toks, pm_pslots, pm_rows, pm_toks, ban_rows, ban_toks,
                pen, pen_pslots, bias, topp, rand, seeded, unseeded,
            ]
        except BaseException:
            for slot in ephemeral:
                self.drop(slot)
            for smp in samples:
                if smp.key is not None and smp.slot is not None and self.slots.get(smp.key) is smp.slot:
                    # A half-built keyed slot must be rebuilt next time.
                    smp.slot.params = None
            raise

        prep = Prepared(samples, ephemeral, {}, pen, bias, topp, rand, seeded, unseeded, expand,
                        bool(ban_rows), want_logprobs, any_temp, any_min_p, top_ks, top_p_limits)
        prep.segments = segs
        if not ephemeral and not ban_rows and not chg_slots and not rc_pslots and not pm_pslots:
            # Nothing was (re)built: the next call with the same rows may reuse the lists.
            self._last = (list(rows), prep)
        prep.num_rows, prep.vocab = len(rows), vocab
        prep.all_top_k = bool(rand) and not rand_without_k
        prep.slot_ids, prep.pen_pslots = slot_ids, pen_pslots
        if pen_pslots and pen_pslots[-1] - pen_pslots[0] == len(pen_pslots) - 1 \
                and pen_pslots == list(range(pen_pslots[0], pen_pslots[-1] + 1)):
            prep.pen_span = (pen_pslots[0], pen_pslots[-1] + 1)
        return prep

    def bind(self, prep: Prepared, views: Sequence[torch.Tensor]) -> None:
        """Takes the device views of ``prep.segments`` and writes the rows that changed
        into the tables (nothing else touches them)."""
        v = prep.v = dict(zip(_STAGED, views))
        prep.segments = None
        if v["chg_slots"].numel():
            self.fp.index_copy_(0, v["chg_slots"], bits_float(v["chg_f"]).view(-1, NF))
            self.ip.index_copy_(0, v["chg_slots"], v["chg_i"].view(-1, NI))
            if self.bias_width:
                # A changed row without a bias must not keep an old owner's entries.
                self.bias_val.index_fill_(0, v["chg_slots"], 0.0)
        if v["bias_slots"].numel():
            w = self.bias_width
            self.bias_tok.index_copy_(0, v["bias_slots"], v["bias_tok"].view(-1, w))
            self.bias_val.index_copy_(0, v["bias_slots"], bits_float(v["bias_val"]).view(-1, w))
        if v["rc_pslots"].numel():
            self.counts.index_fill_(0, v["rc_pslots"], 0.0)
            if v["rc_toks"].numel():
                self.counts.index_put_(
                    (v["rc_rows"], v["rc_toks"]),
                    torch.ones(v["rc_toks"].numel(), dtype=torch.float32, device=self.device),
                    accumulate=True,
                )
        if v["pm_pslots"].numel():
            self.prompt_seen.index_fill_(0, v["pm_pslots"], False)
            if v["pm_toks"].numel():
                self.prompt_seen.index_put_((v["pm_rows"], v["pm_toks"]), self._true)

    def finish(self, prep: Prepared) -> None:
        for slot in prep.ephemeral:
            self.drop(slot)


__all__ = ["SamplingRow", "RowTables", "Prepared", "Sample", "Slot", "check_ids", "check_logits"]
