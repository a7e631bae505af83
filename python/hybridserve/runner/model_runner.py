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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache import HybridCache


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

    def _tensor(self, array: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.to(device=self.device, dtype=dtype, non_blocking=True)

    def apply_block_table_updates(self, plan: Any) -> None:
        rows = plan.block_table_update_rows
        if len(rows) == 0:
            return
        r = self._tensor(rows, torch.long)
        c = self._tensor(plan.block_table_update_cols, torch.long)
        v = self._tensor(plan.block_table_update_values, torch.int32)
        self.block_table_buf[r, c] = v

    def apply_copies(self, plan: Any) -> None:
        block_copies = np.asarray(plan.block_copies)
        if block_copies.size:
            self.cache.copy_blocks(self._tensor(block_copies.reshape(-1, 2), torch.long))
        state_copies = np.asarray(plan.state_copies)
        if state_copies.size:
            self.cache.copy_state_slots(self._tensor(state_copies.reshape(-1, 2), torch.long))

    def build_batch(
        self, plan: Any, all_positions: Any = ()
    ) -> tuple[ForwardBatch, np.ndarray, np.ndarray]:
        num_samples = np.asarray(plan.num_samples, dtype=np.int32)
        qsl = np.asarray(plan.query_start_loc, dtype=np.int32)
        sampling = np.nonzero(num_samples > 0)[0]
        # The last token of each sampling sequence is the row whose logits we need.
        logits_indices = qsl[1:][sampling].astype(np.int64) - 1
        if len(all_positions):
            # Then every position of the sequences that want prompt logprobs.
            logits_indices = np.concatenate(
                [logits_indices] + [np.arange(qsl[b], qsl[b + 1], dtype=np.int64) for b in all_positions]
            )
        rows = self._tensor(plan.block_table_rows, torch.long)
        # Only the columns the longest sequence uses: the kernels' work (and split-KV
        # choice) follows the batch's real context, not max_model_len.
        seq_lens = np.asarray(plan.seq_lens)
        width = -(-int(seq_lens.max()) // self.cache.block_size) if len(seq_lens) else 1
        batch = ForwardBatch(
            input_ids=self._tensor(plan.input_ids, torch.long),
            positions=self._tensor(plan.positions, torch.long),
            slot_mapping=self._tensor(plan.slot_mapping, torch.long),
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(plan.seq_lens, torch.int32),
            block_tables=self.block_table_buf[:, :width].index_select(0, rows),
            state_slots=self._tensor(plan.state_slots, torch.long),
            has_initial_state=self._tensor(np.asarray(plan.num_computed_tokens) > 0, torch.bool),
            logits_indices=self._tensor(logits_indices, torch.long),
        )
        return batch, sampling, num_samples[sampling]

    @torch.inference_mode()
    def execute(self, plan: Any, all_positions: Any = ()) -> StepLogits | None:
        """Run one step; ``None`` when the plan schedules nothing. ``all_positions``:
        batch indices whose logits are wanted at every scheduled position too."""
        self.apply_block_table_updates(plan)
        self.apply_copies(plan)
        if len(plan.input_ids) == 0:
            return None
        batch, sampling, num_samples = self.build_batch(plan, all_positions)
        logits = self.model(batch, self.cache)
        if not len(all_positions):
            return StepLogits(logits=logits, batch_index=sampling, num_samples=num_samples)
        qsl = np.asarray(plan.query_start_loc)
        spans, row = [], len(sampling)
        for b in all_positions:
            count = int(qsl[b + 1] - qsl[b])
            spans.append((int(b), row, count))
            row += count
        return StepLogits(logits=logits[: len(sampling)], batch_index=sampling, num_samples=num_samples,
                          prompt_logits=logits[len(sampling):], prompt_spans=spans)
