"""Shared fixtures of the model tests: tiny checkpoints, the HF oracle, paged bookkeeping.

The bookkeeping here is a deliberately naive pure-Python stand-in for the Rust
scheduler: shuffled free lists (so block tables are non-contiguous and slots are
scattered), blocks allocated on demand, a fork that shares full blocks and copies the
partly-filled tail block (copy-on-write) and the DeltaNet slot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from hybridserve.model import ForwardBatch, HybridCache, load_model
from hybridserve.model.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {p: write_tiny_checkpoint(root / p, preset=p, seed=7) for p in ("test-a", "test-b")}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs):
    import transformers

    return {p: transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for p, d in tiny_dirs.items()}


@pytest.fixture(scope="session")
def our_models(tiny_dirs):
    return {p: load_model(d, dtype="float32", progress=False) for p, d in tiny_dirs.items()}


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    slot: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V and state are already in the cache


class PagedBook:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, seed: int = 0):
        rng = random.Random(seed)
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        rng.shuffle(self.free_blocks)
        self.free_slots = list(range(num_slots))
        rng.shuffle(self.free_slots)
        self.refs: dict[int, int] = {}

    def _alloc_block(self) -> int:
        b = self.free_blocks.pop()
        self.refs[b] = 1
        return b

    def new_seq(self, tokens) -> Seq:
        return Seq(list(tokens), self.free_slots.pop())

    def free(self, seq: Seq) -> None:
        for b in seq.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.insert(0, b)  # reused last-in-first-out would be too easy
        seq.blocks = []
        self.free_slots.insert(0, seq.slot)
        seq.slot = -1
        seq.computed = 0

    def recompute(self, seq: Seq) -> None:
        """Re-admit a preempted sequence: new slot, nothing computed."""
        seq.slot = self.free_slots.pop()

    def fork(self, parent: Seq):
        """Child sharing the parent's full blocks; returns (child, block_pairs, slot_pairs)."""
        child = Seq(list(parent.tokens), self.free_slots.pop(), computed=parent.computed)
        block_pairs = []
        for i, b in enumerate(parent.blocks):
            tail_partial = i == len(parent.blocks) - 1 and parent.computed % self.block_size
            if tail_partial:
                nb = self._alloc_block()
                block_pairs.append((b, nb))
                child.blocks.append(nb)
            else:
                self.refs[b] += 1
                child.blocks.append(b)
        return child, block_pairs, [(parent.slot, child.slot)]

    def step(self, sched, extra_logit_rows=(), device="cpu"):
        """Build the ForwardBatch of ``sched`` = [(seq, n_tokens)], then mark them computed.

        Logit rows: the last scheduled row of every sequence that reaches the end of its
        tokens (it samples), plus ``(seq)`` entries of ``extra_logit_rows`` (their last
        row even mid-prompt). Returns (batch, [(seq, position)] per logit row).
        """
        ids, pos, slots, qsl, lens, tables, sslots, init, rows, wanted = [], [], [], [0], [], [], [], [], [], []
        for seq, n in sched:
            start = seq.computed
            end = start + n
            assert end <= len(seq.tokens)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self._alloc_block())
            for p in range(start, end):
                blk = seq.blocks[p // self.block_size]
                assert self.refs[blk] == 1 or p < start, "writing into a shared block"
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(blk * self.block_size + p % self.block_size)
            qsl.append(qsl[-1] + n)
            lens.append(end)
            tables.append(list(seq.blocks))
            sslots.append(seq.slot)
            init.append(start > 0)
            if end == len(seq.tokens) or seq in extra_logit_rows:
                rows.append(qsl[-1] - 1)
                wanted.append((seq, end - 1))
            seq.computed = end
        batch = ForwardBatch.from_lists(
            input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
            block_tables=tables, state_slots=sslots, has_initial_state=init, logits_indices=rows,
            device=device)
        batch.validate()
        return batch, wanted


@pytest.fixture
def make_book():
    return PagedBook


def make_cache(config, block_size, num_blocks=64, num_slots=8):
    return HybridCache(config, num_blocks=num_blocks, block_size=block_size,
                       num_state_slots=num_slots, dtype=torch.float32, device="cpu")


@pytest.fixture
def new_cache():
    return make_cache


class Recorder:
    """Collects (sequence, position, our logits row) and checks them against HF at the end."""

    def __init__(self, hf):
        self.hf = hf
        self.rows = []

    def add(self, wanted, logits):
        assert logits.shape[0] == len(wanted) and logits.dtype == torch.float32
        for (seq, p), row in zip(wanted, logits):
            self.rows.append((seq, p, row.clone()))

    def check(self, min_rows=1):
        assert len(self.rows) >= min_rows
        cache: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for seq, p, row in self.rows:
                if id(seq) not in cache:
                    cache[id(seq)] = self.hf(torch.tensor([seq.tokens])).logits[0].float()
                ref = cache[id(seq)][p]
                torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
                assert int(row.argmax()) == int(ref.argmax()), f"greedy token differs at position {p}"


@pytest.fixture
def recorder():
    return Recorder
