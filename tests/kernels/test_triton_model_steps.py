"""The model through ``ops`` with the Triton kernels equals the model on the references.

``ops`` sends only CUDA tensors to Triton; here its dispatch test is forced true so the
kernels run on the CPU under the interpreter, with the exact tensors the model passes
(views of fused projections, the conv weight as ``[C, 1, W][:, 0, :]``, bool
``has_initial_state``, int32 state page tables, block tables padded with 0). The oracle is the
same model with the plain-PyTorch references. Three steps mix new prefills, a
chunked-prefill continuation and decodes (so both the decode and the prefill variants
of the DeltaNet kernels run), over shuffled blocks and state pages interleaved in one
arena, with checkpoints written inside a prefill chunk and at a decode token, for
both tiny presets (test-a: GQA 2, grouped DeltaNet heads, conv 4; test-b:
GQA 6, head dim 16, k/v dims 8/12, conv 3).

Tolerance: logits ``atol = rtol = 1e-4`` (float32; per-op differences ~1e-6 compound
over the layers), caches ``1e-5``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.config import ModelConfig
from hybridserve.kernels import ops
from hybridserve.model import ForwardBatch, Qwen3_5ForServing
from hybridserve.model.tiny import random_state_dict, text_config

BLOCK_SIZE = 16
# Per step: (sequence, number of new tokens). A, B start in step 0; C in step 1.
SCHEDULE = [
    [("A", 40), ("B", 5)],  # >= 16 tokens per sequence: chunked delta rule, token-parallel conv
    [("A", 1), ("B", 7), ("C", 3)],
    [("A", 1), ("B", 1), ("C", 1)],
]
BLOCKS = {"A": [9, 2, 11], "B": [4], "C": [7]}  # shuffled, non-contiguous
# State pages (and checkpoint pages) interleaved with the blocks in the same arena.
STATE = {"A": [3, 14, 0, 19], "B": [13, 5, 16, 22], "C": [1, 18, 8, 23]}
# (step, sequence) -> (checkpoint position, its pages): inside B's 7-token chunk, at C's decode.
CKPTS = {(1, "B"): (3, [20, 6, 21, 10]), (2, "C"): (1, [12, 15, 17, 24])}
NUM_PAGES = 26


def _batch(i, step, done, tokens, state_pages):
    ids, pos, slot_map, qsl, lens, tables, slots, init, last = [], [], [], [0], [], [], [], [], []
    ck_pos, ck_pages = [], []
    for name, n in step:
        start = done[name]
        for p in range(start, start + n):
            ids.append(tokens[name][p])
            pos.append(p)
            slot_map.append(BLOCKS[name][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        tables.append(BLOCKS[name])
        slots.append(STATE[name][:state_pages])
        ck, pages = CKPTS.get((i, name), (-1, [-1] * 4))
        ck_pos.append(ck)
        ck_pages.append(pages[:state_pages])
        init.append(start > 0)
        last.append(qsl[-1] - 1)
        done[name] = start + n
    return ForwardBatch.from_lists(
        input_ids=ids, positions=pos, slot_mapping=slot_map, query_start_loc=qsl, seq_lens=lens,
        block_tables=tables, state_pages=slots, has_initial_state=init, logits_indices=last,
        checkpoint_positions=ck_pos, checkpoint_pages=ck_pages,
    )


def _run(model, use_triton, monkeypatch):
    monkeypatch.setattr(ops, "_use_triton", lambda t: use_triton)
    cache = model.new_cache(num_pages=NUM_PAGES, block_size=BLOCK_SIZE)
    assert cache.state_pages <= 4
    gen = torch.Generator().manual_seed(0)
    tokens = {name: torch.randint(0, model.config.vocab_size, (48,), generator=gen).tolist() for name in BLOCKS}
    done = dict.fromkeys(BLOCKS, 0)
    logits = [model(_batch(i, step, done, tokens, cache.state_pages), cache) for i, step in enumerate(SCHEDULE)]
    return logits, cache


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_model_steps_with_triton_kernels_match_reference_path(preset, monkeypatch):
    config = ModelConfig.from_dict(text_config(preset))
    model = Qwen3_5ForServing(config)
    result = model.load_state_dict(random_state_dict(config, seed=3), strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # tied head only
    model.tie_weights()

    want, want_cache = _run(model, False, monkeypatch)
    got, got_cache = _run(model, True, monkeypatch)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    for g, w in zip(got_cache.k_caches + got_cache.v_caches, want_cache.k_caches + want_cache.v_caches):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # The DeltaNet state, per page: the sequences' pages and both checkpoints' pages.
    n = got_cache.state_pages
    for page in [p for pages in [*STATE.values(), *(pg for _, pg in CKPTS.values())] for p in pages[:n]]:
        torch.testing.assert_close(got_cache.recurrent_pool[page], want_cache.recurrent_pool[page], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_cache.conv_pool[page], want_cache.conv_pool[page], atol=1e-5, rtol=1e-5)
