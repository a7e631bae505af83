"""PromptLogprobList: compact prompt-logprob rows read as vLLM's list of {token: Logprob}."""

import gc

from hybridserve.outputs import Logprob, PromptLogprobList


def _rows():
    # position 0 has no logprob; position 2's chosen token is also its top-1 candidate.
    return [None, (5, -1.5, 3, (9, 7), (-0.2, -0.9)), (9, -0.2, 1, (9, 4), (-0.2, -2.5))]


def test_reads_as_vllm_entries():
    v = PromptLogprobList(_rows())
    want = [None,
            {5: Logprob(-1.5, rank=3), 9: Logprob(-0.2, rank=1), 7: Logprob(-0.9, rank=2)},
            {9: Logprob(-0.2, rank=1), 4: Logprob(-2.5, rank=2)}]
    assert len(v) == 3
    assert list(v) == want
    assert v == want and v[1] == want[1] and v[-1] == want[2] and v[1:] == want[1:]
    assert v != want[:2]


def test_rows_are_not_tracked_by_the_collector():
    # The point of the compact form: a long prompt's rows cost a full collection nothing.
    rows = [None] + [(i, -1.0, 2, tuple(range(20)), tuple(-float(r) for r in range(20))) for i in range(1000)]
    PromptLogprobList(rows)
    # A row is untracked once the collector has seen its inner tuples untracked first,
    # which the order of its lists can leave to a second look.
    gc.collect()
    gc.collect()
    assert sum(gc.is_tracked(r) for r in rows[1:]) == 0
