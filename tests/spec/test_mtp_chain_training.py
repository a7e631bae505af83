"""The chained MTP training (``train mtp --depth D``, :func:`hybridserve.train.mtp.mtp_chain`)
against the engine's drafter: pass d's logits for the chain that starts at position i
equal what the drafter computes for the same prefix when it drafts from position i
(its MTP prefill of rows 0..i, then passes chained at positions i+1, i+2, ... in its
paged MTP KV), in float32 on a small random model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hybridserve.model import ForwardBatch, load_model
from hybridserve.model.tiny import write_tiny_checkpoint

BLOCK = 4
T = 14
DEPTH = 3


def _batch(ids, positions, slots, table, logits):
    return ForwardBatch.from_lists(input_ids=ids, positions=positions, slot_mapping=slots,
                                   query_start_loc=[0, len(ids)], seq_lens=[positions[-1] + 1],
                                   block_tables=[table], state_pages=[[0]], has_initial_state=[True],
                                   logits_indices=logits)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from hybridserve.train.export import load_trained

    torch.manual_seed(0)
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "test-a", preset="test-a", seed=13)
    engine, config = load_model(path, dtype="float32", progress=False, load_mtp=True)
    engine.native_decode = False
    hf, mtp = load_trained(str(path))
    ids = torch.randint(0, config.vocab_size, (T,))
    return path, engine, config, hf, mtp, ids


def _training_logits(hf, mtp, ids, chain_token):
    from hybridserve.train.mtp import mtp_chain

    with torch.no_grad():
        h = hf.model(input_ids=ids[None]).last_hidden_state
        emb = hf.model.embed_tokens(ids[None])

        def drafted(d, prev):
            return hf.model.embed_tokens(hf.lm_head(prev).argmax(-1))

        outs = mtp_chain(mtp, h, emb, hf.model.rotary_emb, DEPTH, drafted if chain_token == "draft" else None)
        return h, [hf.lm_head(m)[0] for m in outs]


def _drafter_logits(engine, config, ids, i, chain_token):
    """The drafter from position i: the trunk over tokens 0..i, the MTP prefill of rows
    0..i (row p: trunk state p, token p+1), then DEPTH-1 chained one-row passes (pass j at
    position i+j: the previous pass's MTP state and the next token)."""
    from hybridserve.memory.layout import arena_layout
    sp = arena_layout(config, BLOCK, "float32").state_pages
    nb = -(-(T + DEPTH) // BLOCK)
    table = list(range(nb))
    cache = engine.new_cache(nb + sp + 1, BLOCK)
    with torch.no_grad():
        # Stale values in the MTP KV past the prefix must not count.
        cache.arena.copy_(torch.randn(cache.arena.shape))

    def slot(p):
        return table[p // BLOCK] * BLOCK + p % BLOCK

    n = i + 1
    trunk = ForwardBatch.from_lists(input_ids=ids[:n].tolist(), positions=list(range(n)),
                                    slot_mapping=[slot(p) for p in range(n)], query_start_loc=[0, n],
                                    seq_lens=[n], block_tables=[table], state_pages=[list(range(nb, nb + sp))],
                                    has_initial_state=[False], logits_indices=[n - 1])
    with torch.no_grad():
        _, hidden = engine(trunk, cache, return_hidden=True)
        batch = _batch(ids[1:n + 1].tolist(), list(range(n)), [slot(p) for p in range(n)], table, [n - 1])
        lg, out = engine.mtp_forward(hidden, batch.input_ids, batch, cache)
        logits, h = [lg[0]], out[n - 1:n]
        for j in range(1, DEPTH):
            p = i + j
            tok = int(ids[p + 1]) if chain_token == "text" else int(logits[-1].argmax())
            batch = _batch([tok], [p], [slot(p)], table, [0])
            lg, h = engine.mtp_forward(h, batch.input_ids, batch, cache)
            logits.append(lg[0])
    return hidden, logits


@pytest.mark.parametrize("chain_token", ["text", "draft"])
def test_chained_training_logits_equal_the_drafters(setup, chain_token):
    path, engine, config, hf, mtp, ids = setup
    h, train = _training_logits(hf, mtp, ids, chain_token)
    assert [t.shape[0] for t in train] == [T - d for d in range(1, DEPTH + 1)]
    for i in (0, 3, T - 1 - DEPTH):
        hidden, got = _drafter_logits(engine, config, ids, i, chain_token)
        torch.testing.assert_close(hidden, h[0, :i + 1], rtol=1e-4, atol=1e-4)
        for d in range(1, DEPTH + 1):
            torch.testing.assert_close(got[d - 1], train[d - 1][i], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"chain from {i}, pass {d}: {m}")


def test_chained_draft_ids_equal_the_native_drafter(setup):
    """Draft mode's argmax tokens (the drafts the training chain feeds itself) equal the
    native one-call drafter's (NativeDecodeStep.mtp_draft, what the proposer runs on CPU)."""
    from hybridserve.kernels import native

    if not native.available():
        pytest.skip("the native kernels are not built")
    path, engine, config, hf, mtp, ids = setup
    _, train = _training_logits(hf, mtp, ids, "draft")
    i = 5
    n = i + 1
    _, ref = _drafter_logits(engine, config, ids, i, "draft")  # module path, for the trunk hidden below
    nb = -(-(T + DEPTH) // BLOCK)
    tables = np.zeros((1, nb + 1), dtype=np.int32)
    tables[0, :nb] = np.arange(nb)
    from hybridserve.memory.layout import arena_layout
    sp = arena_layout(config, BLOCK, "float32").state_pages
    cache = engine.new_cache(nb + sp + 1, BLOCK)
    slots = [int(tables[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    trunk = ForwardBatch.from_lists(input_ids=ids[:n].tolist(), positions=list(range(n)), slot_mapping=slots,
                                    query_start_loc=[0, n], seq_lens=[n], block_tables=[tables[0].tolist()],
                                    state_pages=[list(range(nb, nb + sp))], has_initial_state=[False],
                                    logits_indices=[n - 1])
    engine.native_decode = True
    try:
        with torch.no_grad():
            _, hidden = engine(trunk, cache, return_hidden=True)
        fast = engine._usable_native_step()
        assert fast is not None
        got = fast.mtp_draft(hidden, ids[1:n + 1].numpy().astype(np.int64), np.arange(n), np.asarray(slots),
                             np.repeat(tables, n, axis=0), np.asarray([n - 1]), DEPTH, cache)
    finally:
        engine.native_decode = False
    assert got is not None
    assert got[:, 0].tolist() == [int(train[d][i].argmax()) for d in range(DEPTH)]


def test_pass_one_is_the_layers_forward(setup):
    """Pass 1 of the chain is MTP.forward (what --depth 1 trains) over the same rows, with
    the MTP loaded as `train mtp` loads it (export.load_trained): a causal layer (it was
    not: a config from AutoConfig left HF without a causal mask)."""
    from hybridserve.train.mtp import mtp_chain

    _, _, _, hf, mtp, ids = setup
    with torch.no_grad():
        h = hf.model(input_ids=ids[None]).last_hidden_state
        emb = hf.model.embed_tokens(ids[None])
        pos = torch.arange(T - 1)[None]
        want = mtp(h[:, :T - 1], emb[:, 1:], hf.model.rotary_emb(h[:, :T - 1], pos), pos)
        got = mtp_chain(mtp, h, emb, hf.model.rotary_emb, 2)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_depth_is_validated(setup):
    from hybridserve.train.mtp import mtp_chain

    _, _, _, hf, mtp, ids = setup
    h = torch.zeros(1, 3, hf.config.hidden_size)
    with pytest.raises(ValueError, match="depth must be at least 1"):
        mtp_chain(mtp, h, h, hf.model.rotary_emb, 0)
    with pytest.raises(ValueError, match="needs more than 3 positions"):
        mtp_chain(mtp, h, h, hf.model.rotary_emb, 3)
