"""``Scheduler.abort_step``: a failed step's plan rolled back in the core. The oracle is
a plain record of what ``update()`` accepted per sample: every later plan must feed
exactly the prompt plus those tokens (nothing lost, nothing fed twice), rollbacks are
not counted as preemptions, and every page comes back at the end."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridserve._core import Scheduler


def _token(rid: str, si: int, pos: int) -> int:
    return (hash((rid, si, pos)) % 200) + 1  # never 0 (no EOS given anyway)


@pytest.mark.parametrize("seed,num_pages", [(1, 400), (2, 400), (3, 60), (4, 60), (5, 40)])
def test_rollback_feeds_exactly_the_committed_tokens(seed, num_pages):
    rng = random.Random(seed)
    s = Scheduler(num_pages, 4, 1, 4, 24, 96)
    prompts, ns, max_tokens = {}, {}, {}
    for i in range(24):
        rid = f"r{i}"
        prompts[rid] = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 30))]
        # Shared prefixes now and then (prefix-cache hits on readmission).
        if i % 4 == 3:
            prompts[rid] = prompts["r0"][:8] + prompts[rid]
        ns[rid] = 2 if i % 5 == 0 else 1
        max_tokens[rid] = rng.randrange(1, 12)
        s.add_request(rid, prompts[rid], max_tokens=max_tokens[rid], n=ns[rid], ignore_eos=True)
    committed: dict[tuple[str, int], list[int]] = {}
    rollbacks = 0
    for _ in range(2000):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        qsl = np.asarray(plan.query_start_loc)
        ids = np.asarray(plan.input_ids)
        sampled = []
        for b, rid in enumerate(plan.request_ids):
            si = int(plan.sample_indices[b])
            start = int(plan.num_computed_tokens[b])
            fed = ids[qsl[b]:qsl[b + 1]].tolist()
            whole = prompts[rid] + committed.get((rid, si), [])
            assert fed == whole[start:start + len(fed)], (rid, si, start)
            for k in range(int(plan.num_samples[b])):
                sk = k if plan.num_samples[b] > 1 else si
                sampled.append(_token(rid, sk, len(committed.get((rid, sk), []))))
        if len(plan.request_ids) and rng.random() < 0.3:
            back = s.abort_step()
            assert set(back) <= set(plan.request_ids)
            rollbacks += 1
            continue
        upd = s.update(np.asarray(sampled, dtype=np.int32))
        for rid, si, tok in zip(upd.request_ids, np.asarray(upd.sample_indices).tolist(),
                                np.asarray(upd.token_ids).tolist()):
            committed.setdefault((rid, si), []).append(tok)
    assert not s.has_unfinished() and rollbacks > 0
    for rid in prompts:
        for si in range(ns[rid]):
            got = committed.get((rid, si), [])
            assert got == [_token(rid, si, p) for p in range(max_tokens[rid])], (rid, si)
    s.schedule()  # the last frees are settled by the next plan
    st = s.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0 and st["available_pages"] == num_pages, st
    if num_pages >= 400:
        assert st["preemptions"] == 0  # a rollback is not a preemption


def test_abort_step_needs_a_pending_plan():
    s = Scheduler(64, 4, 1, 2, 8, 32)
    with pytest.raises(ValueError, match="pending plan"):
        s.abort_step()
    s.add_request("a", [1, 2, 3], max_tokens=2)
    s.schedule()
    assert s.abort_step() == ["a"]
    with pytest.raises(ValueError, match="pending plan"):
        s.abort_step()
    # Not refused for ever (the bug): the next plan runs "a" again from its first token.
    plan = s.schedule()
    assert list(plan.request_ids) == ["a"] and int(plan.num_computed_tokens[0]) == 0
