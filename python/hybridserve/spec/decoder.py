"""Speculative decoding's part of an engine step: verify, commit, draft.

The engine core calls, per step:

1. :meth:`SpecDecoder.before_forward` -- whether this step drafts (the runner then
   returns the trunk's hidden states with the logits);
2. after its ordinary sampler call (round 0), :meth:`SpecDecoder.after_sampling` --
   the verify rounds (:mod:`hybridserve.spec.acceptance`), the DeltaNet commit of the
   accepted rows (``model.commit_speculative``), and the next step's drafts
   (:class:`~hybridserve.spec.proposer.MTPProposer`); it returns what
   ``Scheduler.update(sampled, accepted, drafts)`` takes.

Who drafts: every running sample (n > 1 samples each their own) that is not a beam (beams run without
drafts), while the step's decoding batch is below
``disable_by_batch_size`` and the request's recent acceptance is not below
``min_acceptance_rate`` (then it rests ``PROBE_AFTER`` tokens and tries again).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from hybridserve.spec.acceptance import VerifyEntry, accept
from hybridserve.spec.config import ACCEPTANCE_WINDOW, PROBE_AFTER, SpeculativeConfig
from hybridserve.spec.proposer import MTPProposer


class _Acceptance:
    """A request's recent acceptance: (drafted, accepted) of its last verify steps."""

    __slots__ = ("recent", "drafted", "accepted", "resting_until")

    def __init__(self) -> None:
        self.recent: deque = deque()
        self.drafted = 0
        self.accepted = 0
        self.resting_until = -1

    def add(self, drafted: int, accepted: int) -> None:
        self.recent.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self.drafted - self.recent[0][0] >= ACCEPTANCE_WINDOW:
            d, a = self.recent.popleft()
            self.drafted -= d
            self.accepted -= a


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, model: Any, cache: Any, runner: Any, block_size: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.model = model
        self.cache = cache
        self.runner = runner
        self.proposer = MTPProposer(model, cache, runner.block_table_buf, block_size,
                                    draft_vocab_size=config.draft_vocab_size)
        self._acc: dict[tuple[str, int], _Acceptance] = {}
        self.drafting = False
        # Counters (the engine's stats() and Prometheus read them).
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_by_position = [0] * self.k
        self.drafted_by_position = [0] * self.k
        self.verify_steps = 0
        self.verify_entries = 0
        self.steps_not_drafting = 0

    # ------------------------------------------------------------------ per step
    def before_forward(self, plan: Any) -> bool:
        """Whether this step drafts for the next one (sets the runner's want_hidden)."""
        num_samples = np.asarray(plan.num_samples)
        decoding = int(np.count_nonzero(num_samples > 0))
        limit = self.config.disable_by_batch_size
        self.drafting = decoding > 0 and (limit == 0 or decoding < limit)
        if decoding and not self.drafting:
            self.steps_not_drafting += 1
        self.runner.want_hidden = self.drafting
        return self.drafting

    def release(self, request_id: str, num_samples: int) -> None:
        for i in range(num_samples):
            self._acc.pop((request_id, i), None)

    def _may_draft(self, rid: str, si: int, produced: int) -> bool:
        acc = self._acc.get((rid, si))
        if acc is None:
            return True
        if acc.resting_until >= 0:
            if produced < acc.resting_until:
                return False
            acc.resting_until = -1
            acc.recent.clear()
            acc.drafted = acc.accepted = 0
            return True
        if acc.drafted >= ACCEPTANCE_WINDOW and acc.accepted < self.config.min_acceptance_rate * acc.drafted:
            acc.resting_until = produced + PROBE_AFTER
            return False
        return True

    def after_sampling(self, engine: Any, plan: Any, step: Any, out: Any, sampled: np.ndarray,
                       structured: Any = None) -> tuple[np.ndarray, np.ndarray | None, list | None, dict]:
        """Verify rounds, DeltaNet commit and drafting. Returns ``(sampled, accepted,
        drafts, extra_logprobs)`` for the scheduler's update: ``accepted`` is None when
        no entry carried drafts, ``drafts`` None when none were made;
        ``extra_logprobs[(rid, si)]`` are the logprob records of the tokens after the
        first (round 0's are recorded by the engine as usual)."""
        requests = engine.requests
        req_ids = plan.request_ids
        sample_indices = np.asarray(plan.sample_indices)
        num_samples = np.asarray(plan.num_samples)
        B = len(num_samples)
        batch_index = step.batch_index if step is not None else np.zeros(0, np.int64)
        per_entry: dict[int, list[int]] = {}
        j = 0
        for b, k in zip(batch_index.tolist(), step.num_samples.tolist() if step is not None else []):
            per_entry[b] = sampled[j:j + k].tolist()
            j += k
        spec = step.spec_entries if step is not None and step.spec_entries is not None else np.zeros(0, np.int64)
        accepted = None
        extra_lp: dict = {}
        if len(spec):
            nd = np.asarray(plan.num_draft_tokens)
            qsl = np.asarray(plan.query_start_loc)
            ids = np.asarray(plan.input_ids)
            entries = []
            first = []
            first_lp = []
            at = 0
            pos_of = {int(b): i for i, b in enumerate(batch_index.tolist())}
            for b in spec.tolist():
                d = int(nd[b])
                rid = req_ids[b]
                si = int(sample_indices[b])
                sample = requests[rid].samples[si]
                row = sample.sampling_row
                if row is None:
                    row = engine._sampling_rows(plan, np.asarray([b]), np.asarray([1]))[0]
                drafts = ids[qsl[b] + 1: qsl[b] + 1 + d].tolist()
                # (history: the sample's own list, read before the scheduler's update
                # appends this step's tokens to it.)
                entries.append(VerifyEntry(drafts=drafts, rows=list(range(at, at + d)), row=row,
                                           history=sample.token_ids, key=(rid, si)))
                at += d
                first.append(per_entry[b][0])
                if out is not None and out.logprobs is not None and sample.logprobs is not None:
                    i = pos_of[b]
                    first_lp.append((out.logprobs[i], out.ranks[i] if out.ranks else None, out.top_logprobs[i]))
                else:
                    first_lp.append(None)
            masker = None
            if structured is not None and structured.active:
                def masker(alive, lg):
                    structured.mask_rows_after(
                        [(i, e.key[0], e.key[1], e.history, e.tokens) for i, e in enumerate(alive)], lg)
            accept(engine.sampler, step.draft_logits, entries, first, first_lp, masker)
            accepted = num_samples.astype(np.int32).copy()
            self.verify_steps += 1
            self.verify_entries += len(spec)
            for b, e in zip(spec.tolist(), entries):
                per_entry[b] = e.tokens
                accepted[b] = len(e.tokens)
                d = len(e.drafts)
                a = len(e.tokens) - 1
                self.draft_tokens += d
                self.accepted_tokens += a
                for p in range(d):
                    self.drafted_by_position[p] += 1
                    if p < a:
                        self.accepted_by_position[p] += 1
                key = (req_ids[b], int(sample_indices[b]))
                self._acc.setdefault(key, _Acceptance()).add(d, a)
                if len(e.logprobs) > 1:
                    extra_lp[key] = e.logprobs[1:]
            rows = torch.from_numpy(np.where(nd > 0, accepted, 0).astype(np.int32))
            self.runner.commit_speculative(rows)
        flat = np.asarray([t for b in sorted(per_entry) for t in per_entry[b]], dtype=np.int32)
        drafts = None
        if self.drafting and step is not None and step.hidden is not None:
            drafts = self._draft(engine, plan, step, per_entry, accepted, structured)
        return flat, accepted, drafts, extra_lp

    def _draft(self, engine: Any, plan: Any, step: Any, per_entry: dict, accepted: Any,
               structured: Any) -> list | None:
        requests = engine.requests
        req_ids = plan.request_ids
        sample_indices = np.asarray(plan.sample_indices)
        num_samples = np.asarray(plan.num_samples)
        qsl = np.asarray(plan.query_start_loc)
        sched = np.diff(qsl)
        computed = np.asarray(plan.num_computed_tokens)
        B = len(num_samples)
        committed = sched.astype(np.int64).copy()
        if accepted is not None:
            nd = np.asarray(plan.num_draft_tokens)
            committed = np.where(nd > 0, accepted, committed)
        next_tokens = np.full(B, -1, dtype=np.int64)
        want = np.zeros(B, dtype=np.int64)
        beams = engine.beams
        for b in range(B):
            rid = req_ids[b]
            state = requests.get(rid)
            if state is None:
                continue
            si = int(sample_indices[b])
            if b in per_entry and num_samples[b] > 1:
                # The entry that forks an n > 1 request: its children share the prompt's
                # blocks but not the token after it, so the drafter's row at the last
                # prompt position (which depends on that token) is left out.
                committed[b] = sched[b] - 1
                next_tokens[b] = int(plan.input_ids[qsl[b + 1] - 1])
            elif b in per_entry:
                toks = per_entry[b]
                # The drafter's next token is the step's last kept token; it then drafts
                # what follows it.
                next_tokens[b] = toks[-1]
                if (num_samples[b] == 1 and rid not in beams
                        and self._may_draft(rid, si, len(state.samples[si].token_ids) + len(toks))):
                    want[b] = self.k
            else:
                # Mid-prefill: the token after the chunk is the next prompt (or
                # recomputed output) token.
                pos = int(computed[b] + sched[b])
                prompt = state.prompt_token_ids
                if pos < len(prompt):
                    next_tokens[b] = prompt[pos]
                else:
                    out_ids = state.samples[si].token_ids
                    if pos - len(prompt) < len(out_ids):
                        next_tokens[b] = out_ids[pos - len(prompt)]
        drafts = self.runner.propose(
            self.proposer, step.hidden, query_start_loc=qsl, num_computed=computed,
            committed=committed, next_tokens=next_tokens, table_rows=np.asarray(plan.block_table_rows),
            num_drafts=want)
        if structured is not None and structured.active:
            # A draft past what the grammar allows could never be accepted (the verify
            # row's mask forbids it): cut there, so the step does not verify it.
            for b, d in enumerate(drafts):
                if d and b in per_entry:
                    rid, si = req_ids[b], int(sample_indices[b])
                    state = requests.get(rid)
                    if state is not None:
                        hist = list(state.samples[si].token_ids) + list(per_entry[b])
                        drafts[b] = d[: structured.valid_draft_prefix(rid, si, hist, d)]
        return drafts

    def stats(self) -> dict[str, Any]:
        rate = [a / d if d else None for a, d in zip(self.accepted_by_position, self.drafted_by_position)]
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "spec_acceptance_by_position": rate,
            "spec_accepted_by_position_counts": list(self.accepted_by_position),
            "spec_verify_entries": self.verify_entries,
            "spec_mean_accepted_length": (1 + self.accepted_tokens / self.verify_entries) if self.verify_entries else None,
            "spec_verify_steps": self.verify_steps,
            "spec_steps_not_drafting": self.steps_not_drafting,
        }
