# A frozen copy of python/hybridserve/sampler.py as of commit 6c663d6 (before issue 20
# reworked the sampler into the hybridserve.sampler package). tests/test_sampler_oracle.py
# holds the new sampler to this one's outputs for the same seeds. Do not edit.
"""The batched sampler: one token per sample from a step's logits.

Processing order is vLLM v1's, per sample row:

0. logit_bias: the request's biases added to their tokens' logits.
1. min_tokens: while a completion has fewer than ``min_tokens`` tokens, its EOS (unless
   ``ignore_eos``) and ``stop_token_ids`` get logit -inf.
2. penalties: repetition (tokens in prompt or output: positive logits divided by the
   penalty, negative ones multiplied), then frequency (times the token's count in the
   output) and presence (once if the token is in the output), both subtracted.
3. greedy rows (temperature < 1e-5) take the argmax here; the rest continue.
4. temperature: logits divided by it.
5. min_p: tokens with probability < min_p * (top probability) dropped.
6. top_k: tokens whose logit is below the k-th largest dropped (ties at the k-th kept).
7. top_p: in descending probability order, a token is kept iff the probability mass of
   the tokens strictly before it is < top_p (so the most likely token always stays);
   tokens tied with the last kept one are kept too.
8. sample from softmax of what is left, with the exponential race
   ``argmax(p / q), q ~ Exp(1)`` (equivalent to a categorical draw).

State kept across steps (the device side of a step is built for a GPU):

* Every sample row has a *slot* in persistent device tables of its parameters
  (temperature, top-p/k, min-p, penalties, seed stream, logit bias). A row given a
  ``key`` (the engine uses ``(request_id, sample_index)``) keeps its slot across steps
  and its parameters are written to the device only when the slot is created or the
  row's parameters change; rows without a key get a slot for one call.
* Rows with penalties keep running per-row token counts on the device
  (``[rows, vocab]``), incremented with the sampled tokens; they are rebuilt from the
  row's ``output_token_ids`` only when the slot is new or the host's list no longer
  matches what was counted (so a caller that rewrites a row's history is still right).
* Seeded rows draw their noise from one counter-based generator over the whole batch:
  splitmix64 of (stream key, draw offset, vocabulary index) in int64 torch ops, one
  launch sequence for all seeded rows. A seeded sample's noise therefore depends only
  on (seed, sample index, number of draws so far), never on which other requests share
  the batch. Unseeded rows draw from the global torch RNG.
* All per-call host->device data (row slots, changed parameters, positions of the rows
  each stage applies to, min_tokens bans) goes in one staging copy; the decisions that
  pick code paths (is any row seeded? the largest top_k?) are made from the host's own
  copy of the parameters, so there is no read of device data until the tokens (and the
  logprobs when asked) come back in one device->host transfer.

Logprobs: by default (``logprobs_mode="raw"``, vLLM v1's default) the reported numbers
are ``log_softmax`` of the model's logits before any processing; ``"processed"``
reports ``log_softmax`` of the logits after steps 0-7 (for greedy rows, after 0-2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from hybridserve.sampling import SamplingParams
from hybridserve.staging import StagingBuffer, bits_float, float_bits

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (products wrap mod 2**64, as in C)."""
    x = x ^ _srl(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _srl(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _srl(x, 31)


def counter_uniform(keys: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[R, vocab]`` uniforms in (0, 1] from int64 stream ``keys`` ``[R]`` and
    draw ``offsets`` ``[R]``: element ``(r, j)`` is a pure function of
    ``(keys[r], offsets[r], j)``.

    The row state is ``splitmix64(key ^ splitmix64(offset))``; element j is the j-th
    output of the splitmix64 sequence started there (state + (j+1)·γ, finalised), whose
    top 24 bits make the float. Equal to :func:`counter_uniform_reference`.
    """
    gamma = _signed(_GOLDEN)
    row = _mix64_t(offsets + gamma)
    row = _mix64_t((keys ^ row) + gamma)
    j = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * gamma
    h = _mix64_t(row.unsqueeze(1) + j.unsqueeze(0))
    return (_srl(h, 40) + 1).to(torch.float32) * (2.0**-24)


def counter_uniform_reference(key: int, offset: int, j: int) -> float:
    """Plain-Python value of ``counter_uniform(key, offset)[j]`` (the tests' oracle)."""
    row = _splitmix64((key ^ _splitmix64(offset & _MASK64)) & _MASK64)
    h = _splitmix64((row + j * _GOLDEN) & _MASK64)
    return ((h >> 40) + 1) * 2.0**-24


@dataclass
class SeedStream:
    """The random stream of one seeded sample: a 64-bit ``key`` and the number of
    draws taken so far (``offset``; the sampler advances it by one per draw)."""

    key: int
    offset: int = 0


def make_generator(
    seed: int | None, sample_index: int, device: torch.device | str | None = None
) -> SeedStream | None:
    """The stream of sample ``sample_index`` of a request with ``seed``; None if unseeded.

    Sample 0's key is ``seed`` itself (mod 2**64); sample i > 0 gets a splitmix64 hash
    of (seed, i), so the n samples of one request are independent streams. ``device``
    is accepted for compatibility and unused (the stream is two integers).
    """
    if seed is None:
        return None
    if sample_index < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index}")
    value = seed & _MASK64
    if sample_index > 0:
        value = _splitmix64(value ^ _splitmix64(sample_index))
    return SeedStream(value)


@dataclass
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


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    if len(ids) and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(
            f"{what} contain a token id outside [0, {vocab}) (the logits' vocabulary); "
            f"got range [{min(ids)}, {max(ids)}]"
        )


# Columns of the float and int parameter tables.
_F_TEMP, _F_TOPP, _F_MINP, _F_PRES, _F_FREQ, _F_REP = range(6)
_NF = 6
_I_TOPK, _I_KEY, _I_OFF = range(3)
_NI = 3


class _Slot:
    """Host record of one row's device state."""

    __slots__ = ("index", "params", "stream_key", "offset", "pslot", "counted", "last_tok", "bias_len")

    def __init__(self, index: int) -> None:
        self.index = index
        self.params: SamplingParams | None = None
        self.stream_key: int | None = None
        self.offset = 0
        self.pslot = -1
        self.counted = -1  # output tokens in the device counts; -1: not built
        self.last_tok = -1
        self.bias_len = 0


@dataclass
class _Sample:
    row: int
    params: SamplingParams
    stream: SeedStream | None
    key: Hashable | None
    src: SamplingRow
    slot: _Slot | None = None


@dataclass
class _Prepared:
    samples: list[_Sample]
    ephemeral: list[_Slot]
    v: dict[str, torch.Tensor]
    pen: list[int]
    bias: list[int]
    topp: list[int]
    rand: list[int]
    seeded: list[int]
    unseeded: list[int]
    expand: bool


class Sampler:
    """Draws one token per sample from a step's logits, keeping per-row state on the
    device across steps (see the module docstring).

    Cost per call: O(S * V) for S samples and vocabulary V; a top-k when rows use
    top_k; for rows with top_p, a top-k (rows that all have a small top_k) or a full
    sort; O(V) per seeded row for its noise; one host->device staging copy; one
    device->host copy of the tokens (and logprobs when asked). Memory: a few numbers
    per slot, plus V float32 counts and V bools per row with penalties.
    """

    def __init__(self, logprobs_mode: str = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self._device: torch.device | None = None
        self._vocab = 0
        self._slots: dict[Hashable, _Slot] = {}
        self._free: list[int] = []
        self._cap = 0
        self._pfree: list[int] = []
        self._pcap = 0
        self._bias_width = 0
        self._stage: StagingBuffer | None = None
        # Penalty rows rebuilt from their history (new rows, or a history that no
        # longer matches the running counts): a test hook and a health signal.
        self.num_recounts = 0

    # ------------------------------------------------------------------ state
    def _reset(self, device: torch.device, vocab: int) -> None:
        """(Re)build the tables for a device/vocabulary (first call, or a change)."""
        self._device, self._vocab = device, vocab
        self._slots.clear()
        self._free, self._cap, self._pfree, self._pcap, self._bias_width = [], 0, [], 0, 0
        self._fp = torch.zeros(0, _NF, dtype=torch.float32, device=device)
        self._ip = torch.zeros(0, _NI, dtype=torch.int64, device=device)
        self._bias_tok = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self._bias_val = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self._prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._stage = StagingBuffer(device)
        self._neg_inf = torch.full((), float("-inf"), device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)

    @staticmethod
    def _grow_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
        new = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        new[: t.shape[0]] = t
        return new

    def _new_slot(self) -> _Slot:
        if not self._free:
            cap = max(16, 2 * self._cap)
            self._fp = self._grow_rows(self._fp, cap)
            self._ip = self._grow_rows(self._ip, cap)
            if self._bias_width:
                self._bias_tok = self._grow_rows(self._bias_tok, cap)
                self._bias_val = self._grow_rows(self._bias_val, cap)
            self._free = list(range(cap - 1, self._cap - 1, -1))
            self._cap = cap
        return _Slot(self._free.pop())

    def _new_pslot(self) -> int:
        if not self._pfree:
            cap = max(4, 2 * self._pcap)
            self._counts = self._grow_rows(self._counts, cap)
            self._prompt_seen = self._grow_rows(self._prompt_seen, cap)
            self._pfree = list(range(cap - 1, self._pcap - 1, -1))
            self._pcap = cap
        return self._pfree.pop()

    def _ensure_bias_width(self, width: int) -> None:
        if width <= self._bias_width:
            return
        width = max(width, 2 * self._bias_width, 8)
        tok = torch.zeros(self._cap, width, dtype=torch.int64, device=self._device)
        val = torch.zeros(self._cap, width, dtype=torch.float32, device=self._device)
        if self._bias_width:
            tok[:, : self._bias_width] = self._bias_tok
            val[:, : self._bias_width] = self._bias_val
        self._bias_tok, self._bias_val, self._bias_width = tok, val, width

    def _drop(self, slot: _Slot) -> None:
        if slot.pslot >= 0:
            self._pfree.append(slot.pslot)
            slot.pslot = -1
        self._free.append(slot.index)

    def release(self, key: Hashable) -> None:
        """Forget the row ``key`` (its request finished or was aborted); unknown keys are
        ignored, so releasing twice is harmless."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._drop(slot)

    @property
    def num_tracked_rows(self) -> int:
        """Rows with a slot kept across steps (for tests and leak checks)."""
        return len(self._slots)

    # ------------------------------------------------------------------ preparing
    def _prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> _Prepared:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}"
            )
        vocab = logits.shape[1]
        if self._device != logits.device or self._vocab != vocab:
            self._reset(logits.device, vocab)

        samples: list[_Sample] = []
        for i, row in enumerate(rows):
            if row.num_samples == 1 and row.generators is None and row.keys is None:
                samples.append(_Sample(i, row.params, row.generator, row.key, row))  # the common row
                continue
            for gen, key in zip(row.sample_generators(), row.sample_keys()):
                samples.append(_Sample(i, row.params, gen, key, row))

        ephemeral: list[_Slot] = []
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
        try:
            for s, smp in enumerate(samples):
                p, out = smp.params, smp.src.output_token_ids
                slot = self._slots.get(smp.key) if smp.key is not None else None
                fresh = slot is None or slot.params is not p
                if slot is None:
                    slot = self._new_slot()
                    if smp.key is None:
                        ephemeral.append(slot)
                    else:
                        self._slots[smp.key] = slot
                smp.slot = slot
                stream_key = smp.stream.key if smp.stream is not None else None
                stream_off = smp.stream.offset if smp.stream is not None else 0
                if fresh or slot.stream_key != stream_key or slot.offset != stream_off:
                    slot.params, slot.stream_key, slot.offset = p, stream_key, stream_off
                    g = p.greedy
                    chg_slots.append(slot.index)
                    chg_f.extend((
                        1.0 if g else p.temperature, 1.0 if g else p.top_p, 0.0 if g else p.min_p,
                        p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                    ))
                    chg_i.extend((0 if g else p.top_k, _signed(stream_key or 0), stream_off))
                    if p.logit_bias:
                        self._ensure_bias_width(len(p.logit_bias))
                        bias_slots.append(slot.index)
                        toks = list(p.logit_bias)
                        _check_ids(toks, vocab, "logit_bias token ids")
                        pad = self._bias_width - len(toks)
                        bias_tok.extend(toks + [0] * pad)
                        bias_val.extend([p.logit_bias[t] for t in toks] + [0.0] * pad)
                    if fresh:
                        slot.counted = -1
                if p.logit_bias:
                    bias.append(s)
                if len(out) < p.min_tokens:
                    banned = list(p.stop_token_ids or [])
                    eos = smp.src.eos_token_id
                    if eos is not None and not p.ignore_eos:
                        banned.append(eos)
                    for t in banned:
                        if 0 <= t < vocab:  # a stop id beyond the vocab can never be drawn
                            ban_rows.append(s)
                            ban_toks.append(t)
                if p.has_penalties:
                    pen.append(s)
                    if slot.pslot < 0:
                        slot.pslot = self._new_pslot()
                        slot.counted = -1
                    if slot.counted < 0:
                        prompt = list(smp.src.prompt_token_ids) if p.repetition_penalty != 1.0 else []
                        _check_ids(prompt, vocab, "prompt_token_ids")
                        pm_pslots.append(slot.pslot)
                        pm_rows.extend([slot.pslot] * len(prompt))
                        pm_toks.extend(prompt)
                    if slot.counted != len(out) or (slot.counted > 0 and out[-1] != slot.last_tok):
                        toks = list(out)
                        _check_ids(toks, vocab, "output_token_ids")
                        rc_pslots.append(slot.pslot)
                        self.num_recounts += 1
                        rc_rows.extend([slot.pslot] * len(toks))
                        rc_toks.extend(toks)
                        slot.counted = len(toks)
                        slot.last_tok = toks[-1] if toks else -1
                if not p.greedy:
                    rand.append(s)
                    (seeded if smp.stream is not None else unseeded).append(len(rand) - 1)
                    if p.top_p < 1.0:
                        topp.append(s)

            expand = len(samples) != len(rows)
            names = ["slots", "row_of", "chg_slots", "chg_f", "chg_i", "bias_slots", "bias_tok",
                     "bias_val", "rc_pslots", "rc_rows", "rc_toks", "pm_pslots", "pm_rows", "pm_toks",
                     "ban_rows", "ban_toks", "pen", "pen_pslots", "bias", "topp", "rand", "seeded", "unseeded"]
            segs = [
                [smp.slot.index for smp in samples], [smp.row for smp in samples] if expand else [],
                chg_slots, float_bits(chg_f), chg_i, bias_slots, bias_tok, float_bits(bias_val),
                rc_pslots, rc_rows, rc_toks, pm_pslots, pm_rows, pm_toks, ban_rows, ban_toks,
                pen, [samples[s].slot.pslot for s in pen], bias, topp, rand, seeded, unseeded,
            ]
            v = dict(zip(names, self._stage.stage(segs)))
        except BaseException:
            for slot in ephemeral:
                self._drop(slot)
            for smp in samples:
                if smp.key is not None and self._slots.get(smp.key) is smp.slot:
                    # A half-built keyed slot must be rebuilt next time.
                    smp.slot.params = None
            raise

        # Writes of the rows that changed; nothing else touches the tables.
        if chg_slots:
            self._fp.index_copy_(0, v["chg_slots"], bits_float(v["chg_f"]).view(-1, _NF))
            self._ip.index_copy_(0, v["chg_slots"], v["chg_i"].view(-1, _NI))
            if self._bias_width:
                # A changed row without a bias must not keep an old owner's entries.
                self._bias_val.index_fill_(0, v["chg_slots"], 0.0)
        if bias_slots:
            w = self._bias_width
            self._bias_tok.index_copy_(0, v["bias_slots"], v["bias_tok"].view(-1, w))
            self._bias_val.index_copy_(0, v["bias_slots"], bits_float(v["bias_val"]).view(-1, w))
        if rc_pslots:
            self._counts.index_fill_(0, v["rc_pslots"], 0.0)
            if rc_toks:
                self._counts.index_put_(
                    (v["rc_rows"], v["rc_toks"]),
                    torch.ones(len(rc_toks), dtype=torch.float32, device=self._device),
                    accumulate=True,
                )
        if pm_pslots:
            self._prompt_seen.index_fill_(0, v["pm_pslots"], False)
            if pm_toks:
                self._prompt_seen.index_put_((v["pm_rows"], v["pm_toks"]), self._true)
        return _Prepared(samples, ephemeral, v, pen, bias, topp, rand, seeded, unseeded, expand)

    def _finish(self, prep: _Prepared) -> None:
        for slot in prep.ephemeral:
            self._drop(slot)

    # ------------------------------------------------------------------ processing
    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits each sample is drawn from, float32 ``[num_samples_total, V]``.

        Greedy samples get steps 0-2 of the module docstring (their argmax is the
        token); the others get steps 0-7 (dropped tokens are -inf). ``logits`` is
        ``[len(rows), V]`` and is not modified; no stream or count advances.
        """
        prep = self._prepare(logits, rows)
        try:
            return self._process(logits, prep)
        finally:
            self._finish(prep)

    def _process(self, logits: torch.Tensor, prep: _Prepared) -> torch.Tensor:
        v = prep.v
        vocab = logits.shape[1]
        if prep.expand:
            x = logits.index_select(0, v["row_of"]).to(torch.float32)
        else:
            x = logits.to(torch.float32, copy=True)
        slots = v["slots"]
        params = [smp.params for smp in prep.samples]
        num = len(params)

        if prep.bias:
            b_slots = slots.index_select(0, v["bias"])
            sub = x.index_select(0, v["bias"])
            sub.scatter_add_(1, self._bias_tok.index_select(0, b_slots),
                             self._bias_val.index_select(0, b_slots))
            x.index_copy_(0, v["bias"], sub)
        if v["ban_rows"].numel():
            # A device scalar made once: a host scalar here would be a blocking copy.
            x.index_put_((v["ban_rows"], v["ban_toks"]), self._neg_inf)
        fp = self._fp.index_select(0, slots)
        if prep.pen:
            self._apply_penalties(x, prep, fp)

        if all(p.greedy for p in params):
            return x
        if any(not p.greedy and p.temperature != 1.0 for p in params):
            x.div_(fp[:, _F_TEMP : _F_TEMP + 1])
        if any(not p.greedy and p.min_p > 0 for p in params):
            probs = torch.softmax(x, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * fp[:, _F_MINP : _F_MINP + 1]
            x.masked_fill_(probs < threshold, float("-inf"))
        ks = [p.top_k for p in params if not p.greedy and 0 < p.top_k < vocab]
        if ks:
            kmax = max(ks)
            k = self._ip.index_select(0, slots)[:, _I_TOPK]
            no_k = (k <= 0) | (k >= vocab)
            values = torch.topk(x, kmax, dim=-1).values
            kth = values.gather(1, (k.clamp(1, kmax) - 1).unsqueeze(1))
            # Rows without top_k compare against -inf: nothing is dropped.
            kth.masked_fill_(no_k.unsqueeze(1), float("-inf"))
            x.masked_fill_(x < kth, float("-inf"))
        if prep.topp:
            tp = [params[s] for s in prep.topp]
            # Only the survivors need ordering: when every top-p row also has a small
            # top_k, a top-k of that size holds them all (ties aside, handled below).
            limit = [p.top_k if 0 < p.top_k < vocab else vocab for p in tp]
            kp = max(limit) if max(limit) <= vocab // 4 else None
            ps = fp[:, _F_TOPP]
            if len(prep.topp) == num:
                x = self._top_p(x, ps, kp)
            else:
                idx = v["topp"]
                x.index_copy_(0, idx, self._top_p(x.index_select(0, idx), ps.index_select(0, idx), kp))
        return x

    @staticmethod
    def _top_p(x: torch.Tensor, ps: torch.Tensor, k: int | None) -> torch.Tensor:
        """Nucleus filter of rows already cut by min_p/top_k (dropped = -inf).

        ``k``: order only the top k values (every row has at most k survivors up to
        ties), else sort the whole row. Probabilities are normalised over the whole
        row (log-sum-exp), so the kept set does not depend on which route ran, and
        tokens tied with the last kept logit are kept too (as top_k keeps ties): the
        kept set then depends on the logit values only, not on how a sort orders equal
        values, which bf16 logits produce often. No host reads.
        """
        if k is not None:
            values = torch.topk(x, k, dim=-1).values
        else:
            values = x.sort(dim=-1, descending=True).values
        probs = (values - torch.logsumexp(x, dim=-1, keepdim=True)).exp()
        # Mass strictly before each token in descending order (an exclusive cumsum);
        # a token is kept iff that mass is < p, so the top token (mass 0 < p) stays.
        cumulative = probs.cumsum(dim=-1)
        before = torch.zeros_like(cumulative)
        before[:, 1:] = cumulative[:, :-1]
        # `before` is non-decreasing, so the kept tokens are a prefix of `values`; a
        # token beyond a top-k list is tied with or below its last value.
        last_kept = values.masked_fill(before >= ps.unsqueeze(1), float("inf")).amin(dim=-1, keepdim=True)
        return x.masked_fill(x < last_kept, float("-inf"))

    def _apply_penalties(self, x: torch.Tensor, prep: _Prepared, fp: torch.Tensor) -> None:
        idx, pslots = prep.v["pen"], prep.v["pen_pslots"]
        counts = self._counts.index_select(0, pslots)
        in_output = counts > 0
        seen = self._prompt_seen.index_select(0, pslots) | in_output
        sub = x.index_select(0, idx)
        f = fp.index_select(0, idx)
        rep = f[:, _F_REP : _F_REP + 1]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - f[:, _F_FREQ : _F_FREQ + 1] * counts
        sub = sub - f[:, _F_PRES : _F_PRES + 1] * in_output.to(torch.float32)
        x.index_copy_(0, idx, sub)

    # ------------------------------------------------------------------ sampling
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
            self._finish(prep)

    def _sample(self, logits: torch.Tensor, prep: _Prepared) -> SamplerOutput:
        v = prep.v
        params = [smp.params for smp in prep.samples]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = None
        if want_logprobs and self.logprobs_mode == "raw":
            raw = logits.index_select(0, v["row_of"]) if prep.expand else logits
            raw_logprobs = torch.log_softmax(raw.to(torch.float32), dim=-1)

        x = self._process(logits, prep)
        tokens = x.argmax(dim=-1)
        if prep.rand:
            rand = v["rand"]
            probs = torch.softmax(x.index_select(0, rand), dim=-1)
            if not prep.seeded:
                q = torch.empty_like(probs).exponential_()
            else:
                q = torch.empty_like(probs)
                seeded = v["seeded"]
                seeded_slots = v["slots"].index_select(0, rand.index_select(0, seeded))
                ip = self._ip.index_select(0, seeded_slots)
                u = counter_uniform(ip[:, _I_KEY], ip[:, _I_OFF], probs.shape[1])
                q.index_copy_(0, seeded, -torch.log(u))
                if prep.unseeded:
                    n = len(prep.unseeded)
                    q.index_copy_(0, v["unseeded"], torch.empty(n, q.shape[1], device=q.device).exponential_())
                # Each seeded stream has drawn once more.
                self._ip[:, _I_OFF].index_add_(0, seeded_slots, torch.ones_like(seeded_slots))
            # q == 0 would make p/q inf (or NaN for p == 0).
            q.clamp_(min=torch.finfo(q.dtype).tiny)
            tokens.index_copy_(0, rand, (probs / q).argmax(dim=-1))
        if prep.pen:
            self._counts.index_put_(
                (v["pen_pslots"], tokens.index_select(0, v["pen"])),
                torch.ones(len(prep.pen), dtype=torch.float32, device=tokens.device),
                accumulate=True,
            )

        if not want_logprobs:
            token_ids = tokens.tolist()
            top = None
        else:
            lp = raw_logprobs if raw_logprobs is not None else torch.log_softmax(x, dim=-1)
            chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
            ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
            ks = [p.logprobs or 0 for p in params]
            kmax = max(ks)
            parts = [tokens.double(), chosen.double(), ranks.double()]
            if kmax > 0:
                top_v, top_i = torch.topk(lp, kmax, dim=-1)
                parts += [top_i.double().flatten(), top_v.double().flatten()]
            # One device->host transfer for everything the step returns.
            flat = torch.cat(parts).tolist()
            num = len(params)
            token_ids = [int(t) for t in flat[:num]]
            chosen_l = flat[num : 2 * num]
            ranks_l = [int(r) for r in flat[2 * num : 3 * num]]
            top = [[] for _ in ks]
            if kmax > 0:
                ti = flat[3 * num : 3 * num + num * kmax]
                tv = flat[3 * num + num * kmax :]
                for s, k in enumerate(ks):
                    top[s] = [(int(ti[s * kmax + j]), tv[s * kmax + j]) for j in range(k)]

        # Host mirrors of what the device just did.
        for j in prep.seeded:
            smp = prep.samples[prep.rand[j]]
            smp.stream.offset += 1
            smp.slot.offset += 1
        for s in prep.pen:
            slot = prep.samples[s].slot
            slot.counted += 1
            slot.last_tok = token_ids[s]
        if top is None:
            return SamplerOutput(token_ids=token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen_l, ranks=ranks_l, top_logprobs=top)


__all__ = [
    "Sampler", "SamplingRow", "SamplerOutput", "SeedStream", "make_generator",
    "counter_uniform", "counter_uniform_reference",
]
