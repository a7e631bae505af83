"""CUDA graphs for pure-decode steps.

A decode step of a hybrid model is hundreds of small kernel launches (per layer: norms,
projections, rope, the cache write, attention or the conv + delta rule, the MLP), each
paying Python and launch overhead that dwarfs the kernels at small batch sizes. The
model forward of a pure-decode batch (every sequence schedules exactly one token) is
therefore captured once per batch-size bucket at start-up and replayed:

* buckets 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs`` (vLLM's);
* a batch of B sequences runs the smallest bucket >= B; rows B.. are padding that
  writes nothing: slot mapping -1 (no K/V write), ``has_initial_state`` False and a
  scratch DeltaNet state that no sequence owns (``layout.state_pages`` pages of the
  arena the scheduler never hands out: the planner reserves and counts them), ``seq_lens``
  1 over block 0 (read, never written), and their logits are dropped. Padding rows all
  share the scratch pages: they write garbage there that nothing reads;
* inputs are copied into static buffers before the replay (device-to-device copies of
  the step's staged views; no host transfer); the block tables are gathered at the full
  ``max_blocks_per_seq`` width, so one graph serves every context length;
* mixed prefill/decode steps, prompt-logprob steps, steps that write a DeltaNet
  checkpoint and batches over the largest bucket run eagerly;
* with ``return_hidden`` (a speculating engine) each graph also returns the trunk's
  hidden states, the MTP drafter's input; the verify steps of speculative decoding
  (slots of k + 1 rows per sequence) replay graphs of their own, built on this class
  (:mod:`hybridserve.runner.verify_graphs`).

Under tensor parallelism (:mod:`hybridserve.parallel`, NCCL) the forward's all-reduces
and the LM head's all-gather are inside the captured graphs; every rank captures the
same buckets in the same order and replays the same bucket each step (the same plan),
so the collectives match (written; not yet run on GPUs).

Capture logs its time and the device memory it took. ``enforce_eager`` (vLLM's
``--enforce-eager``) turns graphs off. Only CUDA devices use this module; the CPU
path never constructs it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hybridserve.model.batch import ForwardBatch

logger = logging.getLogger("hybridserve.cuda_graphs")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to (and including) ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    out += list(range(16, max_num_seqs + 1, 8))
    if out[-1] != max_num_seqs:
        out.append(max_num_seqs)
    return out


def bucket_for(buckets: list[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class DecodeGraphs:
    """Captured forwards of ``model`` over ``cache`` for each decode bucket."""

    # What the capture's log line calls these graphs.
    kind = "decode"

    def __init__(
        self,
        model: torch.nn.Module,
        cache: Any,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_pages: list[int],
        replay_eagerly: bool = False,
        return_hidden: bool = False,
        rows_per_seq: int = 1,
    ) -> None:
        """``replay_eagerly`` is a test hook: capture nothing and, at each replay, run
        the model on the static (padded) buffers, so that the input copies, padding
        and output slicing can be checked on any device. ``return_hidden``: the graphs
        also return the trunk's hidden states (a speculating engine's drafter input).
        ``rows_per_seq``: every sequence schedules this many rows (1 for decode; the
        verify graphs of :mod:`hybridserve.runner.verify_graphs` set k + 1)."""
        if rows_per_seq < 1:
            raise ValueError(f"rows_per_seq must be >= 1, got {rows_per_seq}")
        self.model = model
        self.return_hidden = return_hidden
        self.rows = rows_per_seq
        self.cache = cache
        self.device = cache.device
        self.replay_eagerly = replay_eagerly
        if self.device.type != "cuda" and not replay_eagerly:
            raise ValueError("CUDA graphs need a CUDA device; use enforce_eager on other devices")
        scratch_pages = [int(p) for p in scratch_pages]
        if len(scratch_pages) != cache.state_pages or not all(0 <= p < cache.num_pages for p in scratch_pages):
            raise ValueError(f"scratch_pages must be {cache.state_pages} page ids of the cache "
                             f"(0..{cache.num_pages - 1}), got {scratch_pages}")
        self.buckets = decode_buckets(max_num_seqs)
        self.scratch_pages = torch.tensor(scratch_pages, dtype=torch.int32, device=self.device)
        n, r = self.buckets[-1], self.rows
        d = dict(device=self.device)
        # Token rows: sequence i owns rows i*r .. i*r + r - 1.
        self.input_ids = torch.zeros(n * r, dtype=torch.int64, **d)
        self.positions = torch.zeros(n * r, dtype=torch.int64, **d)
        self.slot_mapping = torch.full((n * r,), -1, dtype=torch.int64, **d)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **d) * r
        self.seq_lens = torch.full((n,), r, dtype=torch.int32, **d)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, **d)
        self.state_pages = self.scratch_pages.repeat(n, 1)
        self.has_initial_state = torch.zeros(n, dtype=torch.bool, **d)
        self.logits_indices = torch.arange(n * r, dtype=torch.int64, **d)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per bucket: the logits, or (logits, hidden) with return_hidden.
        self.outputs: dict[int, Any] = {}
        # The capture's memory pool (shared by every bucket; VerifyGraphs share it too).
        self.pool: Any = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0

    def _batch(self, b: int) -> ForwardBatch:
        """The bucket's batch over the static buffers (a new object per call: a batch
        carries per-step plans)."""
        t = b * self.rows
        return ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            state_pages=self.state_pages[:b],
            has_initial_state=self.has_initial_state[:b],
            logits_indices=self.logits_indices[:t],
        )

    def _forward(self, batch: ForwardBatch) -> Any:
        return self.model(batch, self.cache, return_hidden=True) if self.return_hidden else \
            self.model(batch, self.cache)

    def _reset_padding(self, start: int, end: int) -> None:
        """Sequences ``start .. end-1`` become padding."""
        if end > start:
            r = self.rows
            self.slot_mapping[start * r:end * r].fill_(-1)
            self.seq_lens[start:end].fill_(r)
            self.block_tables[start:end].zero_()
            self.state_pages[start:end].copy_(self.scratch_pages.expand(end - start, -1))
            self.has_initial_state[start:end].fill_(False)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool); log time and memory."""
        if self.replay_eagerly:
            self._reset_padding(0, self.buckets[-1])
            for b in self.buckets:
                self.graphs[b] = _EagerReplay(self, b)
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self._reset_padding(0, self.buckets[-1])
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            # Warm up outside the graph (Triton compiles, lazy buffers are made).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(self._batch(b))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            batch = self._batch(b)
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(batch)
            self.pool = graph.pool()
            self.graphs[b] = graph
            self._captured(b, batch, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured CUDA graphs for %d %s batch sizes (%s) in %.1f s using %.1f MiB",
            len(self.buckets), self.kind, ",".join(map(str, self.buckets)), self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def _captured(self, b: int, batch: ForwardBatch, out: Any) -> None:
        """Keep what bucket ``b``'s replays leave behind: its outputs."""
        self.outputs[b] = out

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure-decode batch (one token per sequence, no checkpoint) within the largest bucket."""
        b = batch.num_seqs
        return bool(self.graphs) and 0 < b <= self.buckets[-1] and batch.num_tokens == b and \
            batch.logits_indices.shape[0] == b and batch.checkpoint_positions is None

    def run(self, batch: ForwardBatch, block_table_buf: torch.Tensor, rows: torch.Tensor) -> Any:
        """Replay the bucket for ``batch``; logits ``[S, V]`` (with ``return_hidden``
        ``(logits, hidden [T, H])``), views into the graph's outputs, valid until the
        next replay. ``block_table_buf``/``rows``: the runner's persistent table and the
        batch's rows in it, gathered at full width."""
        n = batch.num_seqs
        b = bucket_for(self.buckets, n)
        self.seq_lens[:n].copy_(batch.seq_lens)
        torch.index_select(block_table_buf, 0, rows, out=self.block_tables[:n])
        self.state_pages[:n].copy_(batch.state_pages)
        self.has_initial_state[:n].copy_(batch.has_initial_state)
        self._fill(batch, n)
        # A smaller batch after a larger one leaves stale rows in the bucket's padding.
        self._reset_padding(n, b)
        self.graphs[b].replay()
        self.replays += 1
        return self._outputs(batch, n, b)

    def _fill(self, batch: ForwardBatch, n: int) -> None:
        """The token rows' inputs (and, in subclasses, what else the graph reads)."""
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)

    def _outputs(self, batch: ForwardBatch, n: int, b: int) -> Any:
        out = self.outputs[b]
        logits, hidden = out if self.return_hidden else (out, None)
        # Sampling rows are in batch order; all decode rows sample.
        logits = logits[:n] if batch.logits_indices.shape[0] == n else logits.index_select(0, batch.logits_indices)
        return (logits, hidden[:n]) if self.return_hidden else logits


class _EagerReplay:
    """Stands in for a captured graph (``replay_eagerly``): runs the model on the
    bucket's static buffers and leaves the logits where a replay would."""

    def __init__(self, owner: DecodeGraphs, b: int) -> None:
        self.owner, self.b = owner, b

    def replay(self) -> None:
        o = self.owner
        batch = o._batch(self.b)
        o._captured(self.b, batch, o._forward(batch))


__all__ = ["DecodeGraphs", "decode_buckets", "bucket_for"]
