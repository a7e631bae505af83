"""KvCacheManager bindings against a brute-force model that simulates KV content.

The model plays the model runner: it writes each token id into the slot
``append_slots`` returned and performs the returned ``(src, dst)`` block copies.
After every step (hypothesis ``RuleBasedStateMachine``):

* every live sequence reads back its own tokens through its block table
  (sharing, copy-on-write, eviction and reuse never corrupt anybody);
* a prefix hit returns blocks that already hold the prompt's tokens, is
  block-aligned and leaves at least one token to compute;
* refcounts equal a brute-force count of (table, position) references, and
  ``num_free_blocks == num_blocks - distinct referenced blocks``;
* ``blocks_needed`` equals the model's new blocks + copy of a shared
  partly-filled tail, ``append_slots`` fails (OutOfBlocks) exactly when that
  exceeds the free count, and then changes nothing;
* the stats counters equal the model's tallies.
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridserve import errors
from hybridserve._core import BlockTable, KvCacheManager

BS = 4
NUM_BLOCKS = 8
BASE = [(i * 7 + 3) % 11 for i in range(40)]
PROMPTS = [BASE, BASE[:30], BASE + [5, 6, 7], BASE[:5] + [99] + BASE[6:]]


class KvMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KvCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.seqs = []  # [table, tokens (list), extra_key]
        self.content = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.tally = dict(prefix_queries=0, prefix_query_tokens=0, prefix_hit_tokens=0, prefix_hits=0,
                          alloc_failures=0, cow_copies=0)

    def refcounts(self):
        rc = [0] * NUM_BLOCKS
        for t, _, _ in self.seqs:
            for b in t.blocks.tolist():
                rc[b] += 1
        return rc

    @rule(p=st.integers(0, len(PROMPTS) - 1), length=st.integers(0, 24), extra=st.integers(0, 1),
          as_numpy=st.booleans())
    def new_sequence(self, p, length, extra, as_numpy):
        tokens = PROMPTS[p][:length]
        table = self.m.new_table()
        rc_before = self.refcounts()
        free_before = self.m.num_free_blocks
        arg = np.asarray(tokens, dtype=np.int64) if as_numpy else tokens
        hit = self.m.match_prefix(table, arg, extra)
        self.tally["prefix_queries"] += 1
        self.tally["prefix_query_tokens"] += length
        self.tally["prefix_hit_tokens"] += hit
        self.tally["prefix_hits"] += hit > 0
        assert hit % BS == 0 and hit <= max(length - 1, 0) // BS * BS
        assert table.num_tokens == hit and table.num_blocks == hit // BS
        blocks = table.blocks.tolist()
        for i in range(hit):
            assert self.content[blocks[i // BS]][i % BS] == tokens[i], "unsound prefix hit"
        revived = sum(1 for b in blocks if rc_before[b] == 0)
        assert self.m.num_free_blocks == free_before - revived
        self.seqs.append([table, list(tokens), extra])

    @rule(i=st.integers(0, 7), n=st.integers(1, 9), seed=st.integers(0, 12), then_cache=st.booleans())
    def append(self, i, n, seed, then_cache):
        if not self.seqs:
            return
        table, tokens, _ = self.seqs[i % len(self.seqs)]
        rc = self.refcounts()
        nt = table.num_tokens
        while len(tokens) < nt + n:
            tokens.append((seed * 5 + len(tokens)) % 13)
        blocks_before = table.blocks.tolist()
        cow = nt % BS != 0 and rc[blocks_before[-1]] > 1
        predicted = -(-(nt + n) // BS) - len(blocks_before) + cow
        assert self.m.blocks_needed(table, n) == predicted
        free_before = self.m.num_free_blocks
        if predicted > free_before:
            with pytest.raises(errors.OutOfBlocks, match=f"needed {predicted}, {free_before} free"):
                self.m.append_slots(table, n)
            self.tally["alloc_failures"] += 1
            assert table.blocks.tolist() == blocks_before and table.num_tokens == nt
            return
        slots, copies = self.m.append_slots(table, n)
        assert slots.dtype == np.int32 and copies.dtype == np.int32 and copies.shape[1] == 2
        assert self.m.num_free_blocks == free_before - predicted
        blocks = table.blocks.tolist()
        if cow:
            self.tally["cow_copies"] += 1
            assert copies.tolist() == [[blocks_before[-1], blocks[len(blocks_before) - 1]]]
            src, dst = copies[0].tolist()
            self.content[dst] = list(self.content[src])
        else:
            assert copies.shape == (0, 2)
            assert blocks[: len(blocks_before)] == blocks_before
        assert len(slots) == n
        for j, slot in enumerate(slots.tolist()):
            pos = nt + j
            b = blocks[pos // BS]
            assert slot == b * BS + pos % BS
            self.content[b][pos % BS] = tokens[pos]
        if then_cache:  # the usual engine order: compute, then register the full blocks
            self.cache_full(i)

    @precondition(lambda self: self.m.num_cached_blocks > 0)
    @rule(seed=st.integers(0, 12))
    def fill_pool(self, seed):
        """A sequence taking every allocatable block: forces evictions of parked blocks."""
        self.new_sequence(0, 0, 0, False)
        self.append(len(self.seqs) - 1, max(self.m.num_free_blocks, 1) * BS, seed, False)

    @rule(i=st.integers(0, 7))
    def cache_full(self, i):
        if not self.seqs:
            return
        table, tokens, extra = self.seqs[i % len(self.seqs)]
        free_before = self.m.num_free_blocks
        self.m.cache_full_blocks(table, tokens[: table.num_tokens], extra)
        assert self.m.num_free_blocks == free_before

    @rule(i=st.integers(0, 7))
    def fork(self, i):
        if not self.seqs:
            return
        table, tokens, extra = self.seqs[i % len(self.seqs)]
        free_before = self.m.num_free_blocks
        child = self.m.fork(table)
        assert child.blocks.tolist() == table.blocks.tolist()
        assert self.m.num_free_blocks == free_before
        self.seqs.append([child, tokens[: table.num_tokens], extra])

    @rule(i=st.integers(0, 7))
    def free(self, i):
        if not self.seqs:
            return
        table, _, _ = self.seqs.pop(i % len(self.seqs))
        self.m.free(table)
        assert table.num_tokens == 0 and table.num_blocks == 0

    @invariant()
    def agrees_with_model(self):
        rc = self.refcounts()
        for b in range(NUM_BLOCKS):
            assert self.m.refcount(b) == rc[b]
        referenced = sum(1 for c in rc if c)
        assert self.m.num_free_blocks == NUM_BLOCKS - referenced
        assert self.m.num_used_blocks == referenced
        lru = self.m.lru_order().tolist()
        assert self.m.num_cached_blocks == len(lru)
        assert all(rc[b] == 0 and self.m.is_cached(b) for b in lru)
        for table, tokens, _ in self.seqs:
            nt = table.num_tokens
            blocks = table.blocks.tolist()
            assert len(blocks) == -(-nt // BS)
            assert self.m.tail_waste(table) == len(blocks) * BS - nt
            got = [self.content[blocks[i // BS]][i % BS] for i in range(nt)]
            assert got == tokens[:nt], "a sequence reads somebody else's KV"
        stats = self.m.stats()
        for k, v in self.tally.items():
            assert stats[k] == v, k

    def teardown(self):
        for table, _, _ in self.seqs:
            self.m.free(table)
        assert self.m.num_free_blocks == NUM_BLOCKS


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_shared_prompt_hits_then_parks_and_hits_again():
    m = KvCacheManager(16, 4)
    prompt = list(range(100, 114))
    a = m.new_table()
    m.append_slots(a, len(prompt))
    m.cache_full_blocks(a, prompt)
    b = m.new_table()
    assert m.match_prefix(b, prompt) == 12
    assert b.blocks.tolist() == a.blocks.tolist()[:3]
    assert m.match_prefix(m.new_table(), prompt, extra_key=1) == 0  # other salt: no sharing
    m.free(a)
    m.free(b)
    assert m.num_cached_blocks == 3 and m.num_free_blocks == 16
    c = m.new_table()
    assert m.match_prefix(c, np.asarray(prompt, dtype=np.int32)) == 12
    s = m.stats()
    assert (s["prefix_queries"], s["prefix_hits"], s["prefix_hit_tokens"]) == (3, 2, 24)


def test_disabled_prefix_cache_never_hits():
    m = KvCacheManager(8, 4, enable_prefix_caching=False)
    a = m.new_table()
    m.append_slots(a, 9)
    m.cache_full_blocks(a, list(range(9)))
    assert m.match_prefix(m.new_table(), list(range(9))) == 0
    m.free(a)
    assert m.num_cached_blocks == 0 and m.num_free_blocks == 8


def test_misuse_raises_clear_errors_and_changes_nothing():
    with pytest.raises(errors.ConfigError, match="num_blocks"):
        KvCacheManager(0, 16)
    with pytest.raises(errors.ConfigError, match="block_size"):
        KvCacheManager(4, 0)
    with pytest.raises(errors.ConfigError, match="int32"):
        KvCacheManager(1 << 28, 16)
    m, other = KvCacheManager(4, 4), KvCacheManager(4, 4)
    t = m.new_table()
    m.append_slots(t, 5)
    with pytest.raises(ValueError, match="another KvCacheManager"):
        other.append_slots(t, 1)
    with pytest.raises(ValueError, match="empty table"):
        m.match_prefix(t, [1, 2, 3])
    with pytest.raises(ValueError, match="token ids"):
        m.cache_full_blocks(t, [1, -2, 3, 4, 5])
    with pytest.raises(ValueError, match="n must be >= 0"):
        m.append_slots(t, -1)
    with pytest.raises(errors.OutOfBlocks, match="raise num_pages"):
        m.append_slots(t, 100)
    with pytest.raises(errors.InvalidBlock):
        m.refcount(4)
    assert t.num_tokens == 5 and m.num_free_blocks == 2 and m.stats()["alloc_failures"] == 1
    # a fresh BlockTable() binds to the first manager that uses it
    u = BlockTable()
    other.append_slots(u, 1)
    with pytest.raises(ValueError, match="another KvCacheManager"):
        m.free(u)
    other.free(u)
    assert other.num_free_blocks == 4
