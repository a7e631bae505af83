"""The model runner: turns the scheduler's plan for one step into tensors and runs the model.

The Rust scheduler owns every piece of bookkeeping; the runner only mirrors what the
plan tells it, in this order each step:

1. apply the plan's incremental block-table and state-page-table updates to two
   persistent buffers on the model's device, ``int32[max_num_seqs, max_blocks_per_seq]``
   and ``int32[max_num_seqs, state_pages]`` (entry ``b`` reads row
   ``block_table_rows[b]`` of both), so the per-step host->device traffic does not grow
   with context length;
2. perform the plan's page copies *before* the model reads the arena: KV
   copy-on-write (``block_copies``) and state forks / checkpoint restores
   (``state_copies``) as one gather + one scatter (the scheduler never lets a pair read
   a page another pair writes);
3. build a :class:`~hybridserve.model.batch.ForwardBatch` over the flattened batch
   (prefill chunks and decode tokens mixed), with the plan's checkpoint requests
   (the DeltaNet state after ``checkpoint_positions[b]`` tokens, written into
   ``checkpoint_pages`` inside the same step), and run the model, which returns logits
   only for the rows that sample this step.

Everything the step sends to the device (block-table updates, copy lists, token ids,
positions, slot mapping, ..., a verify step's speculative flags and verify-graph slot
layout, and the sampler's row indices the engine hands over in ``extra_segments``) is
written into one host staging buffer (pinned on CUDA) and copied
once (:class:`hybridserve.staging.StagingBuffer`); index ranges are checked
on the host arrays before they travel, so no step reads device data back. Pure-decode
steps run from captured CUDA graphs when ``graphs`` is set (see
:mod:`hybridserve.runner.cuda_graphs`), speculative verify steps (up to k drafts per
sequence, plain decodes beside them) from ``verify_graphs``
(:mod:`hybridserve.runner.verify_graphs`); every other step runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache import HybridCache
from hybridserve.runner.verify_graphs import VERIFY_LAYOUT
from hybridserve.staging import StagingBuffer

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepLogits:
    """Logits of the sequences that sample this step, in batch order.

    ``batch_index[i]`` is the position in the plan of the sequence whose logits are
    ``logits[i]``; ``num_samples[i]`` is how many tokens to draw from that row.
    """

    logits: torch.Tensor
    batch_index: np.ndarray
    num_samples: np.ndarray
    # Logits at every scheduled position of the sequences execute() was asked for
    # (prompt logprobs), rows in plan order; spans are (batch index, first row, count).
    prompt_logits: torch.Tensor | None = None
    prompt_spans: list[tuple[int, int, int]] | None = None
    # Speculative steps (see hybridserve.spec): the logits of the draft rows (rows 1..d
    # of each entry that carried d drafts, entries in plan order), those entries'
    # batch indices, and the trunk's post-norm hidden state at every row of the batch
    # (the MTP drafter's input) when the engine asked for it.
    draft_logits: torch.Tensor | None = None
    spec_entries: np.ndarray | None = None
    hidden: torch.Tensor | None = None


class ModelRunner:
    """Executes one scheduler plan on a :class:`Qwen3_5ForServing` and its :class:`HybridCache`."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: HybridCache,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.block_table_buf = torch.zeros(
            (max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        self.state_pages = cache.state_pages
        self.state_table_buf = torch.zeros(
            (max_num_seqs, self.state_pages), dtype=torch.int32, device=self.device
        )
        self.staging = StagingBuffer(self.device)
        # On the CPU the batch's int32 and bool fields are written by numpy, straight
        # from the plan's int32 arrays, into persistent buffers whose views are reused
        # while the batch size stays (no int64 -> int32 conversion op per field and
        # step; the staged int64 copies are what a device converts). On a device they
        # are converted there from the staged views.
        self._host_fields = None
        if self.device.type == "cpu":
            self._host_fields = (torch.zeros(max_num_seqs + 1, dtype=torch.int32),
                                 torch.zeros(max_num_seqs, dtype=torch.int32),
                                 torch.zeros(max_num_seqs, dtype=torch.bool))
        self._host_field_views: tuple = (None, ())
        # The last batch's table views, (key, view) per table: a steady batch reads the
        # same rows and columns of the persistent tables step after step.
        self._table_views: dict[str, tuple] = {}
        # A DecodeGraphs (CUDA only, set by the engine); None runs every step eagerly.
        # With speculative decoding also a VerifyGraphs for the verify steps
        # (hybridserve.runner.verify_graphs).
        self.graphs: Any = None
        self.verify_graphs: Any = None
        self._staged: dict[str, torch.Tensor] = {}
        # perf_counter() when the last execute() finished preparing its inputs.
        self.inputs_ready_at: float | None = None
        # Set by the engine for a step: called between input preparation and the model
        # call (the async engine hands the previous step's outputs to its event loop
        # there, so that the loop's work overlaps the forward).
        self.before_forward: Any = None
        # Set before execute() by a speculating engine: return the trunk's hidden states
        # with the logits (the MTP drafter's input). The step's ForwardBatch stays in
        # last_batch until the next execute() (the engine commits the DeltaNet state of
        # speculative rows and lays out the drafter's batch from it).
        self.want_hidden = False
        self.last_batch: ForwardBatch | None = None
        # Set before execute(): more int64 segments for the step's one staging copy;
        # their device views are in extra_views afterwards (None if none were staged).
        self.extra_segments: list | None = None
        self.extra_views: list[torch.Tensor] | None = None

    _SEGMENTS = ("upd_rows", "upd_cols", "upd_vals", "st_rows", "st_cols", "st_vals", "page_copies",
                 "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table_rows",
                 "has_initial_state", "logits_indices", "checkpoint_positions", "checkpoint_pages",
                 "speculative", "verify_layout")

    @staticmethod
    def _check_pairs(pairs: np.ndarray, limit: int, what: str) -> None:
        # On the host arrays, before they travel: the device copy is never read back.
        if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= limit):
            raise ValueError(f"{what} pair ids must lie in 0..{limit - 1}, got {pairs.reshape(-1, 2).tolist()}")

    def stage(self, plan: Any, all_positions: Any = ()) -> dict[str, torch.Tensor]:
        """Send everything the step needs to the device in one copy; int64 views by name
        (kept for :meth:`apply_block_table_updates`, :meth:`apply_copies` and
        :meth:`build_batch` of the same step)."""
        num_samples = np.asarray(plan.num_samples, dtype=np.int32)
        qsl = np.asarray(plan.query_start_loc, dtype=np.int64)
        sampling = np.nonzero(num_samples > 0)[0]
        # The last token of each sampling sequence is the row whose logits we need.
        logits_indices = qsl[1:][sampling] - 1
        drafts = getattr(plan, "num_draft_tokens", None)
        nd = np.asarray(drafts, dtype=np.int64) if drafts is not None and len(drafts) else None
        spec = np.nonzero(nd > 0)[0] if nd is not None else np.zeros(0, np.int64)
        if len(spec):
            # An entry with d drafts samples first where a plain decode would (its row 0,
            # the last committed token); its rows 1..d come after everything else.
            if not np.all(num_samples[spec] == 1):
                raise ValueError("an entry carrying drafts must sample exactly one token")
            first = qsl[:-1].copy()
            logits_indices = np.where(nd[sampling] > 0, first[sampling], logits_indices)
        if len(all_positions):
            # Then every position of the sequences that want prompt logprobs.
            logits_indices = np.concatenate(
                [logits_indices] + [np.arange(qsl[b], qsl[b + 1], dtype=np.int64) for b in all_positions]
            )
        self._num_prompt_rows = len(logits_indices) - len(sampling)
        if len(spec):
            logits_indices = np.concatenate(
                [logits_indices] + [np.arange(qsl[b] + 1, qsl[b + 1], dtype=np.int64) for b in spec])
        self._spec = spec
        # KV copy-on-write and state copies are all whole-page copies in one arena.
        page_copies = np.concatenate([np.asarray(plan.block_copies, dtype=np.int64).reshape(-1),
                                      np.asarray(plan.state_copies, dtype=np.int64).reshape(-1)])
        self._check_pairs(page_copies, self.cache.num_pages, "copy_pages")
        ck_pos, ck_pages = self._checkpoints(plan, len(qsl) - 1)
        # A step with drafts: the entries' speculative flags, and the verify graphs'
        # slot layout where they may run it (empty otherwise), travel in the same copy.
        flags = layout = _EMPTY
        if len(spec):
            flags = np.zeros(len(qsl) - 1, dtype=np.int64)
            flags[spec] = 1
            g = self.verify_graphs
            # (What VerifyGraphs.can_run asks of the batch: every row samples, no
            # checkpoint; host_layout checks the shape.)
            if g is not None and len(logits_indices) == qsl[-1] and not len(all_positions) and not len(ck_pos):
                layout = g.host_layout(qsl, np.asarray(plan.seq_lens, dtype=np.int64))
                if layout is None:
                    layout = _EMPTY
        segs = [
            plan.block_table_update_rows, plan.block_table_update_cols, plan.block_table_update_values,
            plan.state_table_update_rows, plan.state_table_update_cols, plan.state_table_update_values,
            page_copies, plan.input_ids, plan.positions, plan.slot_mapping,
            qsl, plan.seq_lens, plan.block_table_rows,
            np.asarray(plan.num_computed_tokens) > 0, logits_indices, ck_pos, ck_pages, flags, layout,
        ]
        # Segments another stage of the step asked to travel in this same copy (the
        # sampler's row indices): one host->device copy per step.
        extra, self.extra_segments = self.extra_segments, None
        views = self.staging.stage(segs + list(extra) if extra is not None else segs)
        self._staged = dict(zip(self._SEGMENTS, views))
        self.extra_views = views[len(self._SEGMENTS):] if extra is not None else None
        self._host = (qsl, sampling, num_samples[sampling])
        self._has_checkpoints = len(ck_pos) > 0
        return self._staged

    def _checkpoints(self, plan: Any, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
        """The plan's checkpoint requests as the kernels take them: positions ``[B]`` and a
        ``[B, state_pages]`` table (rows of entries without a checkpoint are -1, never
        read); both empty when the step writes none."""
        pos = np.asarray(plan.checkpoint_positions, dtype=np.int64).reshape(-1)
        want = np.nonzero(pos >= 0)[0] if len(pos) else pos
        if not len(want):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if len(pos) != num_seqs:
            raise ValueError(f"checkpoint_positions has {len(pos)} entries for {num_seqs} scheduled sequences")
        flat = np.asarray(plan.checkpoint_pages, dtype=np.int64).reshape(-1)
        if flat.size != len(want) * self.state_pages:
            raise ValueError(f"checkpoint_pages has {flat.size} ids for {len(want)} checkpoints of "
                             f"{self.state_pages} pages")
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.cache.num_pages):
            raise ValueError(f"checkpoint pages must lie in 0..{self.cache.num_pages - 1}")
        table = np.full((num_seqs, self.state_pages), -1, dtype=np.int64)
        table[want] = flat.reshape(len(want), self.state_pages)
        return pos, table.reshape(-1)

    def apply_block_table_updates(self, plan: Any) -> None:
        """The block table's and the state page table's changed cells."""
        s = self._staged
        if s["upd_rows"].numel():
            self.block_table_buf[s["upd_rows"], s["upd_cols"]] = s["upd_vals"].to(torch.int32)
        if s["st_rows"].numel():
            self.state_table_buf[s["st_rows"], s["st_cols"]] = s["st_vals"].to(torch.int32)

    def apply_copies(self, plan: Any) -> None:
        s = self._staged
        if s["page_copies"].numel():
            self.cache.copy_pages(s["page_copies"].view(-1, 2))

    def build_batch(
        self, plan: Any, all_positions: Any = ()
    ) -> tuple[ForwardBatch, np.ndarray, np.ndarray]:
        """The step's ForwardBatch over the views :meth:`stage` sent (call it first)."""
        s = self._staged
        qsl, sampling, num_samples = self._host
        # Only the columns the longest sequence uses: the kernels' work (and split-KV
        # choice) follows the batch's real context, not max_model_len.
        seq_lens = np.asarray(plan.seq_lens)
        width = -(-int(seq_lens.max()) // self.cache.block_size) if len(seq_lens) else 1
        rows, host_rows = s["block_table_rows"], np.asarray(plan.block_table_rows)
        ck = {}
        if self._has_checkpoints:
            ck = dict(checkpoint_positions=s["checkpoint_positions"].to(torch.int32),
                      checkpoint_pages=s["checkpoint_pages"].to(torch.int32).view(-1, self.state_pages))
        if self._host_fields is not None:
            qsl32, seq_lens32, has_initial = self._host_views(plan, seq_lens)
        else:
            qsl32 = s["query_start_loc"].to(torch.int32)
            seq_lens32 = s["seq_lens"].to(torch.int32)
            has_initial = s["has_initial_state"].to(torch.bool)
        batch = ForwardBatch(
            input_ids=s["input_ids"],
            positions=s["positions"],
            slot_mapping=s["slot_mapping"],
            query_start_loc=qsl32,
            seq_lens=seq_lens32,
            block_tables=self._table_rows("block", self.block_table_buf, width, host_rows, rows),
            state_pages=self._table_rows("state", self.state_table_buf, None, host_rows, rows),
            has_initial_state=has_initial,
            logits_indices=s["logits_indices"],
            **ck,
        )
        if len(self._spec):
            batch.speculative = s["speculative"].to(torch.bool)
            batch.speculative_host = self._spec.tolist()
            if s["verify_layout"].numel():
                batch.op_plans[VERIFY_LAYOUT] = s["verify_layout"]
            if self.device.type != "cpu":
                # The runs' layout comes from these host copies: no read back per step.
                batch.query_start_loc_host = qsl.tolist()
                batch.seq_lens_host = seq_lens.tolist()
        return batch, sampling, num_samples

    def _host_views(self, plan: Any, seq_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU: ``query_start_loc``, ``seq_lens`` and ``has_initial_state`` of the batch,
        written into the persistent host buffers (views valid until the next step)."""
        n = len(seq_lens)
        if self._host_field_views[0] != n:
            views = tuple(t[: n + 1] if i == 0 else t[:n] for i, t in enumerate(self._host_fields))
            self._host_field_views = (n, views, tuple(v.numpy() for v in views))
        _, views, arrays = self._host_field_views
        np.copyto(arrays[0], plan.query_start_loc, casting="unsafe")
        np.copyto(arrays[1], seq_lens, casting="unsafe")
        np.greater(plan.num_computed_tokens, 0, out=arrays[2])
        return views

    def _table_rows(self, name: str, buf: torch.Tensor, width: int | None, host_rows: np.ndarray,
                    rows: torch.Tensor) -> torch.Tensor:
        """Rows ``host_rows`` of a persistent table (its first ``width`` columns;
        ``rows``: the same on the device): a view when they are consecutive (the steady
        state: the scheduler hands rows out in admission order), so a decode step copies
        nothing that grows with context (the block table at 16,000 tokens is about
        1,000 columns a row), reused while the batch reads the same rows and columns;
        otherwise a gather."""
        n = len(host_rows)
        if n and (n == 1 or bool((np.diff(host_rows) == 1).all())):
            key = (int(host_rows[0]), n, width)
            last = self._table_views.get(name)
            if last is not None and last[0] == key:
                return last[1]
            r0 = key[0]
            view = (buf if width is None else buf[:, :width])[r0:r0 + n]
            self._table_views[name] = (key, view)
            return view
        return (buf if width is None else buf[:, :width]).index_select(0, rows)

    # ---- speculative decoding's model work after a step (hybridserve.spec) ----------
    # The engine calls these, not the model, so that the tensor-parallel driver's runner
    # can send each to its workers first.
    def commit_speculative(self, accepted: Any) -> None:
        """Advance the last step's speculative entries' DeltaNet state over their first
        ``accepted[b]`` rows (``Qwen3_5ForServing.commit_speculative``)."""
        self.model.commit_speculative(self.last_batch, self.cache, accepted)

    def propose(self, proposer: Any, hidden: torch.Tensor, **kw: Any) -> list:
        """The MTP drafter's passes over the last step (``MTPProposer.propose``)."""
        return proposer.propose(self.last_batch, hidden, **kw)

    def _graphs_for(self, batch: ForwardBatch, spec: np.ndarray, all_positions: Any) -> Any:
        """The captured graphs that run this step, or None (eager): the verify graphs
        for a step with speculative runs, the decode graphs for a pure-decode step
        (those of a speculating engine also return the hidden states); each decides
        whether the batch fits (``can_run``)."""
        if len(all_positions):
            return None
        if len(spec):
            g = self.verify_graphs
            return g if g is not None and g.can_run(batch, len(spec)) else None
        g = self.graphs
        if g is None or (self.want_hidden and not g.return_hidden):
            return None
        return g if g.can_run(batch) else None

    @torch.inference_mode()
    def execute(self, plan: Any, all_positions: Any = ()) -> StepLogits | None:
        """Run one step; ``None`` when the plan schedules nothing. ``all_positions``:
        batch indices whose logits are wanted at every scheduled position too."""
        # The plan's arrays travel in one staging copy; the table updates and copies
        # run before the model reads the caches.
        self.stage(plan, all_positions)
        self.apply_block_table_updates(plan)
        self.apply_copies(plan)
        if len(plan.input_ids) == 0:
            self.inputs_ready_at = time.perf_counter()
            return None
        batch, sampling, num_samples = self.build_batch(plan, all_positions)
        if self.before_forward is not None:
            self.before_forward()
        # The engine's step timer splits "prepare inputs" from "forward" here.
        self.inputs_ready_at = time.perf_counter()
        spec = self._spec
        hidden = None
        self.last_batch = batch
        graphs = self._graphs_for(batch, spec, all_positions)
        if graphs is not None:
            out = graphs.run(batch, self.block_table_buf, self._staged["block_table_rows"])
            logits, hidden = out if graphs.return_hidden else (out, None)
            if not self.want_hidden:
                hidden = None
        elif self.want_hidden:
            logits, hidden = self.model(batch, self.cache, return_hidden=True)
        else:
            logits = self.model(batch, self.cache)
        draft_logits = None
        if len(spec):
            end = len(sampling) + self._num_prompt_rows
            draft_logits, logits = logits[end:], logits[:end]
        if not len(all_positions):
            if draft_logits is None and hidden is None:
                return StepLogits(logits=logits, batch_index=sampling, num_samples=num_samples)
            return StepLogits(logits=logits, batch_index=sampling, num_samples=num_samples,
                              draft_logits=draft_logits, spec_entries=spec, hidden=hidden)
        qsl = np.asarray(plan.query_start_loc)
        spans, row = [], 0  # rows of prompt_logits
        for b in all_positions:
            count = int(qsl[b + 1] - qsl[b])
            spans.append((int(b), row, count))
            row += count
        return StepLogits(logits=logits[: len(sampling)], batch_index=sampling, num_samples=num_samples,
                          prompt_logits=logits[len(sampling):], prompt_spans=spans,
                          draft_logits=draft_logits, spec_entries=spec, hidden=hidden)
