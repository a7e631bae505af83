"""Transactional admission through hybridserve._core.Scheduler (issue 30).

A waiting head that cannot fit even with every checkpoint and parked block
evicted is refused before anything is evicted, every step it waits. The page
counts are worked out by hand in the comments (28-page arena, 4-token blocks,
4 pages per DeltaNet state), not read from the scheduler.
"""

from hybridserve._core import Scheduler


def _step(s):
    out = s.schedule()
    s.update([9] * int(sum(out.num_samples)))


def test_refused_head_evicts_nothing():
    s = Scheduler(28, 4, 4, 4, 64, 64, enable_prefix_caching=True)
    # Two 13-token prompts: each leaves a 12-token checkpoint (4 pages) and
    # parked blocks behind.
    for i, base in enumerate((100, 200)):
        s.add_request(f"a{i}", list(range(base, base + 13)), max_tokens=1, ignore_eos=True)
        while s.has_unfinished():
            _step(s)
    assert len(s.checkpoints()) == 2
    # 36 tokens: 9 blocks + 4 state pages = 13 of the 28 pages, still growing.
    s.add_request("big", list(range(300, 336)), max_tokens=20, ignore_eos=True)
    _step(s)
    ck_before = s.checkpoints()
    before = s.stats()
    assert len(ck_before) == 2
    # 48 tokens: 12 blocks + 4 state pages = 16 > the 14 obtainable at most.
    s.add_request("head", list(range(400, 448)), max_tokens=1, ignore_eos=True)
    for _ in range(3):
        _step(s)
        st = s.stats()
        assert s.num_waiting() == 1
        assert st["last_admission_limit"] == "pages"
        assert s.checkpoints() == ck_before, "a refused admission evicted checkpoints"
        assert st["checkpoint_evictions"] == before["checkpoint_evictions"]
        assert st["checkpoint_drops"] == before["checkpoint_drops"]
    # Only the running request's growth (a block per 4 tokens) takes parked blocks.
    assert s.stats()["cached_pages"] + 1 >= before["cached_pages"]
    while s.has_unfinished():
        _step(s)
    assert not s.has_unfinished()


def test_request_classes_capped_in_the_core():
    """Client-chosen request_class values: the first max_request_classes
    distinct ones ("default" not counted) keep their name, every later one is
    "other", so the core keeps a bounded set however many values arrive."""
    s = Scheduler(4096, 4, 1, 8, 64, 64, max_request_classes=3)
    names = ["default"] + [f"c{i}" for i in range(500)] + ["c1", "default"]
    for i, c in enumerate(names):
        s.add_request(f"r{i}", [1, 2, 3], max_tokens=1, request_class=c)
    seen = {}
    while s.has_unfinished():
        _step(s)
        for rid, klass, _t, _d in s.take_events():
            seen[rid] = klass
    want = {f"r{i}": (c if c in ("default", "c0", "c1", "c2") else "other") for i, c in enumerate(names)}
    assert seen == want
