"""StatePool bindings against a brute-force model: a LIFO list of free slots
(initially 0, 1, 2, ... from the top) and a use per slot."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridserve import errors
from hybridserve._core import StatePool

N = 5
slots = st.integers(min_value=-1, max_value=N + 1)


class StatePoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.p = StatePool(N)
        self.free = list(range(N - 1, -1, -1))
        self.use = ["free"] * N

    def _take(self, use):
        s = self.free.pop()
        self.use[s] = use
        return s

    @rule(checkpoint=st.booleans())
    def allocate(self, checkpoint):
        if self.free:
            got = self.p.allocate_checkpoint(123) if checkpoint else self.p.allocate()
            assert got == self._take("checkpoint" if checkpoint else "sequence")
        else:
            with pytest.raises(errors.OutOfSlots, match="raise num_state_slots"):
                self.p.allocate()

    @rule(n=st.integers(min_value=0, max_value=N + 1))
    def allocate_n(self, n):
        if n <= len(self.free):
            got = self.p.allocate_n(n)
            assert got.dtype == np.int32
            assert got.tolist() == [self._take("sequence") for _ in range(n)]
        else:
            with pytest.raises(errors.OutOfSlots):
                self.p.allocate_n(n)

    @rule(s=slots)
    def free_slot(self, s):
        if 0 <= s < N and self.use[s] != "free":
            self.p.free(s)
            self.use[s] = "free"
            self.free.append(s)
        else:
            with pytest.raises(errors.InvalidSlot):
                self.p.free(s)

    @rule(s=slots)
    def fork(self, s):
        if not (0 <= s < N and self.use[s] != "free"):
            with pytest.raises(errors.InvalidSlot):
                self.p.fork(s)
        elif not self.free:
            with pytest.raises(errors.OutOfSlots):
                self.p.fork(s)
        else:
            assert self.p.fork(s) == (s, self._take("sequence"))

    @invariant()
    def agrees(self):
        assert self.p.num_free == len(self.free)
        assert self.p.num_used == N - len(self.free)
        assert [self.p.slot_use(s) for s in range(N)] == self.use
        assert self.p.slot_use(N) is None


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_exhaustion_is_an_exception_and_loses_nothing():
    p = StatePool(2)
    p.allocate_n(2)
    with pytest.raises(errors.OutOfSlots) as ei:
        p.allocate_n(1)
    assert isinstance(ei.value, errors.HybridServeError)
    assert p.num_free == 0 and p.num_used == 2
    p.free(1)
    assert p.allocate() == 1
