"""CUDA graphs for speculative verify steps: every sequence runs k + 1 rows.

A verify step of speculative decoding (:mod:`hybridserve.spec`) is a decode step whose
sequences carry the last accepted token plus k drafts. When every sequence of the batch
is such a run (k drafts each, no prefill rows, no checkpoints, no prompt logprobs) the
step has the fixed shape ``B x (k + 1)`` and replays a graph captured per batch-size
bucket, as pure-decode steps do (:mod:`hybridserve.runner.cuda_graphs`, whose static
buffers, padding and bucket choice this reuses); other verify steps run eagerly.

What a verify forward needs beyond a decode's, all in static buffers the replay reads:

* ``speculative`` all True: the DeltaNet layers read their state pages and write
  nothing back;
* the attention layout of the runs as decodes, one query per row
  (``op_plans[DECODE_ROWS]``: row ``j`` of a sequence of ``L`` tokens sees
  ``L - k + j`` of them, through its sequence's block-table row), computed on the
  device from ``seq_lens`` and the gathered block tables before each replay;
* the ring the commit replays (``batch.spec_ring``): preset with the bucket's uniform
  layout, so the forward does not build it on the host; the tensors each DeltaNet layer
  records there are the graph's, rewritten by every replay. After a replay the
  caller's batch gets a ring over those tensors restricted to its ``n`` sequences, so
  :meth:`~hybridserve.model.qwen3_5.Qwen3_5ForServing.commit_speculative` (and the
  drafter, which reads the returned hidden states) work as after an eager forward.

The logits come back in the batch's own ``logits_indices`` order (copied into the
static buffer; padding rows after them), with the hidden states of every row.
Padding sequences run k + 1 rows on the scratch state pages with slot mapping -1, one
visible key each, and are dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.native_buffers import DECODE_ROWS
from hybridserve.runner.cuda_graphs import DecodeGraphs


class VerifyGraphs(DecodeGraphs):
    """Captured verify forwards of ``k`` drafts per sequence, for each bucket up to
    ``max_num_seqs`` (the largest batch that drafts)."""

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
        # How many of its sequence's tokens row j of a run does not see: k - j.
        self.row_back = torch.arange(r - 1, -1, -1, dtype=torch.int32, **d)
        self.row_lens = torch.ones(n * r, dtype=torch.int32, **d)
        self.row_tables = torch.zeros(n * r, max_blocks_per_seq, dtype=torch.int32, **d)
        # Per bucket: the ring the captured forward filled (layer index -> tensors).
        self.rings: dict[int, dict] = {}

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
        """Every sequence a speculative run (``num_speculative`` of them: the host's
        count, so nothing is read back from the device) of ``k + 1`` rows whose rows
        all return logits, no checkpoint, within the largest bucket."""
        n, r = batch.num_seqs, self.rows
        return bool(self.graphs) and 0 < n <= self.buckets[-1] and num_speculative == n and \
            batch.num_tokens == n * r and batch.logits_indices.shape[0] == n * r and \
            batch.checkpoint_positions is None

    def _fill(self, batch: ForwardBatch, n: int) -> None:
        r = self.rows
        t = n * r
        self.logits_indices[:t].copy_(batch.logits_indices)
        # Row j of sequence i sees seq_lens[i] - (k - j) tokens, through its table row.
        torch.sub(self.seq_lens[:n].unsqueeze(1), self.row_back, out=self.row_lens[:t].view(n, r))
        self.row_tables[:t].view(n, r, -1).copy_(self.block_tables[:n].unsqueeze(1).expand(-1, r, -1))

    def _outputs(self, batch: ForwardBatch, n: int, b: int) -> Any:
        logits, hidden = self.outputs[b]
        t = n * self.rows
        ring = self.rings[b]
        # The caller's batch commits from the graph's ring, over its own sequences.
        batch.spec_ring = {"seqs": list(range(n)), "lens": [self.rows] * n, "all": True,
                           "rows": ring["rows"][:t],
                           **{key: v for key, v in ring.items() if isinstance(key, int)}}
        return logits[:t], hidden[:t]


__all__ = ["VerifyGraphs"]
