"""The MTP drafter: k draft tokens per decoding sequence from the checkpoint's own
multi-token-prediction layer, reused k times (as vLLM does with ``mtp_num_hidden_layers: 1``).

After every step the layer first runs over the rows the step committed (the "MTP
prefill"): row p combines the trunk's hidden state at p with the embedding of token
p+1 and writes the layer's K/V at p, in the layer's own paged KV (one more attention
layer in the arena, same block tables and slots as the trunk). That keeps the layer's
context complete for every position, prompts included, so its first draft sees what the
trunk saw. Its last row per sequence predicts draft 1; each further draft is one more
row per sequence, fed the layer's own output state and the previous draft, at the next
position (the scheduler reserves those lookahead slots).

Drafts are the layer's argmax over the draft vocabulary (the token ids below
``draft_vocab_size``, see :data:`DRAFT_VOCAB_CUT`; the argmax index is the token id), a
one-hot draft distribution (see
:mod:`hybridserve.spec.acceptance` for why the output law is still exactly the target's).
They never change what is emitted, only how many tokens a step can keep: a stale or
missing entry in the layer's KV lowers acceptance and nothing else, which is why a step
that does not draft (a large batch) may skip the layer entirely.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.native_decode import NATIVE_STEP

# The reduced draft vocabulary: drafts come from the LM head's first rows only, the
# token ids below ``draft_vocab_size``. BPE tokenizers number their tokens in merge
# order, so the lowest ids are (roughly) the most frequent ones: on the default model's
# tokenizer the first 1024 of 8192 ids cover 99.1% of its greedy outputs on the
# spec_decode prompts, the first 2048 99.9%. A draft can only be a token of that set, so
# the cut changes which drafts are proposed (acceptance), never the output: acceptance
# compares against the target's full distribution. At a large vocabulary the LM head is
# most of a draft pass (248K x 1024 at the 0.8B shape); benches/spec_commit.py times
# the pass with and without the cut. At a small model it is too: at the default model
# (8192 ids, hidden 192) three draft passes' LM heads were ~15% of a k=3 step's CPU
# time, and its first 1024 ids left the mean accepted length within 1% of the full
# vocabulary's on eight prompts (benches/RESULTS.md, issue 34's batch-1 section).
DRAFT_VOCAB_CUT = 32768
# The default keeps the first 1/DRAFT_VOCAB_SHARE of the ids, at least DRAFT_VOCAB_MIN
# (a small vocabulary stays whole) and at most DRAFT_VOCAB_CUT.
DRAFT_VOCAB_SHARE = 8
DRAFT_VOCAB_MIN = 1024


def default_draft_vocab_size(vocab_size: int) -> int:
    """The draft vocabulary when none is configured: the first eighth of the ids
    (:data:`DRAFT_VOCAB_SHARE`), at least :data:`DRAFT_VOCAB_MIN` ids (the whole of a
    smaller vocabulary), at most :data:`DRAFT_VOCAB_CUT`."""
    return min(vocab_size, DRAFT_VOCAB_CUT, max(DRAFT_VOCAB_MIN, vocab_size // DRAFT_VOCAB_SHARE))


class MTPProposer:
    def __init__(self, model: Any, cache: Any, block_table_buf: torch.Tensor, block_size: int,
                 draft_vocab_size: int | None = None) -> None:
        """``draft_vocab_size``: drafts are token ids below it (None: the default for the
        model's vocabulary, :func:`default_draft_vocab_size`; at least the vocabulary:
        all of it)."""
        self.model = model
        self.cache = cache
        self.block_table_buf = block_table_buf
        self.block_size = block_size
        self.device = block_table_buf.device
        # A tensor-parallel rank's model has its share of the vocabulary in its config
        # (the loader records the whole).
        tp_vocab = getattr(model, "tp_vocab_size", None)
        v = tp_vocab or model.config.vocab_size
        n = default_draft_vocab_size(v) if draft_vocab_size is None else min(int(draft_vocab_size), v)
        if n < 1:
            raise ValueError(f"draft_vocab_size must be at least 1, got {draft_vocab_size}")
        # (None: the full LM head.) Under tensor parallelism the head is split over the
        # vocabulary: the draft vocabulary is the first ``cut`` columns of the gathered
        # logits (the same drafts; only the saving is lost).
        self.draft_vocab = None if n == v or tp_vocab else n
        self.cut = n if tp_vocab and n < v else None
        # Tensor parallelism (set by the runner): each pass's draft ids are the driver's
        # argmax (only it has the gathered logits), broadcast to the workers, whose
        # next chained pass feeds them too.
        self.group: Any = None
        self._lasts: dict[int, np.ndarray] = {}

    def _ids(self, logits: torch.Tensor, n: int) -> np.ndarray:
        """The draft ids (the argmax over the draft vocabulary) of one pass's ``n`` rows,
        on every rank."""
        group = self.group
        if group is None or group.is_driver:
            lg = logits if self.cut is None else logits[:, : self.cut]
            ids = lg.argmax(dim=-1).cpu().numpy().astype(np.int64)
            if group is None:
                return ids
        else:
            ids = None
        from hybridserve.parallel.plan_message import share_ids

        return share_ids(group, ids, n)

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch, hidden: torch.Tensor, *, query_start_loc: np.ndarray,
                num_computed: np.ndarray, committed: np.ndarray, next_tokens: np.ndarray,
                table_rows: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
        """Drafts per batch entry (``[]`` where ``num_drafts[b] == 0``).

        Per entry ``b`` of the step just run: ``committed[b]`` rows (from its first) are now
        in the cache, ``next_tokens[b]`` is the token after them (-1: none, the entry is
        left out), ``num_computed[b]`` tokens were in the cache before the step,
        ``table_rows[b]`` its block-table row. ``batch``/``hidden`` are the step's
        ForwardBatch and the trunk's post-norm hidden states ``[T, H]``."""
        B = len(committed)
        if B == 1 and self.device.type == "cpu" and hidden.device.type == "cpu":
            # One sequence (batch 1): its rows are a slice of the step's, no gathers.
            drafts = self._propose_one(batch, hidden, int(query_start_loc[0]), int(committed[0]),
                                       int(next_tokens[0]), int(table_rows[0]), int(num_drafts[0]))
            if drafts is not None:
                return drafts
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        take = (np.asarray(committed) > 0) & (np.asarray(next_tokens) >= 0)
        ents = np.nonzero(take)[0]
        if not len(ents):
            return [[] for _ in range(B)]
        n = np.asarray(committed, dtype=np.int64)[ents]
        starts = qsl[:-1][ents]
        # Row r of the drafter's batch reads trunk row src[r]; its token is the trunk
        # input of the next row, or next_tokens at an entry's last committed row.
        src = np.concatenate([np.arange(s, s + c, dtype=np.int64) for s, c in zip(starts, n)])
        m_qsl = np.zeros(len(ents) + 1, dtype=np.int64)
        np.cumsum(n, out=m_qsl[1:])
        last = m_qsl[1:] - 1
        drafting = np.asarray(num_drafts, dtype=np.int64)[ents]
        want = np.nonzero(drafting > 0)[0]
        if len(want) and self.device.type == "cpu" and hidden.device.type == "cpu":
            drafts = self._propose_native(batch, hidden, src, last, n, ents, want, drafting, next_tokens,
                                          table_rows, B)
            if drafts is not None:
                return drafts
        ids_host = batch.input_ids.index_select(0, torch.from_numpy(src + 1).clamp_(max=batch.num_tokens - 1)
                                                .to(self.device)).cpu().numpy().copy()
        ids_host[last] = np.asarray(next_tokens, dtype=np.int64)[ents]
        src_t = torch.from_numpy(src).to(self.device)
        seq_lens = np.asarray(num_computed, dtype=np.int64)[ents] + n
        rows_t = torch.from_numpy(np.asarray(table_rows, dtype=np.int64)[ents]).to(self.device)
        tables = self.block_table_buf.index_select(0, rows_t)
        mb = ForwardBatch(
            input_ids=torch.from_numpy(ids_host).to(self.device),
            positions=batch.positions.index_select(0, src_t),
            slot_mapping=batch.slot_mapping.index_select(0, src_t),
            query_start_loc=torch.from_numpy(m_qsl.astype(np.int32)).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            block_tables=tables,
            state_pages=batch.state_pages.index_select(0, torch.from_numpy(ents).to(self.device)),
            has_initial_state=torch.ones(len(ents), dtype=torch.bool, device=self.device),
            logits_indices=torch.from_numpy(last[want]).to(self.device),
        )
        logits, mtp_hidden = self.model.mtp_forward(hidden.index_select(0, src_t), mb.input_ids, mb, self.cache,
                                                    self.draft_vocab)
        drafts: list[list[int]] = [[] for _ in range(B)]
        if not len(want):
            return drafts
        tok = self._ids(logits, len(want))
        h = mtp_hidden.index_select(0, torch.from_numpy(last[want]).to(self.device))
        ents_w = ents[want]
        need = drafting[want]
        pos = seq_lens[want] - 1  # the last committed row's position
        tables_w = tables.index_select(0, torch.from_numpy(want).to(self.device))
        toks = [tok]
        alive = np.arange(len(want))
        bs = self.block_size
        for j in range(1, int(need.max())):
            alive = alive[need[alive] > j]
            if not len(alive):
                break
            a_t = torch.from_numpy(alive).to(self.device)
            p = pos[alive] + j
            cols = torch.from_numpy(p // bs).to(self.device)
            blocks = tables_w.index_select(0, a_t).gather(1, cols[:, None])[:, 0].to(torch.int64)
            slots = blocks * bs + torch.from_numpy(p % bs).to(self.device)
            ids = torch.from_numpy(toks[-1][alive] if j == 1 else prev[alive]).to(self.device)
            cb = ForwardBatch(
                input_ids=ids.to(torch.int64),
                positions=torch.from_numpy(p).to(self.device),
                slot_mapping=slots,
                query_start_loc=torch.arange(len(alive) + 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.from_numpy((p + 1).astype(np.int32)).to(self.device),
                block_tables=tables_w.index_select(0, a_t),
                state_pages=mb.state_pages.index_select(0, torch.from_numpy(want[alive]).to(self.device)),
                has_initial_state=torch.ones(len(alive), dtype=torch.bool, device=self.device),
                logits_indices=torch.arange(len(alive), dtype=torch.int64, device=self.device),
            )
            every = len(alive) == len(want)  # (every drafting entry still drafts: the usual case)
            lg, h_new = self.model.mtp_forward(h if every else h.index_select(0, a_t), cb.input_ids, cb,
                                               self.cache, self.draft_vocab)
            full = np.full(len(want), -1, dtype=np.int64)
            full[alive] = self._ids(lg, len(alive))
            toks.append(full)
            prev = full
            if every:
                h = h_new
            else:
                h_full = h.clone()
                h_full.index_copy_(0, a_t, h_new)
                h = h_full
        for i, e in enumerate(ents_w.tolist()):
            drafts[e] = [int(t[i]) for t in toks[: need[i]]]
        return drafts

    def _propose_one(self, batch: ForwardBatch, hidden: torch.Tensor, start: int, committed: int,
                     next_token: int, table_row: int, num_drafts: int) -> list[list[int]] | None:
        """:meth:`_propose_native` for a batch of one sequence whose ``committed`` rows
        start at row ``start``: the same inputs to ``mtp_draft``, sliced instead of
        gathered. None where the general path must run."""
        if committed <= 0 or next_token < 0:
            return [[]]
        if num_drafts <= 0:
            return None  # (the MTP prefill alone: the general path)
        fast = batch.op_plans.get(NATIVE_STEP) or self.model._usable_native_step()
        if fast is None:
            return None
        end = start + committed
        ids_host = np.empty(committed, dtype=np.int64)
        ids_host[:-1] = batch.input_ids.numpy()[start + 1:end]
        ids_host[-1] = next_token
        positions = batch.positions.numpy()[start:end]
        # The sequence's block-table row once per row, only the columns the passes reach
        # (the last chained pass writes num_drafts - 1 positions past the last row): one
        # numpy call, no broadcast view for mtp_draft to copy.
        width = min(self.block_table_buf.shape[1], (int(positions[-1]) + num_drafts - 1) // self.block_size + 1)
        tables = np.repeat(self.block_table_buf.numpy()[table_row:table_row + 1, :width], committed, axis=0)
        h = hidden if start == 0 and end == hidden.shape[0] else hidden[start:end]
        out = fast.mtp_draft(h, ids_host, positions, batch.slot_mapping.numpy()[start:end],
                             tables, self._last(committed), num_drafts, self.cache, self.draft_vocab)
        if out is None:
            return None
        return [out[:, 0].tolist()]

    def _last(self, n: int) -> np.ndarray:
        """``[n - 1]``: the row of the last committed token (kept per n)."""
        got = self._lasts.get(n)
        if got is None:
            got = self._lasts[n] = np.array([n - 1], dtype=np.int64)
        return got

    def _propose_native(self, batch: ForwardBatch, hidden: torch.Tensor, src: np.ndarray, last: np.ndarray,
                        n: np.ndarray, ents: np.ndarray, want: np.ndarray, drafting: np.ndarray,
                        next_tokens: np.ndarray, table_rows: np.ndarray, B: int) -> list[list[int]] | None:
        """:meth:`propose` on the model's native step in one call (``mtp_draft``: the same
        kernels on the same inputs as the passes below, so the same drafts and MTP KV),
        with host arrays instead of a ForwardBatch per pass. None (nothing run) when the
        drafting entries want different numbers of drafts or the native step cannot
        take the passes; the caller then runs them pass by pass."""
        need = drafting[want]
        if not bool((need == need[0]).all()):
            return None
        # (The native step that ran the step's forward: its weights' views were checked then.)
        fast = batch.op_plans.get(NATIVE_STEP) or self.model._usable_native_step()
        if fast is None:
            return None
        ids = batch.input_ids.numpy()
        rows = np.minimum(src + 1, len(ids) - 1)
        ids_host = ids[rows].astype(np.int64)
        ids_host[last] = np.asarray(next_tokens, dtype=np.int64)[ents]
        positions = batch.positions.numpy()[src]
        slots = batch.slot_mapping.numpy()[src]
        tables = self.block_table_buf.numpy()[np.repeat(np.asarray(table_rows, dtype=np.int64)[ents], n)]
        h = hidden if len(src) == hidden.shape[0] and src[0] == 0 and src[-1] == len(src) - 1 \
            else hidden.index_select(0, torch.from_numpy(src))
        out = fast.mtp_draft(h, ids_host, positions, slots, tables, last[want], int(need[0]), self.cache,
                             self.draft_vocab)
        if out is None:
            return None
        drafts: list[list[int]] = [[] for _ in range(B)]
        cols = out.T.tolist()
        for i, e in enumerate(ents[want].tolist()):
            drafts[e] = cols[i]
        return drafts
