"""The model runner: turns the scheduler's plan for one step into tensors and runs the model.

The Rust scheduler owns every piece of bookkeeping; the runner only mirrors what the
plan tells it, in this order each step:

1. apply the plan's incremental block-table updates to a persistent
   ``int32[max_num_seqs, max_blocks_per_seq]`` buffer on the model's device (so the
   per-step host->device traffic does not grow with context length);
2. perform the plan's copy-on-write block copies and DeltaNet state-slot copies
   (forks) *before* the model reads the caches;
3. build a :class:`~hybridserve.model.batch.ForwardBatch` over the flattened batch
   (prefill chunks and decode tokens mixed) and run the model, which returns logits
   only for the rows that sample this step.

Everything the step sends to the device (block-table updates, copy lists, token ids,
positions, slot mapping, ..., and the sampler's row indices the engine hands over in
``extra_segments``) is written into one host staging buffer (pinned on CUDA) and copied
once (:class:`hybridserve.staging.StagingBuffer`); index ranges are checked
on the host arrays before they travel, so no step reads device data back. Pure-decode
steps run from captured CUDA graphs when ``graphs`` is set (see
:mod:`hybridserve.runner.cuda_graphs`); every other step runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache import HybridCache
from hybridserve.staging import StagingBuffer


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
        self.staging = StagingBuffer(self.device)
        # A DecodeGraphs (CUDA only, set by the engine); None runs every step eagerly.
        self.graphs: Any = None
        self._staged: dict[str, torch.Tensor] = {}
        # perf_counter() when the last execute() finished preparing its inputs.
        self.inputs_ready_at: float | None = None
        # Set before execute(): more int64 segments for the step's one staging copy;
        # their device views are in extra_views afterwards (None if none were staged).
        self.extra_segments: list | None = None
        self.extra_views: list[torch.Tensor] | None = None

    _SEGMENTS = ("upd_rows", "upd_cols", "upd_vals", "block_copies", "state_copies", "input_ids",
                 "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table_rows",
                 "state_slots", "has_initial_state", "logits_indices")

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
        if len(all_positions):
            # Then every position of the sequences that want prompt logprobs.
            logits_indices = np.concatenate(
                [logits_indices] + [np.arange(qsl[b], qsl[b + 1], dtype=np.int64) for b in all_positions]
            )
        block_copies = np.asarray(plan.block_copies, dtype=np.int64).reshape(-1)
        state_copies = np.asarray(plan.state_copies, dtype=np.int64).reshape(-1)
        self._check_pairs(block_copies, self.cache.num_blocks, "copy_blocks")
        self._check_pairs(state_copies, self.cache.num_state_slots, "copy_state_slots")
        segs = [
            plan.block_table_update_rows, plan.block_table_update_cols, plan.block_table_update_values,
            block_copies, state_copies, plan.input_ids, plan.positions, plan.slot_mapping,
            qsl, plan.seq_lens, plan.block_table_rows, plan.state_slots,
            np.asarray(plan.num_computed_tokens) > 0, logits_indices,
        ]
        # Segments another stage of the step asked to travel in this same copy (the
        # sampler's row indices): one host->device copy per step.
        extra, self.extra_segments = self.extra_segments, None
        views = self.staging.stage(segs + list(extra) if extra is not None else segs)
        self._staged = dict(zip(self._SEGMENTS, views))
        self.extra_views = views[len(self._SEGMENTS):] if extra is not None else None
        self._host = (qsl, sampling, num_samples[sampling])
        return self._staged

    def apply_block_table_updates(self, plan: Any) -> None:
        s = self._staged
        if s["upd_rows"].numel():
            self.block_table_buf[s["upd_rows"], s["upd_cols"]] = s["upd_vals"].to(torch.int32)

    def apply_copies(self, plan: Any) -> None:
        s = self._staged
        if s["block_copies"].numel():
            self.cache.copy_blocks(s["block_copies"].view(-1, 2))
        if s["state_copies"].numel():
            self.cache.copy_state_slots(s["state_copies"].view(-1, 2))

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
        batch = ForwardBatch(
            input_ids=s["input_ids"],
            positions=s["positions"],
            slot_mapping=s["slot_mapping"],
            query_start_loc=s["query_start_loc"].to(torch.int32),
            seq_lens=s["seq_lens"].to(torch.int32),
            block_tables=self.block_table_buf[:, :width].index_select(0, s["block_table_rows"]),
            state_slots=s["state_slots"],
            has_initial_state=s["has_initial_state"].to(torch.bool),
            logits_indices=s["logits_indices"],
        )
        return batch, sampling, num_samples

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
        # The engine's step timer splits "prepare inputs" from "forward" here.
        self.inputs_ready_at = time.perf_counter()
        if self.graphs is not None and not len(all_positions) and self.graphs.can_run(batch):
            logits = self.graphs.run(batch, self.block_table_buf, self._staged["block_table_rows"])
        else:
            logits = self.model(batch, self.cache)
        if not len(all_positions):
            return StepLogits(logits=logits, batch_index=sampling, num_samples=num_samples)
        qsl = np.asarray(plan.query_start_loc)
        spans, row = [], 0  # rows of prompt_logits
        for b in all_positions:
            count = int(qsl[b + 1] - qsl[b])
            spans.append((int(b), row, count))
            row += count
        return StepLogits(logits=logits[: len(sampling)], batch_index=sampling, num_samples=num_samples,
                          prompt_logits=logits[len(sampling):], prompt_spans=spans)
