"""Constrained decoding inside the engine: a grammar matcher per sample, the next
step's token masks computed on a worker thread while the model runs, and the masks
applied to the logits before the sampler.

The matcher of a sample is a function of the tokens the sample has accepted: before
each mask is filled the matcher is caught up with ``sample.token_ids``. So

* ``n > 1``: every sample gets its own matcher from the request's compiled grammar; the
  prompt's last row (the fork, one row drawing n tokens) uses the empty state all n
  share, and each sample's matcher diverges with its own tokens (the state forks with
  the sequence);
* preemption, prefix-cache hits and chunked prefill change nothing: ``token_ids`` is
  kept by the engine through all of them, and a matcher that is dropped or finds fewer
  tokens than it consumed is rebuilt from them;
* beam search is refused with constraints (``BeamSearchParams`` carries none, and the
  server answers 400): a beam's parent changes every step, which the per-sample
  catch-up does not follow.

The mask work runs on one thread that the forward overlaps: xgrammar fills bitmasks
without the GIL, and the CPU model's torch ops release it too. The masks are then
applied to the logits, or, when the engine's sampler draws the step with its native
kernel, handed to that draw (``Sampler.fuse_token_mask``), which masks each row in the
pass it makes over it anyway: at Qwen's vocabulary a separate apply is a memory-bound
pass over a megabyte per row.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from hybridserve.errors import InvalidRequest
from hybridserve.structured.grammar import GrammarCompiler
from hybridserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("hybridserve.structured")
BUILD_LOCK = threading.Lock()


class _Matcher:
    __slots__ = ("m", "consumed", "dead")

    def __init__(self, m: Any) -> None:
        self.m = m
        self.consumed = 0
        self.dead = False


class StructuredDecoding:
    """The engine's constrained requests: compiled grammars, per-sample matchers, masks."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], core: Any = None) -> None:
        """``core``: the engine core whose sampler draws the masked rows (its draw may
        take the masks itself, see :meth:`apply`); None: the masks are always applied."""
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.xgr = self.compiler.xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._grammars: dict[str, Any] = {}  # request id -> compiled grammar
        self._matchers: dict[tuple[str, int], _Matcher] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        # The engine's sampler: a step's masks go into its draw when it can take them.
        self.sampler = getattr(core, "sampler", None)
        self._bitmask: torch.Tensor | None = None
        self._batch = None
        # Metrics: mask fills, their seconds (sequence-steps and wall), apply seconds.
        self.mask_rows = 0
        self.mask_seconds = 0.0
        # The fill's CPU time on its thread: the wall time above also counts the
        # thread's waits for a core, which the forward beside it (and, on a shared
        # machine, anything else) takes.
        self.mask_cpu_seconds = 0.0
        self.apply_seconds = 0.0
        self.wait_seconds = 0.0
        self.submit_seconds = 0.0  # the engine thread's share of starting each step's job
        self.fused_rows = 0  # masked rows handed to the sampler's draw (no apply pass)

    def constrained_ids(self) -> set[str]:
        """Ids of the requests decoding under a grammar."""
        return set(self._grammars)

    # ------------------------------------------------------------ speculation
    # Speculative decoding (hybridserve.spec) asks two things of the grammar, both on the
    # engine thread after the step's mask job is done: how much of a draft the grammar
    # allows (drafts are cut there, so a verify row never carries a token the
    # constraint forbids), and the mask of a verify row after tokens not yet committed.
    # Both accept the extra tokens into the sample's matcher and roll them back.

    def valid_draft_prefix(self, rid: str, si: int, token_ids: list[int], drafts: list[int]) -> int:
        """How many leading ``drafts`` the grammar accepts after ``token_ids``."""
        if rid not in self._grammars:
            return len(drafts)
        mt = self._matcher(rid, si, token_ids)
        if mt.dead:
            return 0
        m, n = mt.m, 0
        for t in drafts:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def mask_rows_after(self, items: list, logits: torch.Tensor) -> None:
        """``items``: ``(row, rid, si, token_ids, extra)``: sets row ``row`` of ``logits`` to
        what the grammar allows after ``token_ids + extra`` (rows of unconstrained
        requests are skipped)."""
        t0 = time.perf_counter()
        work = [it for it in items if it[1] in self._grammars]
        if not work:
            return
        words = (self.vocab_size + 31) // 32
        bm = self._bitmask
        if bm is None or bm.shape[0] < logits.shape[0] or bm.shape[1] != words:
            bm = self._bitmask = self.xgr.allocate_token_bitmask(max(logits.shape[0], 8), self.vocab_size)
        rows = []
        for row, rid, si, token_ids, extra in work:
            mt = self._matcher(rid, si, token_ids)
            m, n, dead = mt.m, 0, mt.dead
            for t in extra:
                if dead or m.is_terminated() or not m.accept_token(int(t)):
                    dead = True
                    break
                n += 1
            if dead or m.is_terminated():
                self._stop_only(bm, row)
            else:
                m.fill_next_token_bitmask(bm, row)
            if n:
                m.rollback(n)
            rows.append(row)
        self.mask_rows += len(work)
        self.mask_seconds += time.perf_counter() - t0
        apply_bitmask(logits, bm[: logits.shape[0]], sorted(rows), min(self.vocab_size, logits.shape[-1]))

    def _stop_only(self, bm: torch.Tensor, row: int) -> None:
        bm[row].zero_()
        for t in self.stop_token_ids:
            if t < self.vocab_size:
                bm[row, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)

    @property
    def active(self) -> bool:
        return bool(self._grammars)

    # ------------------------------------------------------------ requests
    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        self._grammars[request_id] = self.compiler.compile(spec)

    def release(self, request_id: str) -> None:
        if self._grammars.pop(request_id, None) is not None:
            for key in [k for k in self._matchers if k[0] == request_id]:
                del self._matchers[key]

    def _matcher(self, rid: str, si: int, token_ids: list[int]) -> _Matcher:
        key = (rid, si)
        mt = self._matchers.get(key)
        if mt is None or mt.consumed > len(token_ids):
            # New sample, or its tokens were cut back: (re)built from what it accepted.
            mt = self._matchers[key] = _Matcher(self.xgr.GrammarMatcher(self._grammars[rid]))
        if mt.consumed < len(token_ids):
            m = mt.m
            for tok in token_ids[mt.consumed:]:
                if not mt.dead and not m.accept_token(int(tok)):
                    # Only a token the mask allowed can be sampled, so this is a stop
                    # token after the grammar ended or a bug: end the sample cleanly.
                    mt.dead = True
            mt.consumed = len(token_ids)
        return mt

    # ------------------------------------------------------------ steps
    def begin_step(self, plan: Any, requests: dict[str, Any]) -> concurrent.futures.Future | None:
        """Starts filling this step's masks on the worker thread; None when no
        sampled row of the plan is constrained."""
        t0 = time.perf_counter()
        try:
            return self._begin(plan, requests)
        finally:
            self.submit_seconds += time.perf_counter() - t0

    def _begin(self, plan: Any, requests: dict[str, Any]) -> concurrent.futures.Future | None:
        num_samples = np.asarray(plan.num_samples)
        batch_index = np.nonzero(num_samples > 0)[0]
        req_ids = plan.request_ids
        sample_indices = np.asarray(plan.sample_indices)
        work = []
        for row, b in enumerate(batch_index.tolist()):
            rid = req_ids[b]
            if rid not in self._grammars:
                continue
            state = requests.get(rid)
            if state is None:
                continue
            si = 0 if num_samples[b] > 1 else int(sample_indices[b])
            work.append((row, rid, si, state.samples[si].token_ids))
        if not work:
            return None
        return self._pool.submit(self._fill, work, len(batch_index))

    def _fill(self, work: list, num_rows: int) -> tuple[torch.Tensor, list[int]]:
        t0, c0 = time.perf_counter(), time.thread_time()
        words = (self.vocab_size + 31) // 32
        bm = self._bitmask
        if bm is None or bm.shape[0] < num_rows or bm.shape[1] != words:
            bm = self._bitmask = self.xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        rows, matchers, stop_rows = [], [], []
        for row, rid, si, token_ids in work:
            if rid not in self._grammars:
                continue  # released meanwhile (a step that raised left this job running)
            mt = self._matcher(rid, si, token_ids)
            if mt.dead or mt.m.is_terminated():
                stop_rows.append(row)
            else:
                rows.append(row)
                matchers.append(mt.m)
        if len(matchers) > 1:
            if self._batch is None:
                self._batch = self.xgr.BatchGrammarMatcher(max_threads="auto")
            self._batch.batch_fill_next_token_bitmask(matchers, bm, indices=rows)
        elif matchers:
            matchers[0].fill_next_token_bitmask(bm, rows[0])
        for row in stop_rows:
            self._stop_only(bm, row)
        self.mask_rows += len(work)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_cpu_seconds += time.thread_time() - c0
        return bm, sorted(rows + stop_rows)

    def apply(self, job: concurrent.futures.Future, logits: torch.Tensor) -> None:
        """Waits for the step's masks and sets every disallowed token's logit to -inf,
        or hands them to the sampler's next draw of ``logits``, which then samples as if
        they had been applied (the bitmask is not touched before that draw: the next
        fill starts with the next step)."""
        t0 = time.perf_counter()
        bm, rows = job.result()
        t1 = time.perf_counter()
        self.wait_seconds += t1 - t0
        vocab = min(self.vocab_size, logits.shape[-1])
        fuse = getattr(self.sampler, "fuse_token_mask", None)
        if fuse is not None and fuse(logits, bm, rows, vocab):
            self.fused_rows += len(rows)
        else:
            apply_bitmask(logits, bm[: logits.shape[0]], rows, vocab)
        self.apply_seconds += time.perf_counter() - t1

    def stats(self) -> dict[str, Any]:
        d = self.compiler.stats()
        d.update(mask_sequence_steps=self.mask_rows, mask_seconds=self.mask_seconds,
                 mask_cpu_seconds=self.mask_cpu_seconds,
                 mask_apply_seconds=self.apply_seconds, mask_wait_seconds=self.wait_seconds,
                 mask_submit_seconds=self.submit_seconds, mask_fused_rows=self.fused_rows,
                 active_requests=len(self._grammars))
        return d


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """Sets the disallowed logits of ``rows`` to -inf: on the CPU with the native kernel
    (xgrammar's CPU kernel tests every bit: ~6x slower at Qwen's vocabulary), on a GPU
    with xgrammar's kernel after one host-to-device copy of the bitmask."""
    from hybridserve.kernels import native

    if native.usable(logits) and logits.is_contiguous():
        native.apply_token_bitmask(logits, bitmask, rows, vocab)
        return
    import xgrammar as xgr

    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
        backend = "auto"
    else:
        backend = "cpu" if logits.dtype == torch.float32 else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend=backend)


def check_params(params: Any) -> StructuredOutputsParams | None:
    """The request's constraint, checked against what the engine can do with it."""
    spec = getattr(params, "structured_outputs", None)
    if spec is None:
        return None
    if params.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with structured outputs: the constraint ends "
                             "the output with the end-of-sequence token")
    if params.min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with structured outputs: a constraint may be "
                             "complete earlier, and then only the end-of-sequence token is allowed")
    return spec
