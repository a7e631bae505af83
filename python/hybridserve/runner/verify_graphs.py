"""CUDA graphs for speculative verify steps: every sequence runs up to k + 1 rows.

A verify step of speculative decoding (:mod:`hybridserve.spec`) is a decode step whose
drafting sequences carry the last accepted token plus their drafts. Each sequence of
such a step gets a slot of ``k + 1`` rows in a graph captured per batch-size bucket, as
pure-decode steps have (:mod:`hybridserve.runner.cuda_graphs`, whose static buffers,
padding and bucket choice this reuses). A graph runs the step when every row of it
samples and no sequence has more than ``k + 1`` rows; this holds for drafting sequences
(k drafts, or fewer near ``max_tokens``) and plain decodes beside them (a request
resting for low acceptance, a beam). Steps with prefill rows, checkpoints or prompt
logprobs run eagerly.

Why the slots work: a verify run only reads its DeltaNet state, so the rows that fill
a slot after a sequence's own rows change nothing but their own outputs, which are
dropped; they write no K/V (slot mapping -1) and see one key. A plain decode in the
batch runs read-only too, and the commit advances its state over its one row, as
it does a drafting sequence's over its accepted rows.

What the graph reads beyond a decode graph's inputs, all in static buffers:

* ``speculative`` all True;
* the attention layout of the rows as decodes, one query per row
  (``op_plans[DECODE_ROWS]``: row ``j`` of a run of ``m`` rows over ``L`` tokens sees
  ``L - m + 1 + j`` of them, through its sequence's block-table row), from host copies
  of the run lengths (the runner's; nothing is read back);
* the ring the commit replays (``batch.spec_ring``), preset with the bucket's uniform
  layout, so the forward does no host work; the tensors each DeltaNet layer records
  there are the graph's, rewritten by every replay. After a replay the caller's batch
  gets a ring over those tensors restricted to its ``n`` sequences, so
  :meth:`~hybridserve.model.qwen3_5.Qwen3_5ForServing.commit_speculative` and the
  drafter (which reads the returned hidden states) work as after an eager forward.

The batch's rows are scattered into their slots before the replay, and the logits
come back in the batch's own ``logits_indices`` order, the hidden states in its row
order. Where the rows go and every slot's attention length are computed on the host
(:meth:`VerifyGraphs.host_layout`) from the plan's arrays, and the runner sends them in
the step's one staging copy (``op_plans[VERIFY_LAYOUT]``), so a replay adds no
host-to-device transfer of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.native_buffers import DECODE_ROWS
from hybridserve.runner.cuda_graphs import DecodeGraphs

# ForwardBatch.op_plans key: the step's staged host_layout (a device int64 view).
VERIFY_LAYOUT = "verify_layout"


class VerifyGraphs(DecodeGraphs):
    """Captured verify forwards of up to ``k`` drafts per sequence, for each bucket up
    to ``max_num_seqs`` (the largest batch that drafts)."""

    kind = "verify"

    def __init__(self, model: torch.nn.Module, cache: Any, *, num_speculative_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int, scratch_pages: list[int], replay_eagerly: bool = False,
                 pool: Any = None) -> None:
        """``pool``: a capture memory pool to share (the decode graphs'; only one
        graph's outputs are live at a time)."""
        k = int(num_speculative_tokens)
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        super().__init__(model, cache, max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks_per_seq,
                         scratch_pages=scratch_pages, replay_eagerly=replay_eagerly, return_hidden=True,
                         rows_per_seq=k + 1)
        self.k = k
        self.pool = pool
        n, r = self.buckets[-1], self.rows
        d = dict(device=self.device)
        self.speculative = torch.ones(n, dtype=torch.bool, **d)
        # The runs as decodes: entry i = row i, one query each.
        self.row_starts = torch.arange(n * r + 1, dtype=torch.int32, **d)
        self.row_lens = torch.ones(n * r, dtype=torch.int32, **d)
        self.row_tables = torch.zeros(n * r, max_blocks_per_seq, dtype=torch.int32, **d)
        # Per bucket: the ring the captured forward filled (layer index -> tensors).
        self.rings: dict[int, dict] = {}
        # The last replay's slot of each of the batch's rows (device int64 [T]).
        self._slot_of: torch.Tensor | None = None

    def _batch(self, b: int) -> ForwardBatch:
        batch = super()._batch(b)
        t = b * self.rows
        batch.speculative = self.speculative[:b]
        batch.op_plans[DECODE_ROWS] = (self.row_starts[:t + 1], self.row_lens[:t], self.row_tables[:t])
        batch.spec_ring = {"seqs": list(range(b)), "lens": [self.rows] * b, "all": True, "preset": True,
                           "rows": torch.arange(t, device=self.device)}
        return batch

    def _captured(self, b: int, batch: ForwardBatch, out: Any) -> None:
        super()._captured(b, batch, out)
        self.rings[b] = batch.spec_ring

    def _reset_padding(self, start: int, end: int) -> None:
        super()._reset_padding(start, end)
        if end > start:
            r = self.rows
            self.row_lens[start * r:end * r].fill_(1)
            self.row_tables[start * r:end * r].zero_()
            torch.arange(start * r, end * r, out=self.logits_indices[start * r:end * r])

    def can_run(self, batch: ForwardBatch, num_speculative: int = 0) -> bool:
        """A step with speculative runs (``num_speculative`` of them: the host's count)
        whose every row samples, no sequence with more than ``k + 1`` rows, no
        checkpoint, within the largest bucket. The run lengths come from
        ``ForwardBatch.host_query_start_loc`` (on a device, the runner's host copy)."""
        n, r, t = batch.num_seqs, self.rows, batch.num_tokens
        if not (self.graphs and num_speculative > 0 and 0 < n <= self.buckets[-1] and n <= t <= n * r
                and batch.logits_indices.shape[0] == t and batch.checkpoint_positions is None):
            return False
        qsl = batch.host_query_start_loc()
        return all(1 <= qsl[i + 1] - qsl[i] <= r for i in range(n))

    def host_layout(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> np.ndarray | None:
        """Where a step's rows go, as one int64 host array: each row's slot (``[T]``),
        then the slots no row fills, then every slot's attention length (``[n (k + 1)]``;
        row ``j`` of a run of ``m`` rows over ``L`` tokens sees ``L - m + 1 + j``).
        None where no graph takes the step's shape (too many sequences, or a run of
        more than ``k + 1`` rows or none)."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        n, r = len(qsl) - 1, self.rows
        m = np.diff(qsl)
        if not (0 < n <= self.buckets[-1]) or m.min() < 1 or m.max() > r:
            return None
        t, slots = int(qsl[-1]), n * r
        seq = np.repeat(np.arange(n), m)
        j = np.arange(t) - qsl[:-1][seq]
        slot_of = seq * r + j
        row_lens = np.ones(slots, dtype=np.int64)
        row_lens[slot_of] = lens[seq] - m[seq] + 1 + j
        empty = np.ones(slots, dtype=bool)
        empty[slot_of] = False
        return np.concatenate([slot_of, np.nonzero(empty)[0], row_lens])

    def _fill(self, batch: ForwardBatch, n: int) -> None:
        r = self.rows
        t, slots = batch.num_tokens, n * r
        dev = batch.op_plans.get(VERIFY_LAYOUT)
        if dev is None:
            # A caller that staged nothing (the runner stages it): computed and sent here.
            host = self.host_layout(batch.host_query_start_loc(), batch.host_seq_lens())
            dev = torch.from_numpy(host).to(self.device)
        self._slot_of = slot_of_t = dev[:t]
        self.input_ids[:slots].zero_()
        self.input_ids.index_copy_(0, slot_of_t, batch.input_ids)
        self.positions[:slots].zero_()
        self.positions.index_copy_(0, slot_of_t, batch.positions)
        self.slot_mapping[:slots].fill_(-1)
        self.slot_mapping.index_copy_(0, slot_of_t, batch.slot_mapping)
        self.row_lens[:slots].copy_(dev[slots:])
        self.row_tables[:slots].view(n, r, -1).copy_(self.block_tables[:n].unsqueeze(1).expand(-1, r, -1))
        # The batch's logits rows first, in its order; the empty slots after them.
        torch.index_select(slot_of_t, 0, batch.logits_indices, out=self.logits_indices[:t])
        self.logits_indices[t:slots].copy_(dev[t:slots])

    def _outputs(self, batch: ForwardBatch, n: int, b: int) -> Any:
        logits, hidden = self.outputs[b]
        ring = self.rings[b]
        qsl = batch.host_query_start_loc()
        # The caller's batch commits from the graph's ring, over its own sequences; a
        # sequence without drafts ("plain") commits its one row.
        spec = set(batch.speculative_seqs())
        batch.spec_ring = {"seqs": list(range(n)), "lens": [self.rows] * n, "all": False,
                           "plain": [i for i in range(n) if i not in spec and qsl[i + 1] - qsl[i] == 1],
                           "rows": ring["rows"][:n * self.rows],
                           **{key: v for key, v in ring.items() if isinstance(key, int)}}
        return logits[:batch.num_tokens], hidden.index_select(0, self._slot_of)


__all__ = ["VerifyGraphs", "VERIFY_LAYOUT"]
