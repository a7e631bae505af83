"""Model-based test of hybridserve._core.Scheduler through the Python bindings.

Random workloads (adds, steps with random samples, aborts) are checked against an
oracle kept here, independent of the scheduler: each sample's true token stream
(prompt + the tokens this test sampled), a simulated KV memory (slot -> the token
prefix whose KV was written there) fed by slot_mapping / block_copies and read
through a caller-side block-table buffer built only from the incremental row
updates, a simulated DeltaNet state per arena page (read through the state page
table built from the state_table updates) fed by the plan, state_copies and the
mid-chunk checkpoint writes, and
the stop rule. Invariants: the budget is never exceeded; every token fed is the
right one at the right position; attention would read the right KV; the recurrent
state is the right one (so a preempted request resumes with the same tokens, and
a sequence resuming from a DeltaNet checkpoint starts from exactly its prefix);
every live checkpoint holds the state of the prefix its key block was computed
from, and no sequence runs on a checkpoint's pages; the arena: every page is
exactly one of free, parked cached, referenced KV (refcount = tables holding it),
a running state's or a checkpoint's, and the stats' per-use counts agree;
everything admitted finishes; afterwards every page is free, cached or a
checkpoint's.
Priorities: admission follows the ordering key (priority with aging, then
arrival), and every priority-preemption victim is outranked by the waiting head
(strictly larger priority, key larger by more than the threshold), at most the
per-step bound of them per step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve._core import Scheduler
from hybridserve.errors import InvalidRequest, QueueFull

EOS, STOP = 7, 5
SHARED = list(range(11, 35))


def stop_rule(p, n_out, t):
    if n_out >= p["min_tokens"] and ((not p["ignore_eos"] and t == EOS) or t == STOP):
        return "stop"
    if n_out >= p["max_tokens"]:
        return "length"
    return None


def run_workload(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    pps = rng.randint(1, 3)
    num_pages = rng.randint(pps + 6, 60)
    max_seqs = rng.randint(1, 5)
    budget = max_seqs + rng.randint(0, 20)
    max_len = 40
    thresh = rng.choice([0, 3, 8])
    aging = rng.choice([0, 2])
    caching = rng.random() < 0.5
    pthr, pbound = rng.choice([0, 1, 2]), rng.choice([0, 1, 4])
    s = Scheduler(num_pages, bs, pps, max_seqs, budget, max_len,
                  enable_prefix_caching=caching, long_prefill_token_threshold=thresh,
                  aging_interval_steps=aging, max_waiting_requests=8,
                  priority_preemption_threshold=pthr, max_priority_preemptions_per_step=pbound)
    clock = [0, 0]  # schedule() calls so far, requests accepted so far

    def units(r):
        return sum(not d for d in r["done"]) if r["forked"] else r["p"]["n"]

    def key(r):
        p = r["p"]["priority"]
        return (p * aging + r["arrival"] if aging else p, r["order"])

    def outranks(h, v):
        return (h["p"]["priority"] < v["p"]["priority"]
                and key(v)[0] - key(h)[0] > pthr * max(aging, 1))
    rows = np.full((max_seqs, s.max_blocks_per_seq), -7, dtype=np.int64)
    st_rows = np.full((max_seqs, pps), -7, dtype=np.int64)
    reqs: dict[str, dict] = {}
    kv: dict[int, tuple] = {}
    state: dict[int, tuple] = {}
    outside: set = set()

    def toks(r, i):
        return r["prompt"] + r["out"][i]

    def add(k):
        prompt = SHARED[: rng.randint(0, 20)] + [rng.randrange(40) for _ in range(rng.randint(0, 12))] or [1]
        p = dict(max_tokens=rng.randint(1, 10), min_tokens=rng.randint(0, 3), n=rng.randint(1, 3),
                 ignore_eos=rng.random() < 0.3, priority=rng.randint(-3, 2))
        total = len(prompt) + p["max_tokens"]
        invalid = (total > max_len or p["n"] > max_seqs
                   or p["n"] * (-(-total // bs) + pps) > num_pages or p["min_tokens"] > p["max_tokens"])
        waiting = sum(r["st"] == "w" for r in reqs.values())
        rid = f"r{k}"
        try:
            s.add_request(rid, np.array(prompt, dtype=np.int32), max_tokens=p["max_tokens"],
                          min_tokens=p["min_tokens"], n=p["n"], ignore_eos=p["ignore_eos"],
                          priority=p["priority"], eos_token_ids=[EOS], stop_token_ids=[STOP])
        except InvalidRequest as e:
            assert invalid, f"refused a valid request: {e}"
            assert str(e)  # says what to change
            return
        except QueueFull:
            assert not invalid and waiting >= 8
            return
        assert not invalid and waiting < 8
        reqs[rid] = dict(prompt=prompt, p=p, st="w", forked=False, out=[[] for _ in range(p["n"])],
                         done=[False] * p["n"], computed=[0] * p["n"], arrival=clock[0], order=clock[1])
        clock[1] += 1

    def check_arena(out):
        """Each page in exactly one use, from sources the stats do not compute."""
        free, cached = s.free_and_cached_pages()
        owner: dict[int, list] = {}
        for pg in free:
            owner.setdefault(pg, []).append("free")
        for pg in cached:
            owner.setdefault(pg, []).append("cached")
        refs: dict[int, int] = {}
        for table in s.running_tables():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        for b in refs:
            owner.setdefault(b, []).append("kv")
        for _sid, pages in s.running_states():
            for pg in pages:
                owner.setdefault(pg, []).append("state")
        for pages, *_ in s.checkpoints():
            for pg in pages:
                owner.setdefault(pg, []).append("checkpoint")
        for pg in out.checkpoint_pages.tolist():
            owner.setdefault(pg, []).append("checkpoint")
        assert all(len(o) == 1 for o in owner.values()), "a page used twice"
        st_ = s.stats()
        count = lambda w: sum(o == [w] for o in owner.values())  # noqa: E731
        deferred = num_pages - len(owner)  # dropped checkpoints still read by this plan
        assert deferred % pps == 0 and st_["checkpoint_pages"] == count("checkpoint") + deferred, "pages leaked"
        assert (st_["free_pages"], st_["cached_pages"], st_["kv_pages"], st_["running_state_pages"]) == \
            (count("free"), count("cached"), count("kv"), count("state"))

    def step():
        waiting = [r for r in reqs.values() if r["st"] == "w"]
        head = min(waiting, key=key) if waiting else None
        out = s.schedule()
        clock[0] += 1
        assert len(out.preempted_causes) == len(out.preempted)
        prio = [rid for rid, c in zip(out.preempted, out.preempted_causes) if c == "priority"]
        assert len(prio) <= pbound, "priority preemption bound exceeded"
        for rid in prio:
            assert head is not None and outranks(head, reqs[rid]), "priority victim not outranked by the head"
        was_waiting = {rid for rid, r in reqs.items() if r["st"] == "w"}
        got = {(a, b, c) for a, b, c in out.finished}
        assert got == outside, "finished-outside report"
        outside.clear()
        for rid in out.preempted:
            r = reqs[rid]
            assert r["st"] == "r"
            r["st"] = "w"
            r["computed"] = [0] * len(r["computed"])
        B = len(out.request_ids)
        T = int(out.query_start_loc[-1])
        assert B <= max_seqs and T <= budget, "budget exceeded"
        assert len(out.input_ids) == T == len(out.slot_mapping) == len(out.positions)
        for src, dst in out.block_copies.tolist():
            for o in range(bs):
                if src * bs + o in kv:
                    kv[dst * bs + o] = kv[src * bs + o]
                else:
                    kv.pop(dst * bs + o, None)
        snap = dict(state)
        for src, dst in out.state_copies.tolist():
            state[dst] = snap.get(src, ())
        ckpt_pages = set()
        for pages, ntok, last, _gen in s.checkpoints():
            assert ntok % bs == 0 and len(pages) == pps and not ckpt_pages & set(pages)
            ckpt_pages |= set(pages)
            for pg in pages:
                assert len(state.get(pg, ())) == ntok, "checkpoint holds a state of the wrong length"
                assert kv.get(last * bs + bs - 1) == state.get(pg), "checkpoint state is not its key's prefix"
        rows[out.block_table_update_rows, out.block_table_update_cols] = out.block_table_update_values
        st_rows[out.state_table_update_rows, out.state_table_update_cols] = out.state_table_update_values
        entry_pages = [p for e in range(B) for p in st_rows[int(out.block_table_rows[e])].tolist()]
        assert not ckpt_pages & set(entry_pages), "a sequence runs on a checkpoint's pages"
        assert len(set(entry_pages)) == B * pps and len(set(out.block_table_rows.tolist())) == B
        check_arena(out)
        ents = []
        ck_pages = out.checkpoint_pages.tolist()
        for e in range(B):
            rid, sm = out.request_ids[e], int(out.sample_indices[e])
            r = reqs[rid]
            if r["st"] == "w":
                r["st"] = "r"
            assert r["st"] == "r" and not r["done"][sm]
            t = toks(r, sm)
            start, k, q0 = int(out.num_computed_tokens[e]), int(out.num_scheduled_tokens[e]), int(out.query_start_loc[e])
            live = [i for i, d in enumerate(r["done"]) if not d]
            if r["forked"] and start < len(r["prompt"]):
                assert sm == live[0], "a recomputed forked request prefilled its prompt twice"
            if r["computed"][sm] == 0 and start > 0:
                # Checkpoint hit, or a sample re-forked at the prompt's end after a
                # recompute: the state assertion below checks what it resumes from.
                assert start % bs == 0 or (r["forked"] and start == len(r["prompt"]))
                r["computed"][sm] = start
            assert start == r["computed"][sm] and k >= 1 and start + k <= len(t)
            assert int(out.seq_lens[e]) == start + k
            decode = k == 1 and start >= len(r["prompt"]) and start + 1 == len(t)
            if e < out.num_decodes:
                assert decode, "non-decode among the decodes"
            if not decode and thresh:
                assert k <= thresh
            want = (1 if r["forked"] else r["p"]["n"]) if start + k == len(t) else 0
            assert int(out.num_samples[e]) == want
            assert out.input_ids[q0:q0 + k].tolist() == t[start:start + k], "fed the wrong tokens"
            assert out.positions[q0:q0 + k].tolist() == list(range(start, start + k))
            for pg in st_rows[int(out.block_table_rows[e])].tolist():
                if start:
                    assert state.get(pg) == tuple(t[:start]), "wrong DeltaNet state"
                state[pg] = tuple(t[:start + k])
            pos = int(out.checkpoint_positions[e])
            if pos >= 0:
                # Written by the forward inside the chunk: the state after `pos` tokens.
                assert 1 <= pos <= k and (start + pos) % bs == 0
                for pg in ck_pages[:pps]:
                    state[pg] = tuple(t[:start + pos])
                ck_pages = ck_pages[pps:]
            ents.append((r, sm, t, start, k, q0))
        still = [r for r in reqs.values() if r["st"] == "w"]
        for rid in was_waiting:
            if reqs[rid]["st"] == "r":
                assert all(key(w) > key(reqs[rid]) for w in still), "admitted ahead of a smaller key"
        # No missed room where sequences are the only scarce resource: a head that
        # outranks running requests is admitted unless the bound was reached or
        # it would not fit even without all of them.
        plenty = not caching and num_pages > max_seqs * (s.max_blocks_per_seq + pps)
        if plenty and pbound and T < budget and still and len(prio) < pbound:
            h = min(still, key=key)
            running = [r for r in reqs.values() if r["st"] == "r"]
            if h is head and any(outranks(h, r) for r in running):
                kept = sum(units(r) for r in running if not outranks(h, r))
                assert kept + units(h) > max_seqs, "head left waiting though outranked requests hold its room"
        for r, sm, t, start, k, q0 in ents:
            for j in range(k):
                sl = int(out.slot_mapping[q0 + j])
                if sl >= 0:
                    kv[sl] = tuple(t[:start + j + 1])
        for e, (r, sm, t, start, k, q0) in enumerate(ents):
            row = rows[int(out.block_table_rows[e])]
            for pos in range(start + k):
                sl = int(row[pos // bs]) * bs + pos % bs
                assert kv.get(sl) == tuple(t[:pos + 1]), f"attention would read wrong KV at {pos}"
        sampled = [rng.randrange(9) for _ in range(int(out.num_samples.sum()))]
        upd = s.update(np.array(sampled, dtype=np.int32))
        want_rows, want_fin, off = [], set(), 0
        for e, (r, sm, t, start, k, q0) in enumerate(ents):
            ns = int(out.num_samples[e])
            got_t = sampled[off:off + ns]
            off += ns
            rid = out.request_ids[e]
            if ns > 1:
                r["forked"] = True
                c = r["computed"][0] + k
                for j, tok in enumerate(got_t):
                    r["computed"][j] = c
                    r["out"][j].append(tok)
                    want_rows.append((rid, j, tok))
                    why = stop_rule(r["p"], len(r["out"][j]), tok)
                    if why:
                        r["done"][j] = True
                        want_fin.add((rid, j, why))
            else:
                r["computed"][sm] += k
                if ns == 1:
                    r["out"][sm].append(got_t[0])
                    want_rows.append((rid, sm, got_t[0]))
                    why = stop_rule(r["p"], len(r["out"][sm]), got_t[0])
                    if why:
                        r["done"][sm] = True
                        want_fin.add((rid, sm, why))
            if all(r["done"]):
                r["st"] = "d"
        got_rows = list(zip(upd.request_ids, upd.sample_indices.tolist(), upd.token_ids.tolist()))
        assert got_rows == want_rows
        got_fin = set(zip(upd.finished_request_ids, upd.finished_sample_indices.tolist(), upd.finished_reasons))
        assert got_fin == want_fin

    k = 0
    for _ in range(rng.randint(5, 60)):
        x = rng.random()
        if x < 0.35:
            add(k)
            k += 1
        elif x < 0.9:
            step()
        elif reqs:
            rid = rng.choice(list(reqs))
            r = reqs[rid]
            ok = s.abort(rid)
            assert ok == (r["st"] != "d")
            if ok:
                for i in (range(len(r["done"])) if not r["forked"] else [i for i, d in enumerate(r["done"]) if not d]):
                    outside.add((rid, i, "abort"))
                r["done"] = [True] * len(r["done"])
                r["st"] = "d"
    n = 0
    while s.has_unfinished():
        step()
        n += 1
        assert n < 3000, "did not drain"
    held = s.stats()
    assert (held["kv_pages"], held["running_state_pages"]) == (0, 0), "pages held after the last request ended"
    step()
    assert all(r["st"] == "d" for r in reqs.values()), "an admitted request never finished"
    st_ = s.stats()
    assert st_["kv_pages"] == 0 and st_["running_state_pages"] == 0, "pages leaked"
    assert st_["free_pages"] + st_["cached_pages"] + st_["checkpoint_pages"] == num_pages, "pages leaked"
    assert st_["checkpoints"] == len(s.checkpoints()) and st_["checkpoint_pages"] == pps * len(s.checkpoints())
    assert st_["available_pages"] == num_pages


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_scheduler_matches_model(seed):
    run_workload(seed)


def test_refusals_say_what_to_change():
    s = Scheduler(16, 4, 1, 2, 8, 32, max_waiting_requests=1)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        s.add_request("a", list(range(40)), max_tokens=1)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add_request("a", [], max_tokens=1)
    s.add_request("a", [1, 2, 3], max_tokens=2)
    with pytest.raises(InvalidRequest, match="already in use"):
        s.add_request("a", [1, 2, 3], max_tokens=2)
    with pytest.raises(QueueFull):
        s.add_request("b", [1, 2, 3], max_tokens=2)
    assert s.num_waiting() == 1
