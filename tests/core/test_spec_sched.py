"""Speculative decoding in ``hybridserve._core.Scheduler`` (issue 34, scheduler part).

The oracle is kept here: each sequence's committed tokens (prompt + what ``update``
accepted), the drafts this test handed over, a caller-side block-table buffer built
only from the plan's incremental row updates, and a simulated KV memory (slot -> the
token prefix whose KV was written there, from ``slot_mapping`` and the tokens fed).
From those: a drafted plan feeds the last token then the drafts at consecutive
positions; attention over the committed context reads the right KV even after
rejected drafts left stale slots; the block table covers the drafter's lookahead
positions; accepted counts advance ``num_computed_tokens``; a stop token inside the
accepted tokens finishes there; bad calls raise ValueError and change nothing;
preemption and ``abort_step`` drop drafts; every page comes back.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from hybridserve._core import Scheduler
from hybridserve.errors import InvalidRequest

EOS = 7


class Caller:
    """What an engine keeps beside the scheduler: the block-table buffer and a KV model."""

    def __init__(self, s: Scheduler, bs: int) -> None:
        self.s, self.bs = s, bs
        self.rows = np.full((64, s.max_blocks_per_seq), -7, dtype=np.int64)
        self.kv: dict[int, tuple] = {}

    def apply(self, plan) -> None:
        for src, dst in plan.block_copies.tolist():
            for o in range(self.bs):
                v = self.kv.get(src * self.bs + o)
                if v is None:
                    self.kv.pop(dst * self.bs + o, None)
                else:
                    self.kv[dst * self.bs + o] = v
        for r, c, v in zip(plan.block_table_update_rows.tolist(), plan.block_table_update_cols.tolist(),
                           plan.block_table_update_values.tolist()):
            self.rows[r, c] = v

    def slot(self, row: int, pos: int) -> int:
        return int(self.rows[row, pos // self.bs]) * self.bs + pos % self.bs

    def run(self, plan, fed: list[list[int]]) -> None:
        """Writes the KV of every row, then checks every entry reads its whole context."""
        qsl = plan.query_start_loc.tolist()
        for b in range(len(plan)):
            start = int(plan.num_computed_tokens[b])
            for j in range(int(plan.num_scheduled_tokens[b])):
                sl = int(plan.slot_mapping[qsl[b] + j])
                if sl == -1:
                    continue  # a prefix-cache hit: the KV is there (the read below checks it)
                assert sl == self.slot(int(plan.block_table_rows[b]), start + j)
                self.kv[sl] = tuple(fed[b][: start + j + 1])
        for b in range(len(plan)):
            row = int(plan.block_table_rows[b])
            for p in range(int(plan.seq_lens[b])):
                assert self.kv.get(self.slot(row, p)) == tuple(fed[b][: p + 1]), f"wrong KV at position {p}"


def fed_tokens(plan, committed: dict, b: int) -> list[int]:
    """The tokens entry b feeds, checked against the oracle: committed, then drafts."""
    rid, si = plan.request_ids[b], int(plan.sample_indices[b])
    start, k, nd = (int(plan.num_computed_tokens[b]), int(plan.num_scheduled_tokens[b]),
                    int(plan.num_draft_tokens[b]))
    q0 = int(plan.query_start_loc[b])
    ids = plan.input_ids[q0:q0 + k].tolist()
    assert plan.positions[q0:q0 + k].tolist() == list(range(start, start + k)), "positions not contiguous"
    toks = committed[(rid, si)]
    assert ids[: k - nd] == toks[start:start + k - nd], "fed the wrong committed tokens"
    return toks[: start + k - nd] + ids[k - nd:]


def one_request(k=2, max_tokens=12, prompt=(1, 2, 3, 4, 5), bs=4, pages=64, budget=32, **kw):
    s = Scheduler(pages, bs, 1, 4, budget, 64, num_speculative_tokens=k, **kw)
    s.add_request("a", list(prompt), max_tokens=max_tokens, eos_token_ids=[EOS])
    return s


def test_drafts_are_fed_after_the_last_token_and_accepted_counts_commit():
    s = one_request(k=3)
    c = Caller(s, 4)
    committed = {("a", 0): [1, 2, 3, 4, 5]}
    plan = s.schedule()
    assert plan.num_draft_tokens.tolist() == [0] and plan.num_samples.tolist() == [1]
    c.apply(plan)
    c.run(plan, [fed_tokens(plan, committed, 0)])
    s.update([20], drafts=[[21, 22, 23]])
    committed[("a", 0)].append(20)

    plan = s.schedule()
    assert plan.num_draft_tokens.tolist() == [3]
    assert plan.num_samples.tolist() == [1], "a drafted entry samples once (the engine samples its rows)"
    assert plan.num_scheduled_tokens.tolist() == [4]
    assert plan.input_ids.tolist() == [20, 21, 22, 23]
    assert plan.positions.tolist() == [5, 6, 7, 8]
    assert plan.checkpoint_positions.tolist() == [-1]
    c.apply(plan)
    c.run(plan, [fed_tokens(plan, committed, 0)])
    # Two drafts accepted, then the target's token.
    upd = s.update([21, 22, 30], accepted=[3], drafts=[[31, 32]])
    assert upd.token_ids.tolist() == [21, 22, 30]
    committed[("a", 0)] += [21, 22, 30]
    assert s.get_output_tokens("a", 0).tolist() == [20, 21, 22, 30]

    plan = s.schedule()
    # num_computed advanced by accepted (6 + 3 = 9): the rejected position 8 is fed again.
    assert plan.num_computed_tokens.tolist() == [8]
    assert plan.input_ids.tolist() == [30, 31, 32]
    c.apply(plan)
    c.run(plan, [fed_tokens(plan, committed, 0)])  # stale KV of the rejected draft overwritten
    s.update([40], accepted=[1])  # every draft rejected
    committed[("a", 0)].append(40)
    plan = s.schedule()
    assert plan.num_computed_tokens.tolist() == [9] and plan.num_draft_tokens.tolist() == [0]
    c.apply(plan)
    c.run(plan, [fed_tokens(plan, committed, 0)])
    st = s.stats()
    assert st["spec_draft_tokens"] == 3 + 2
    assert st["spec_accepted_tokens"] == 2 + 0
    assert st["spec_accepted_by_position"] == [1, 1, 0]


def test_lookahead_slots_cover_seq_len_plus_k():
    k, bs = 3, 4
    s = one_request(k=k, bs=bs, max_tokens=30, prompt=list(range(1, 8)))
    c = Caller(s, bs)
    drafts = [[50, 51], [52], [], [53, 54, 55]]
    for step in range(6):
        plan = s.schedule()
        c.apply(plan)
        seq_len = int(plan.seq_lens[0])
        need = -(-(seq_len + k) // bs)  # blocks covering positions up to seq_len + k - 1
        bt = s.block_tables()
        assert bt.shape[1] >= need and (bt[0, :need] >= 0).all(), "lookahead blocks missing"
        row = int(plan.block_table_rows[0])
        assert (c.rows[row, :need] == bt[0, :need]).all(), "lookahead blocks not sent to the caller's buffer"
        # Nobody else holds them (the drafter writes there).
        free, cached = s.free_and_cached_pages()
        assert not set(bt[0, :need].tolist()) & (set(free) | set(cached))
        nd = int(plan.num_draft_tokens[0])
        q0 = int(plan.query_start_loc[0])
        acc = nd + 1
        sampled = plan.input_ids[q0 + 1:q0 + 1 + nd].tolist() + [60 + step]
        s.update(sampled, accepted=[acc], drafts=[drafts[step % len(drafts)]])


def test_lookahead_never_reaches_past_max_tokens():
    s = one_request(k=4, bs=1, max_tokens=3, prompt=[1, 2, 3])
    plan = s.schedule()
    # prompt 3 + max_tokens 3: no token is ever fed at position 5 or later.
    assert s.block_tables().shape[1] == 3 + 3
    s.update([9], drafts=[[10, 11, 12, 13]])
    plan = s.schedule()
    # One output so far, two left: at most one draft (the step commits up to 2).
    assert plan.num_draft_tokens.tolist() == [1]
    assert s.block_tables().shape[1] == 6
    upd = s.update([10, 14], accepted=[2], drafts=[[1]])
    assert upd.finished_reasons == ["length"]
    assert s.get_output_tokens("a", 0).tolist() == [9, 10, 14]
    assert s.stats()["kv_pages"] == 0


def test_drafts_are_cut_to_the_token_budget():
    # Budget 6, three decodes: each keeps one row, the first in order takes what is left.
    s = Scheduler(64, 4, 1, 3, 6, 64, num_speculative_tokens=4)
    for i in range(3):
        s.add_request(f"r{i}", [1, 2], max_tokens=20)
    s.schedule()
    s.update([5, 6, 7])
    plan = s.schedule()
    assert len(plan) == 3
    s.update([8, 9, 10], drafts=[[1, 2, 3, 4]] * 3)
    plan = s.schedule()
    assert int(plan.num_draft_tokens.sum()) + 3 == 6 == len(plan.input_ids)
    assert plan.num_draft_tokens.tolist() == [3, 0, 0]


def test_stop_token_inside_the_accepted_tokens_finishes_there():
    s = one_request(k=3)
    s.schedule()
    s.update([20], drafts=[[21, EOS, 23]])
    s.schedule()
    upd = s.update([21, EOS, 23, 24], accepted=[4])
    assert upd.token_ids.tolist() == [21, EOS], "tokens after the stop were committed"
    assert upd.finished_request_ids == ["a"] and upd.finished_reasons == ["stop"]
    assert s.get_output_tokens("a", 0).tolist() == [20, 21, EOS]
    st = s.stats()
    assert st["kv_pages"] == 0 and st["running_state_pages"] == 0
    assert not s.has_unfinished()


def test_min_tokens_holds_a_stop_token_inside_the_accepted_ones():
    s = Scheduler(64, 4, 1, 4, 32, 64, num_speculative_tokens=3)
    s.add_request("a", [1, 2], max_tokens=10, min_tokens=3, eos_token_ids=[EOS])
    s.schedule()
    s.update([20], drafts=[[EOS, EOS, 5]])
    s.schedule()
    upd = s.update([EOS, EOS, 5, 6], accepted=[4])
    # Outputs 2 (EOS) is below min_tokens; output 3 (EOS) stops.
    assert upd.token_ids.tolist() == [EOS, EOS]
    assert upd.finished_reasons == ["stop"]


def _state(s):
    st = s.stats()
    return st, s.running_tables(), s.running_states(), s.get_output_tokens("a", 0).tolist()


@pytest.mark.parametrize("bad", [
    dict(sampled=[21, 22, 30], accepted=[4]),            # more than d + 1
    dict(sampled=[], accepted=[0]),                      # less than 1
    dict(sampled=[21, 30], accepted=[2, 1]),             # one count per entry
    dict(sampled=[21, 22], accepted=[3]),                # count and tokens disagree
    dict(sampled=[99, 30], accepted=[2]),                # an accepted token that is not the draft
    dict(sampled=[21, 30], accepted=[2], drafts=[[1, 2, 3, 4]]),  # more than k drafts
    dict(sampled=[21, 30], accepted=[2], drafts=[[1], [2]]),      # one list per entry
    dict(sampled=[21, -3], accepted=[2]),                # negative token
])
def test_bad_updates_raise_and_change_nothing(bad):
    s = one_request(k=3)
    s.schedule()
    s.update([20], drafts=[[21, 22, 23]])
    s.schedule()
    before = _state(s)
    with pytest.raises(ValueError) as ei:
        s.update(bad["sampled"], accepted=bad["accepted"], drafts=bad.get("drafts"))
    assert str(ei.value)
    assert _state(s) == before
    # The plan is still pending and a correct update goes through.
    upd = s.update([21, 22, 30], accepted=[3])
    assert upd.token_ids.tolist() == [21, 22, 30]


def test_entries_without_drafts_must_accept_num_samples():
    s = one_request(k=2)
    s.schedule()
    with pytest.raises(ValueError):
        s.update([20, 21], accepted=[2])
    s.update([20], accepted=[1])
    assert s.get_output_tokens("a", 0).tolist() == [20]


def test_drafts_refused_without_speculation_and_for_mid_prefill_entries():
    s = one_request(k=0)
    s.schedule()
    with pytest.raises(ValueError):
        s.update([20], drafts=[[1]])
    s.update([20])
    s2 = one_request(k=2, budget=4, prompt=list(range(1, 10)))
    plan = s2.schedule()
    assert plan.num_samples.tolist() == [0]  # a chunk of the prompt
    with pytest.raises(ValueError):
        s2.update([], drafts=[[1]])
    s2.update([], drafts=[[]])


def test_preemption_drops_drafts():
    # Pages for one sequence's growth only: the later request is preempted.
    bs = 2
    s = Scheduler(12, bs, 1, 2, 16, 64, num_speculative_tokens=2, enable_prefix_caching=False)
    s.add_request("a", [1, 2, 3], max_tokens=12)
    s.add_request("b", [4, 5, 6], max_tokens=12)
    plan = s.schedule()
    assert len(plan) == 2
    s.update([10, 11], drafts=[[12, 13], [14, 15]])
    preempted = None
    for _ in range(12):
        plan = s.schedule()
        if plan.preempted:
            preempted = plan.preempted[0]
            break
        sampled, acc, drafts = [], [], []
        for b in range(len(plan)):
            nd = int(plan.num_draft_tokens[b])
            q0 = int(plan.query_start_loc[b])
            sampled += plan.input_ids[q0 + 1:q0 + 1 + nd].tolist() + [20]
            acc.append(nd + 1)
            drafts.append([21, 22])
        s.update(sampled, accepted=acc, drafts=drafts)
    assert preempted == "b"
    assert "b" not in plan.request_ids
    s.update([20] * len(plan), accepted=[1] * len(plan))
    out_b = s.get_output_tokens("b", 0).tolist()
    # Readmitted: it re-prefills its committed tokens and drafts nothing it was given before.
    while True:
        plan = s.schedule()
        if "b" in plan.request_ids:
            break
        s.update([20] * int(plan.num_samples.sum()))
    b = plan.request_ids.index("b")
    assert plan.num_draft_tokens[b] == 0
    q0 = int(plan.query_start_loc[b])
    assert plan.input_ids[q0:q0 + int(plan.num_scheduled_tokens[b])].tolist() == ([4, 5, 6] + out_b)[
        int(plan.num_computed_tokens[b]):]


def test_abort_step_discards_the_plans_drafts():
    s = one_request(k=3)
    s.schedule()
    s.update([20], drafts=[[21, 22, 23]])
    plan = s.schedule()
    assert plan.num_draft_tokens.tolist() == [3]
    assert s.abort_step() == ["a"]
    plan = s.schedule()
    # Re-prefilled from the committed tokens only (past a prefix-cache hit), no drafts.
    start = int(plan.num_computed_tokens[0])
    assert plan.input_ids.tolist() == [1, 2, 3, 4, 5, 20][start:]
    assert plan.num_draft_tokens.tolist() == [0]
    s.update([30], drafts=[[31]])
    plan = s.schedule()
    assert plan.input_ids.tolist() == [30, 31]
    s.update([31, 32], accepted=[2])
    assert s.get_output_tokens("a", 0).tolist() == [20, 30, 31, 32]
    assert s.stats()["preemptions"] == 0


def test_fork_children_start_without_drafts_and_draft_alone_later():
    s = Scheduler(64, 4, 1, 4, 32, 64, num_speculative_tokens=2)
    s.add_request("a", [1, 2, 3, 4, 5, 6], max_tokens=8, n=3)
    plan = s.schedule()
    assert plan.num_samples.tolist() == [3]
    s.update([10, 11, 12], drafts=[[40, 41]])  # ignored: the entry forks
    plan = s.schedule()
    assert len(plan) == 3 and plan.num_draft_tokens.tolist() == [0, 0, 0]
    # Each child gets its own drafts, one does not draft.
    s.update([13, 14, 15], drafts=[[50, 51], [], [60]])
    plan = s.schedule()
    by_sample = {int(plan.sample_indices[b]): b for b in range(len(plan))}
    assert [int(plan.num_draft_tokens[by_sample[i]]) for i in range(3)] == [2, 0, 1]
    # No block a child writes (its row or its lookahead) is held by another table.
    held = Counter(b for t in s.running_tables() for b in t)
    bt = s.block_tables()
    for b in range(len(plan)):
        start, seq_len = int(plan.num_computed_tokens[b]), int(plan.seq_lens[b])
        mine = bt[b, start // 4: -(-(seq_len + 2) // 4)].tolist()
        assert all(x >= 0 for x in mine), "lookahead blocks missing"
        assert all(held[x] == 1 for x in mine), "a written block is shared between samples"


def test_beam_requests_do_not_speculate():
    s = Scheduler(64, 4, 1, 4, 32, 64, num_speculative_tokens=2)
    s.add_request("a", [1, 2, 3], max_tokens=5, n=2, beam_search=True)
    s.schedule()
    s.update([10, 11])
    s.schedule()
    with pytest.raises(ValueError):
        s.update([12, 13], drafts=[[1], []])
    s.update([12, 13], drafts=[[], []])


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_with_drafts(seed):
    """Random requests (n > 1 too), drafts and acceptance counts on a small arena
    (preemption, prefix hits): every fed token, KV read and output checked against
    the oracle; every page comes back."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    k = rng.choice([1, 2, 3])
    num_pages = rng.randint(30, 90)
    s = Scheduler(num_pages, bs, 1, 4, rng.randint(4, 16), 48, num_speculative_tokens=k,
                  enable_prefix_caching=rng.random() < 0.5)
    c = Caller(s, bs)
    committed: dict[tuple[str, int], list[int]] = {}
    prompts, params = {}, {}
    shared = list(range(11, 25))
    for i in range(10):
        rid = f"r{i}"
        prompts[rid] = shared[: rng.randint(0, 12)] + [rng.randrange(30, 40) for _ in range(rng.randint(1, 8))]
        params[rid] = dict(max_tokens=rng.randint(1, 14), n=rng.choice([1, 1, 2]))
        try:
            s.add_request(rid, prompts[rid], eos_token_ids=[EOS], **params[rid])
        except InvalidRequest:
            continue  # larger than this arena
        for si in range(params[rid]["n"]):
            committed[(rid, si)] = list(prompts[rid])
    drafts_given = accepted_sum = 0
    for _ in range(400):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        c.apply(plan)
        fed = [fed_tokens(plan, committed, b) for b in range(len(plan))]
        c.run(plan, fed)
        sampled, acc, drafts = [], [], []
        for b in range(len(plan)):
            nd = int(plan.num_draft_tokens[b])
            ns = int(plan.num_samples[b])
            if nd:
                a = rng.randint(1, nd + 1)
                start = int(plan.num_computed_tokens[b])
                sampled += fed[b][start + 1:start + a] + [rng.randrange(9)]
                acc.append(a)
                drafts_given += nd
                accepted_sum += a - 1
            else:
                sampled += [rng.randrange(9) for _ in range(ns)]
                acc.append(ns)
            drafts.append([rng.randrange(9) for _ in range(rng.randint(0, k))] if ns else [])
        upd = s.update(sampled, accepted=acc, drafts=drafts)
        for rid, si, t in zip(upd.request_ids, upd.sample_indices.tolist(), upd.token_ids.tolist()):
            committed[(rid, si)].append(t)
        for rid, si in zip(upd.finished_request_ids, upd.finished_sample_indices.tolist()):
            out = committed[(rid, si)][len(prompts[rid]):]
            assert len(out) <= params[rid]["max_tokens"]
            assert len(out) == params[rid]["max_tokens"] or out[-1] == EOS
        for (rid, si), toks in committed.items():
            assert s.get_output_tokens(rid, si).tolist() == toks[len(prompts[rid]):]
    assert not s.has_unfinished()
    st = s.stats()
    assert st["kv_pages"] == 0 and st["running_state_pages"] == 0
    assert st["free_pages"] + st["cached_pages"] + st["checkpoint_pages"] == num_pages
    assert (st["spec_draft_tokens"], st["spec_accepted_tokens"]) == (drafts_given, accepted_sum)


def test_numpy_counts_and_drafts_and_none_entries():
    s = Scheduler(64, 4, 1, 4, 32, 64, num_speculative_tokens=2)
    assert s.num_speculative_tokens == 2
    s.add_request("a", [1, 2, 3], max_tokens=8)
    s.add_request("b", [4, 5, 6], max_tokens=8)
    plan = s.schedule()
    s.update(np.array([10, 20], dtype=np.int32), drafts=[np.array([11, 12], dtype=np.int64), None])
    plan = s.schedule()
    assert dict(zip(plan.request_ids, plan.num_draft_tokens.tolist())) == {"a": 2, "b": 0}
    b_a = plan.request_ids.index("a")
    acc = np.ones(len(plan), dtype=np.int64)
    acc[b_a] = 2
    sampled = []
    for b in range(len(plan)):
        sampled += [11, 13] if b == b_a else [21]
    upd = s.update(np.array(sampled, dtype=np.int32), accepted=acc)
    assert s.get_output_tokens("a", 0).tolist() == [10, 11, 13]
    assert s.get_output_tokens("b", 0).tolist() == [20, 21]
    assert len(upd.token_ids) == 3
