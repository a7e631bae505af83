"""BlockAllocator bindings against a brute-force Python model.

The model is a plain list used as a stack of free ids (a fresh pool hands out
0, 1, 2, ...; then the most recently freed first) and a state per block:
"free", "parked" or a refcount. Every call must agree with it exactly,
including which exception class a misuse raises.
"""

import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridserve import errors
from hybridserve._core import BlockAllocator

N = 6
ids = st.integers(min_value=-2, max_value=N + 1)  # includes out-of-range ids


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(N)
        self.stack = list(range(N - 1, -1, -1))  # top = last
        self.state = {b: "free" for b in range(N)}

    @rule()
    def allocate(self):
        if self.stack:
            b = self.stack.pop()
            assert self.a.allocate() == b
            self.state[b] = 1
        else:
            with pytest.raises(errors.OutOfBlocks, match="raise num_pages"):
                self.a.allocate()

    @rule(n=st.integers(min_value=0, max_value=N + 1))
    def allocate_n(self, n):
        if n <= len(self.stack):
            got = self.a.allocate_n(n)
            assert got.dtype == np.int32
            expect = [self.stack.pop() for _ in range(n)]
            assert got.tolist() == expect
            for b in expect:
                self.state[b] = 1
        else:
            with pytest.raises(errors.OutOfBlocks):
                self.a.allocate_n(n)

    @rule(b=ids)
    def incref(self, b):
        if isinstance(self.state.get(b), int):
            self.state[b] += 1
            assert self.a.incref(b) == self.state[b]
        else:
            with pytest.raises(errors.InvalidBlock):
                self.a.incref(b)

    @rule(b=ids, retain=st.booleans())
    def decref(self, b, retain):
        c = self.state.get(b)
        if isinstance(c, int):
            got = self.a.decref_retain(b) if retain else self.a.decref(b)
            assert got == c - 1
            if c > 1:
                self.state[b] = c - 1
            elif retain:
                self.state[b] = "parked"
            else:
                self.state[b] = "free"
                self.stack.append(b)
        else:
            with pytest.raises(errors.InvalidBlock):
                self.a.decref_retain(b) if retain else self.a.decref(b)

    @rule(b=ids, revive=st.booleans())
    def release_or_revive(self, b, revive):
        if self.state.get(b) == "parked":
            if revive:
                self.a.revive(b)
                self.state[b] = 1
            else:
                self.a.release(b)
                self.state[b] = "free"
                self.stack.append(b)
        else:
            with pytest.raises(errors.InvalidBlock):
                self.a.revive(b) if revive else self.a.release(b)

    @invariant()
    def agrees_with_model(self):
        assert self.a.num_free == len(self.stack)
        assert self.a.free_list().tolist() == self.stack[::-1]
        for b, s in self.state.items():
            assert self.a.refcount(b) == (s if isinstance(s, int) else 0)
            assert self.a.is_free(b) == (s == "free")


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_threads_share_one_pool_without_losing_blocks():
    """Python threads racing on one pool (allocate_n releases the GIL): no block
    is ever held twice, and all come back."""
    a = BlockAllocator(32)
    held = np.zeros(32, dtype=np.int64)
    lock = threading.Lock()  # guards only the test's own bookkeeping
    failures = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        for _ in range(2000):
            if mine and rng.random() < 0.5:
                b = mine.pop(int(rng.integers(len(mine))))
                with lock:
                    held[b] -= 1
                a.decref(b)
            else:
                try:
                    got = a.allocate_n(int(rng.integers(1, 4)))
                except errors.OutOfBlocks:
                    continue
                with lock:
                    for b in got.tolist():
                        if held[b] != 0:
                            failures.append(b)
                        held[b] += 1
                mine.extend(got.tolist())
        for b in mine:
            with lock:
                held[b] -= 1
            a.decref(b)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert failures == []
    assert a.num_free == 32
    assert sorted(a.free_list().tolist()) == list(range(32))


def test_bad_sizes_and_counts_raise_value_errors():
    with pytest.raises(errors.ConfigError, match="num_blocks"):
        BlockAllocator(1 << 31)
    a = BlockAllocator(2)
    with pytest.raises(ValueError, match="n must be >= 0"):
        a.allocate_n(-1)
    with pytest.raises(errors.InvalidBlock, match="-5"):
        a.decref(-5)
    assert a.num_free == 2  # nothing lost by the refused calls
