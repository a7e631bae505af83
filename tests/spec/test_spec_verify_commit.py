"""Speculative verify rows and their commit (issue 34): the DeltaNet state after a
rollback equals decoding the accepted tokens one by one.

A verify batch mixes speculative runs (k+1 rows: the last accepted token plus k drafts)
with a prefill chunk and a plain decode. Its DeltaNet layers must read the speculative
runs' state without writing it, and ``commit_speculative`` must then leave, for random
accepted counts, the recurrent state, the conv state and the K/V of the kept positions
as a reference leaves them: the same model decoding exactly the accepted tokens, one
token per step, from a copy of the arena taken before the verify step. The verify
rows' logits must equal the one-by-one logits at every row (they do not depend on what
is accepted). Every path: the native kernels (module path: the native decode step
declines a step with a prefill chunk), the plain-PyTorch ops (HYBRIDSERVE_NO_NATIVE),
and the Triton kernels the GPU runs (under Triton's interpreter on the CPU; their own
read-only flag leaves the verify runs' state unwritten).
A verify step of speculative runs and one-token decodes only runs on the native decode
step, which must match the module path bit for bit.
"""

from __future__ import annotations

import os

# Before any Triton kernel module is imported (triton.jit reads it then); see
# tests/kernels/conftest.py.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridserve.kernels import native, ops  # noqa: E402
from hybridserve.model import ForwardBatch, load_model
from hybridserve.model.native_decode import NativeDecodeStep  # noqa: E402
from hybridserve.model.tiny import write_tiny_checkpoint  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {p: str(write_tiny_checkpoint(root / p, preset=p, seed=3)) for p in ("test-a", "test-b", "moe-a")}


@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["test-a"]


@pytest.fixture(params=["native", "torch", "triton"])
def kernels(request, monkeypatch):
    if request.param == "native":
        if not native.available():
            pytest.skip("the native kernels are not built")
    else:
        monkeypatch.setattr(native, "_DISABLED", True)
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
        # ops sends only CUDA tensors to Triton: forced here, the interpreter runs them.
        monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    return request.param


class Seq:
    def __init__(self, tokens, blocks, state):
        self.tokens = list(tokens)
        self.blocks = blocks
        self.state = state
        self.computed = 0


def make_batch(sched, speculative=None, all_logits=False):
    """``sched`` = [(seq, n)]: rows seq.tokens[computed:computed+n] (seq.computed is not
    advanced). Logits for every row with ``all_logits``, else each run's last row."""
    ids, pos, slots, qsl, lens, tables, states, init, rows = [], [], [], [0], [], [], [], [], []
    for seq, n in sched:
        for p in range(seq.computed, seq.computed + n):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + n)
        lens.append(seq.computed + n)
        tables.append(seq.blocks)
        states.append(seq.state)
        init.append(seq.computed > 0)
        rows.extend(range(qsl[-2], qsl[-1]) if all_logits else [qsl[-1] - 1])
    b = ForwardBatch.from_lists(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl,
                                seq_lens=lens, block_tables=tables, state_pages=states, has_initial_state=init,
                                logits_indices=rows, speculative=speculative)
    b.validate()
    return b


def state_items(cache, seq):
    """(recurrent items, conv items) of every DeltaNet layer of ``seq``."""
    rec, conv = [], []
    for layer in cache.config.linear_attention_layers:
        st = cache.state(layer)
        per_r, per_c = st.recurrent_pool.shape[1], st.conv_pool.shape[1]
        for h in range(cache.layout.num_value_heads):
            i = st.recurrent_item_base + h
            rec.append(st.recurrent_pool[seq.state[i // per_r], i % per_r].clone())
        i = st.conv_item_base
        conv.append(st.conv_pool[seq.state[i // per_c], i % per_c].clone())
    return torch.stack(rec), torch.stack(conv)


def kv_rows(cache, seq, upto):
    out = []
    for layer in cache.config.full_attention_layers:
        k, v = cache.kv(layer)
        for p in range(upto):
            blk, off = seq.blocks[p // BLOCK], p % BLOCK
            out.append(torch.cat([k[blk, off].flatten(), v[blk, off].flatten()]))
    return torch.stack(out)


def _spec_setup(tiny_dirs, preset, dtype, seed):
    """``rng`` of ``seed``, the model of ``preset``, a 160-page cache and its pages in a
    random order."""
    rng = random.Random(seed)
    model, config = load_model(tiny_dirs[preset], dtype=dtype, progress=False)
    cache = model.new_cache(160, BLOCK)
    free = list(range(cache.num_pages))
    rng.shuffle(free)
    return rng, model, config, cache, free


def _prefilled(model, config, cache, free, rng, ks):
    """One sequence per ``k`` (drafts of its verify run; None: a plain decode) on pages
    from ``free``, prefilled on the module path up to its verify rows."""
    seqs = []
    for k in ks:
        n = rng.randint(3, 11) + (k or 0) + 1
        seqs.append(Seq([rng.randrange(config.vocab_size) for _ in range(n)],
                        [free.pop() for _ in range(-(-n // BLOCK))],
                        [free.pop() for _ in range(cache.state_pages)]))
    pre = [(s, len(s.tokens) - (k or 0) - 1) for s, k in zip(seqs, ks)]
    model.native_decode = False
    model(make_batch(pre), cache)
    model.native_decode = True
    for s, n in pre:
        s.computed = n
    return seqs


PRESETS = [("test-a", "float32"), ("test-a", "bfloat16"), ("test-b", "float32"), ("moe-a", "float32")]
# Every preset and seed on the CPU kernels; on Triton's interpreter (no bfloat16
# arithmetic, and slow) the float32 presets with one seed.
COMMIT_CASES = [(kern, preset, dtype, seed) for kern in ("native", "torch") for preset, dtype in PRESETS
                for seed in (0, 1, 2)] + [("triton", preset, dtype, 0) for preset, dtype in PRESETS
                                          if dtype == "float32"]


@pytest.mark.parametrize("kernels,preset,dtype,seed", COMMIT_CASES, indirect=["kernels"])
def test_commit_leaves_the_state_of_decoding_the_accepted_tokens_one_by_one(tiny_dirs, kernels, preset, dtype,
                                                                              seed, monkeypatch):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, config = load_model(tiny_dirs[preset], dtype=dtype, progress=False)
    cache = model.new_cache(160, BLOCK)
    free = list(range(cache.num_pages))
    rng.shuffle(free)

    def new_seq(n_tokens):
        blocks = [free.pop() for _ in range(-(-n_tokens // BLOCK))]
        return Seq([rng.randrange(config.vocab_size) for _ in range(n_tokens)], blocks,
                   [free.pop() for _ in range(cache.state_pages)])

    ks = [rng.randint(1, 4), rng.randint(0, 4)]  # drafts of the two speculative sequences
    spec = [new_seq(rng.randint(3, 9) + k + 1) for k in ks]
    chunk = new_seq(12)
    plain = new_seq(rng.randint(2, 6) + 1)
    # Prefill: every speculative sequence up to its verify rows, the plain one up to its
    # last token, the chunked one not at all.
    pre = [(s, len(s.tokens) - k - 1) for s, k in zip(spec, ks)] + [(plain, len(plain.tokens) - 1)]
    model(make_batch(pre), cache)
    for s, n in pre:
        s.computed = n
    before = cache.arena.clone()

    # The verify step: spec run 0, the prefill chunk, the plain decode, spec run 1.
    order = [(spec[0], ks[0] + 1), (chunk, 5), (plain, 1), (spec[1], ks[1] + 1)]
    flags = [True, False, False, True]
    verify = make_batch(order, speculative=flags, all_logits=True)
    seen = {"native_step": 0}
    real_run = NativeDecodeStep.run

    def counting_run(self, batch, c):
        out = real_run(self, batch, c)
        seen["native_step"] += out is not None
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting_run)
    logits = model(verify, cache)
    assert seen["native_step"] == 0, "the native decode step must decline a step with a prefill chunk"
    # The speculative runs' state pages are untouched by the verify forward.
    after_verify = cache.arena.view(cache.num_pages, -1)
    for s in spec:
        for p in s.state:
            assert torch.equal(after_verify[p], before.view(cache.num_pages, -1)[p])
    accepted = [rng.randint(1, k + 1) for k in ks]
    model.commit_speculative(verify, cache, torch.tensor([accepted[0], 0, 0, accepted[1]]))
    got_state = [state_items(cache, s) for s in spec + [chunk, plain]]
    got_kv = [kv_rows(cache, s, s.computed + a) for s, a in zip(spec, accepted)]

    # Reference: from the arena before the verify step, the chunk and the plain decode
    # as in the batch, then each speculative sequence's tokens one per step.
    ref = model.new_cache(160, BLOCK)
    ref.arena.copy_(before)
    model(make_batch([(chunk, 5), (plain, 1)]), ref)
    want_logits = {}
    for i, (s, k) in enumerate(zip(spec, ks)):
        c0 = s.computed
        rows = []
        for j in range(k + 1):
            rows.append(model(make_batch([(s, 1)]), ref)[0])
            s.computed += 1
            if j + 1 == accepted[i]:
                want_state = state_items(ref, s)
                want_kv = kv_rows(ref, s, s.computed)
                # Keep the state at the accepted position for the comparison below
                # (the remaining rows only produce logits).
                snap = (want_state, want_kv)
        want_logits[i] = torch.stack(rows)
        s.computed = c0
        torch.testing.assert_close(got_state[i][0], snap[0][0], rtol=1e-4, atol=1e-5)
        # The conv state holds projection outputs: a GEMM over the verify step's rows may
        # round differently from a one-row one (BLAS on the PyTorch path).
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_state[i][1].float(), snap[0][1].float(), **tol)
        torch.testing.assert_close(got_kv[i].float(), snap[1].float(), rtol=1e-4 if dtype == "float32" else 2e-2,
                                   atol=1e-5 if dtype == "float32" else 2e-2)
    for j, s in enumerate([chunk, plain]):
        want = state_items(ref, s)
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_state[2 + j][0], want[0], **tol)
        torch.testing.assert_close(got_state[2 + j][1].float(), want[1].float(), **tol)
    # Verify logits: spec 0's rows come first, spec 1's last.
    n0 = ks[0] + 1
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(logits[:n0], want_logits[0], **tol)
    torch.testing.assert_close(logits[-(ks[1] + 1):], want_logits[1], **tol)
    if dtype == "float32":
        assert torch.equal(logits[:n0].argmax(-1), want_logits[0].argmax(-1))


def test_verify_without_commit_leaves_every_state_page_as_it_was(tiny_dir, kernels):
    """The ring is the only record: the state pages of speculative runs are exactly the
    pre-step bytes after the forward (no write of any kind), also for a one-row run."""
    model, config = load_model(tiny_dir, progress=False)
    cache = model.new_cache(64, BLOCK)
    rng = random.Random(9)
    seqs = []
    nxt = iter(range(cache.num_pages))
    for n in (6, 7):
        seqs.append(Seq([rng.randrange(config.vocab_size) for _ in range(n)],
                        [next(nxt) for _ in range(-(-n // BLOCK))], [next(nxt) for _ in range(cache.state_pages)]))
    model(make_batch([(seqs[0], 4), (seqs[1], 6)]), cache)
    seqs[0].computed, seqs[1].computed = 4, 6
    before = cache.arena.clone().view(cache.num_pages, -1)
    b = make_batch([(seqs[0], 2), (seqs[1], 1)], speculative=[True, True])
    model(b, cache)
    now = cache.arena.view(cache.num_pages, -1)
    for s in seqs:
        for p in s.state:
            assert torch.equal(now[p], before[p])
    assert model.spec_ring_bytes(b) > 0
    with pytest.raises(ValueError, match="accepted"):
        model.commit_speculative(b, cache, [3, 1])
    model.commit_speculative(b, cache, [2, 1])
    with pytest.raises(ValueError, match="commit once"):
        model.commit_speculative(b, cache, [2, 1])


def test_a_checkpoint_on_a_speculative_run_is_refused():
    b = ForwardBatch.from_lists(input_ids=[1, 2], positions=[3, 4], slot_mapping=[3, 4], query_start_loc=[0, 2],
                                seq_lens=[5], block_tables=[[0, 1]], state_pages=[[2]], has_initial_state=[True],
                                logits_indices=[1], checkpoint_positions=[1], checkpoint_pages=[[3]],
                                speculative=[True])
    with pytest.raises(ValueError, match="checkpoint"):
        b.validate()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_native_verify_step_equals_the_module_path_bit_for_bit(tiny_dirs, preset, dtype, monkeypatch):
    """A verify step of speculative runs and one-token decodes runs on the native decode
    step; its logits, hidden states, ring, arena after the forward and arena after the
    commit equal the module path's exactly (the module path is checked against decoding
    one by one above and against HF elsewhere)."""
    if not native.available():
        pytest.skip("the native kernels are not built")
    rng, model, config, cache, free = _spec_setup(tiny_dirs, preset, dtype, 11)
    seen = {"native": 0}
    real_run = NativeDecodeStep.run

    def counting_run(self, batch, c):
        out = real_run(self, batch, c)
        seen["native"] += out is not None
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", counting_run)
    for ks in ([2], [4], [0, 3], [1, None, 3], [None, 2]):  # None: a plain one-token decode
        seqs = _prefilled(model, config, cache, free, rng, ks)
        before = cache.arena.clone()
        got = {}
        for path in ("module", "native"):
            cache.arena.copy_(before)
            model.native_decode = path == "native"
            vb = make_batch([(s, (k or 0) + 1) for s, k in zip(seqs, ks)],
                            speculative=[k is not None for k in ks], all_logits=True)
            n0 = seen["native"]
            logits, hidden = model(vb, cache, return_hidden=True)
            assert seen["native"] - n0 == (path == "native")
            ring = {i: tuple(t.clone() for t in v) for i, v in vb.spec_ring.items() if isinstance(i, int)}
            after = cache.arena.clone()
            accepted = [rng.randint(1, k + 1) if k is not None else 0 for k in ks] if path == "module" \
                else got["module"][-1]
            model.commit_speculative(vb, cache, accepted)
            got[path] = (logits, hidden, ring, after, cache.arena.clone(), accepted)
        model.native_decode = True
        m, nat = got["module"], got["native"]
        assert torch.equal(m[0], nat[0]) and torch.equal(m[1], nat[1])
        assert m[2].keys() == nat[2].keys() and len(m[2]) == len(config.linear_attention_layers)
        for i in m[2]:
            assert all(torch.equal(a, b) for a, b in zip(m[2][i], nat[2][i]))
        assert torch.equal(m[3], nat[3]) and torch.equal(m[4], nat[4])
        # Reused pages: the next round starts from this arena.
        free.extend(p for s in seqs for p in s.blocks + s.state)


@pytest.mark.parametrize("native_step", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_logits_equal_decoding_one_by_one_bit_for_bit(tiny_dirs, dtype, native_step):
    """On the native kernels a verify run's rows are computed as decode steps compute
    them (per-row GEMMs, the decode attention kernel per row, the state carried in
    float32 row by row), so its logits equal decoding the same tokens one per step
    exactly: greedy speculation then reproduces greedy decoding token for token, ties
    included. (The plain-PyTorch path's BLAS GEMMs round by row count: tolerance above.)"""
    if not native.available():
        pytest.skip("the native kernels are not built")
    model, config = load_model(tiny_dirs["test-a"], dtype=dtype, progress=False)
    model.native_decode = native_step
    cache = model.new_cache(64, BLOCK)
    rng = random.Random(4)
    s = Seq([rng.randrange(config.vocab_size) for _ in range(17)], list(range(5)), list(range(5, 5 + cache.state_pages)))
    model(make_batch([(s, 12)]), cache)
    s.computed = 12
    before = cache.arena.clone()
    got = model(make_batch([(s, 5)], speculative=[True], all_logits=True), cache)
    cache.arena.copy_(before)
    want = []
    for _ in range(5):
        want.append(model(make_batch([(s, 1)]), cache)[0])
        s.computed += 1
    assert torch.equal(got, torch.stack(want))


@pytest.mark.parametrize("preset,dtype", PRESETS)
def test_the_replay_in_one_native_call_equals_the_per_layer_calls_bit_for_bit(tiny_dirs, preset, dtype):
    """A verify step whose rows are all speculative commits through ``_core.ReplayPlan``
    (every DeltaNet layer's conv and delta rule in one call, no output norm): the arena
    after the commit equals, bit for bit, the per-layer kernel calls' (``fused_replay``
    off), for every accepted count, one sequence (the rows a prefix of the ring) and
    two (the plan where every row is kept, else rows picked from the ring: the
    per-layer calls)."""
    if not native.available() or not hasattr(native._k, "ReplayPlan"):
        pytest.skip("the native kernels are not built")
    rng, model, config, cache, free = _spec_setup(tiny_dirs, preset, dtype, 5)
    plans = {"used": 0}
    for ks in ([3], [1], [4], [2, 3]):
        seqs = _prefilled(model, config, cache, free, rng, ks)
        before = cache.arena.clone()
        for accepted in {tuple(min(a, k + 1) for k in ks) for a in range(1, max(ks) + 2)}:
            got = {}
            for fused in (True, False):
                cache.arena.copy_(before)
                vb = make_batch([(s, k + 1) for s, k in zip(seqs, ks)], speculative=[True] * len(ks),
                                all_logits=True)
                model(vb, cache)
                step = model._usable_native_step()
                assert step is not None
                step.fused_replay = fused
                real = step._replay_plan

                def counting(t, real=real):
                    plan = real(t)
                    plans["used"] += plan is not None
                    return plan

                step._replay_plan = counting
                try:
                    model.commit_speculative(vb, cache, list(accepted))
                finally:
                    del step._replay_plan
                    step.fused_replay = True
                got[fused] = cache.arena.clone()
            assert torch.equal(got[True], got[False]), (ks, accepted)
            assert not torch.equal(got[True], before)
        free.extend(p for s in seqs for p in s.blocks + s.state)
    # Through the plan: every one-sequence commit (k + 1 accepted counts each), and the
    # two-sequence one that keeps every row (its rows are the whole ring).
    assert plans["used"] == 4 + 2 + 5 + 1


def test_the_replay_plan_refuses_what_it_cannot_bind(tiny_dirs):
    """Misuse is a ValueError that names the argument, not a crash: more rows than the
    ring holds, a ring of the wrong shape, a pool that is not a paged view."""
    if not native.available() or not hasattr(native._k, "ReplayPlan"):
        pytest.skip("the native kernels are not built")
    import numpy as np

    model, config = load_model(tiny_dirs["test-a"], dtype="float32", progress=False)
    cache = model.new_cache(32, BLOCK)
    step = model._usable_native_step()
    step._bind_cache(cache)
    plan = step._replay_plan(3)
    assert plan is not None
    pages = np.zeros((1, cache.state_pages), dtype=np.int64)
    with pytest.raises(ValueError, match="4 rows to replay, the plan's ring holds 3"):
        plan.run(4, np.array([0, 4], dtype=np.int64), pages, np.array([True]))
    with pytest.raises(ValueError, match="query_start_loc"):
        plan.run(2, np.array([0, 3], dtype=np.int64), pages, np.array([True]))
    e = next(e for e in step._layers if not e["attn"])
    c = config
    layer = dict(ring=np.zeros((3, 5), dtype=np.float32), mixed_col=0, ba_col=c.linear_conv_dim + c.linear_value_dim,
                 conv_w=e["conv_w"], conv_pool=e["conv_pool"], conv_base=e["conv_base"], rec_pool=e["rec_pool"],
                 rec_base=e["rec_base"], a_log=e["a_log"], dt_bias=e["dt_bias"], key_heads=e["key_heads"],
                 value_heads=e["value_heads"], scale=e["scale"])
    conv = np.zeros((3, c.linear_conv_dim), dtype=np.float32)
    out = np.zeros((3, c.linear_value_dim), dtype=np.float32)
    with pytest.raises(ValueError, match="holds no conv input"):
        native._k.ReplayPlan([layer], conv, out, False)
    layer["ring"] = np.zeros((3, c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads),
                             dtype=np.float32)
    native._k.ReplayPlan([layer], conv, out, False)
    with pytest.raises(ValueError, match="rec_pool must be"):
        native._k.ReplayPlan([dict(layer, rec_pool=np.zeros((4, 4), dtype=np.float32))], conv, out, False)
