"""Shared fixtures of the model tests: tiny checkpoints, the HF oracle, paged bookkeeping.

The bookkeeping here is a deliberately naive pure-Python stand-in for the Rust
scheduler over one arena: a shuffled free list of pages (so block tables and state page
tables are non-contiguous and interleaved), KV blocks allocated on demand, a sequence's
DeltaNet state in ``state_pages`` pages of the same list, a fork that shares full
blocks and copies the partly-filled tail block (copy-on-write) and the state pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from hybridserve.memory.layout import arena_layout
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
    state: list[int]  # the state page table row
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V and state are already in the cache
    checkpoint: tuple[int, list[int]] | None = None  # (position, pages) asked for next step


class PagedBook:
    def __init__(self, cache: HybridCache, seed: int = 0):
        rng = random.Random(seed)
        self.block_size = cache.block_size
        self.state_pages = cache.state_pages
        self.free_pages = list(range(cache.num_pages))
        rng.shuffle(self.free_pages)
        self.refs: dict[int, int] = {}

    def _alloc_block(self) -> int:
        b = self.free_pages.pop()
        self.refs[b] = 1
        return b

    def alloc_state(self) -> list[int]:
        return [self.free_pages.pop() for _ in range(self.state_pages)]

    def new_seq(self, tokens) -> Seq:
        return Seq(list(tokens), self.alloc_state())

    def free(self, seq: Seq) -> None:
        for b in seq.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_pages.insert(0, b)  # reused last-in-first-out would be too easy
        seq.blocks = []
        for p in seq.state:
            self.free_pages.insert(0, p)
        seq.state = []
        seq.computed = 0

    def recompute(self, seq: Seq) -> None:
        """Re-admit a preempted sequence: new state pages, nothing computed."""
        seq.state = self.alloc_state()

    def fork(self, parent: Seq):
        """Child sharing the parent's full blocks; returns (child, page_pairs): the
        tail block's copy-on-write and the state pages' copies, for ``copy_pages``."""
        child = Seq(list(parent.tokens), self.alloc_state(), computed=parent.computed)
        pairs = []
        for i, b in enumerate(parent.blocks):
            tail_partial = i == len(parent.blocks) - 1 and parent.computed % self.block_size
            if tail_partial:
                nb = self._alloc_block()
                pairs.append((b, nb))
                child.blocks.append(nb)
            else:
                self.refs[b] += 1
                child.blocks.append(b)
        return child, pairs + list(zip(parent.state, child.state))

    def step(self, sched, extra_logit_rows=(), device="cpu"):
        """Build the ForwardBatch of ``sched`` = [(seq, n_tokens)], then mark them computed.

        Logit rows: the last scheduled row of every sequence that reaches the end of its
        tokens (it samples), plus ``(seq)`` entries of ``extra_logit_rows`` (their last
        row even mid-prompt). A sequence's ``checkpoint`` request goes into the batch and
        is cleared. Returns (batch, [(seq, position)] per logit row).
        """
        ids, pos, slots, qsl, lens, tables, stables, init, rows, wanted = [], [], [], [0], [], [], [], [], [], []
        ck_pos, ck_pages = [], []
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
            stables.append(list(seq.state))
            init.append(start > 0)
            k, pages = seq.checkpoint or (-1, [-1] * self.state_pages)
            ck_pos.append(k)
            ck_pages.append(list(pages))
            seq.checkpoint = None
            if end == len(seq.tokens) or seq in extra_logit_rows:
                rows.append(qsl[-1] - 1)
                wanted.append((seq, end - 1))
            seq.computed = end
        any_ck = any(k >= 0 for k in ck_pos)
        batch = ForwardBatch.from_lists(
            input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
            block_tables=tables, state_pages=stables, has_initial_state=init, logits_indices=rows,
            checkpoint_positions=ck_pos if any_ck else None, checkpoint_pages=ck_pages if any_ck else None,
            device=device)
        batch.validate()
        return batch, wanted


@pytest.fixture
def make_book():
    return PagedBook


def make_cache(config, block_size, num_pages=96):
    layout = arena_layout(config, block_size, "float32")
    return HybridCache(config, layout, num_pages, dtype=torch.float32, device="cpu")


@pytest.fixture
def new_cache():
    return make_cache


def whole_prompt_logits(model, config, prompt, block_size=16):
    """Our logits ``[n, vocab]`` for one whole prompt in one forward (blocks and state
    pages numbered in order in a cache of the model's own dtype)."""
    from hybridserve.model.cache import dtype_name

    n = len(prompt)
    nb = -(-n // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


@pytest.fixture
def prompt_logits():
    return whole_prompt_logits



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
