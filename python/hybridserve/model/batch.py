"""The inputs of one model step over a flattened batch (prefill chunks and decodes mixed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class ForwardBatch:
    """One step over ``B`` sequences whose scheduled tokens are concatenated into ``T`` rows.

    All tensors live on the model's device. Sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]`` (in any mix: a whole prompt, a prefill
    chunk continuing earlier ones, or one decode token); those rows are the LAST
    ``q_len`` of its ``seq_lens[b]`` tokens.

    * ``input_ids`` int64 ``[T]``; ``positions`` int64 ``[T]`` (absolute, from 0).
    * ``slot_mapping`` int64 ``[T]``: where each row's K/V goes in the paged cache,
      ``block * block_size + offset``; negative = padding row, not written.
    * ``query_start_loc`` int32 ``[B+1]``, ``seq_lens`` int32 ``[B]`` (tokens with K/V
      after this step: computed before + scheduled now).
    * ``block_tables`` int32 ``[B, max_blocks]``, padded with 0 past each sequence's end.
    * ``state_pages`` int32 ``[B, state_pages]``: each sequence's state page table row
      (where its DeltaNet state lives in the arena); ``has_initial_state`` bool ``[B]``:
      False = conv and recurrent state start from zeros (a new or recomputed sequence),
      True = continue from the pages.
    * ``checkpoint_positions`` int32 ``[B]`` or None: ``k >= 1`` = also write the state
      after the sequence's first ``k`` scheduled tokens to ``checkpoint_pages[b]``
      (int32 ``[B, state_pages]``, read only where ``k >= 1``); ``-1`` = none.
    * ``logits_indices`` int64 ``[S]``: rows of ``T`` whose logits are wanted, in the
      order the logits come back; only these rows go through the final norm's output
      projection (the LM head).
    * ``speculative`` bool ``[B]`` or None: True = a verify run of speculative decoding
      (the last accepted token plus the drafts). Its DeltaNet layers read the sequence's
      conv and recurrent state from the pages but do not write them back; instead each
      layer keeps the run's inputs in :attr:`spec_ring`, and
      :meth:`~hybridserve.model.qwen3_5.Qwen3_5ForServing.commit_speculative` replays the
      accepted rows into the pages once acceptance is known. Attention layers write K/V
      for every row as usual. Never with a checkpoint (``checkpoint_positions[b]``
      must be -1 there).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_pages: torch.Tensor
    has_initial_state: torch.Tensor
    logits_indices: torch.Tensor
    checkpoint_positions: torch.Tensor | None = None
    checkpoint_pages: torch.Tensor | None = None
    speculative: torch.Tensor | None = None
    # Filled by the forward of a batch with speculative runs: per DeltaNet layer index,
    # what commit_speculative replays (the pre-conv inputs and the gate inputs a, b of
    # the speculative runs' rows; see Qwen3_5ForServing.commit_speculative). Per step:
    # dropped with the batch.
    spec_ring: dict | None = field(default=None, repr=False, compare=False)
    # Host copies the caller may already have. The layouts of speculative runs
    # (Qwen3_5ForServing._open_ring, decode_rows_layout) read them instead of the
    # tensors, so on a device they read nothing back (the runner sets them there).
    query_start_loc_host: list[int] | None = field(default=None, repr=False)
    seq_lens_host: list[int] | None = field(default=None, repr=False)
    # The indices of the speculative sequences, when the caller has them on the host.
    speculative_host: list[int] | None = field(default=None, repr=False)
    # Per-step layouts the CPU ops derive from the fields above (groups, gather
    # indices), built by the first layer that needs one and reused by the others
    # (see hybridserve.kernels.ops). Tied to this step: build a new batch per step.
    op_plans: dict = field(default_factory=dict, repr=False, compare=False)

    def host_query_start_loc(self) -> list[int]:
        """``query_start_loc`` as a host list: the caller's copy where it set one (no
        read back from a device), else the tensor's values."""
        return self.query_start_loc_host or self.query_start_loc.tolist()

    def host_seq_lens(self) -> list[int]:
        """``seq_lens`` as a host list, the same way."""
        return self.seq_lens_host or self.seq_lens.tolist()

    def speculative_seqs(self) -> list[int]:
        """Indices of the speculative sequences (host list; empty when none)."""
        if self.speculative is None:
            return []
        if self.speculative_host is not None:
            return list(self.speculative_host)
        return torch.nonzero(self.speculative.cpu()).flatten().tolist()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field. O(B) host work."""
        t, b = self.num_tokens, self.num_seqs
        for name, n in (("positions", t), ("slot_mapping", t), ("query_start_loc", b + 1),
                        ("state_pages", b), ("has_initial_state", b)):
            got = int(getattr(self, name).shape[0])
            if got != n:
                raise ValueError(f"ForwardBatch.{name} has {got} entries, expected {n}")
        if self.state_pages.dim() != 2:
            raise ValueError(f"ForwardBatch.state_pages must be [B={b}, state_pages], got {tuple(self.state_pages.shape)}")
        if (self.checkpoint_positions is None) != (self.checkpoint_pages is None):
            raise ValueError("ForwardBatch needs both checkpoint_positions and checkpoint_pages, or neither")
        if self.checkpoint_positions is not None:
            if tuple(self.checkpoint_positions.shape) != (b,) or tuple(self.checkpoint_pages.shape) != tuple(
                    self.state_pages.shape):
                raise ValueError("ForwardBatch.checkpoint_positions must be [B] and checkpoint_pages shaped "
                                 "like state_pages")
        if self.speculative is not None:
            if tuple(self.speculative.shape) != (b,) or self.speculative.dtype != torch.bool:
                raise ValueError(f"ForwardBatch.speculative must be bool [B={b}], got "
                                 f"{self.speculative.dtype} {tuple(self.speculative.shape)}")
            if self.checkpoint_positions is not None and bool(
                    ((self.checkpoint_positions >= 0) & self.speculative).any()):
                raise ValueError("ForwardBatch: a speculative sequence cannot take a state checkpoint "
                                 "(checkpoints go at accepted positions only)")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != b:
            raise ValueError(
                f"ForwardBatch.block_tables must be [B={b}, max_blocks], got {tuple(self.block_tables.shape)}"
            )
        qsl = self.query_start_loc.tolist()
        if qsl[0] != 0 or qsl[-1] != t or any(x > y for x, y in zip(qsl, qsl[1:])):
            raise ValueError(f"ForwardBatch.query_start_loc {qsl} must rise from 0 to T={t}")
        lens = self.seq_lens.tolist()
        for i, n in enumerate(lens):
            if n < qsl[i + 1] - qsl[i]:
                raise ValueError(
                    f"sequence {i} schedules {qsl[i + 1] - qsl[i]} tokens but seq_lens says {n} in total"
                )
        if self.logits_indices.numel() and (
            int(self.logits_indices.min()) < 0 or int(self.logits_indices.max()) >= t
        ):
            raise ValueError(f"ForwardBatch.logits_indices must index rows 0..{t - 1}")

    @classmethod
    def from_lists(
        cls,
        *,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        state_pages: Sequence[Sequence[int]],
        has_initial_state: Sequence[bool],
        logits_indices: Sequence[int],
        checkpoint_positions: Sequence[int] | None = None,
        checkpoint_pages: Sequence[Sequence[int]] | None = None,
        speculative: Sequence[bool] | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Build a batch from host lists; ragged ``block_tables`` are padded with 0."""
        width = max((len(r) for r in block_tables), default=0) or 1
        tables = [list(r) + [0] * (width - len(r)) for r in block_tables]

        def t(x, dtype):
            return torch.tensor(list(x), dtype=dtype, device=device)

        return cls(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            slot_mapping=t(slot_mapping, torch.int64),
            query_start_loc=t(query_start_loc, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(tables), width),
            state_pages=torch.tensor([list(r) for r in state_pages], dtype=torch.int32,
                                     device=device).reshape(len(state_pages), -1),
            has_initial_state=t(has_initial_state, torch.bool),
            logits_indices=t(logits_indices, torch.int64),
            checkpoint_positions=None if checkpoint_positions is None else t(checkpoint_positions, torch.int32),
            checkpoint_pages=None if checkpoint_pages is None else torch.tensor(
                [list(r) for r in checkpoint_pages], dtype=torch.int32, device=device).reshape(len(checkpoint_pages), -1),
            speculative=None if speculative is None else t(speculative, torch.bool),
            query_start_loc_host=list(query_start_loc),
            seq_lens_host=list(seq_lens),
        )
