"""The native decode step (hybridserve.model.native_decode) against the module path.

The module path is the oracle here (it is checked against HF transformers in
test_model_fidelity.py / test_model_bf16.py, whose decode steps now run through the
native step too): the same decode batch from the same cache state must give
bit-identical logits and leave a bit-identical arena (KV, conv and recurrent state,
checkpoints), in float32 and bfloat16, at one and several sequences, with a
checkpoint request and with logits for only some rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridserve.kernels import native
from hybridserve.model import load_model
from hybridserve.model.hugepages import transposed_copy
from hybridserve.model.native_decode import NativeDecodeStep

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built")


@pytest.fixture
def runs(monkeypatch):
    """Counts the steps the native decode path ran (returned logits for)."""
    seen = {"native": 0}
    real = NativeDecodeStep.run

    def run(self, batch, cache):
        out = real(self, batch, cache)
        seen["native"] += out is not None
        return out

    monkeypatch.setattr(NativeDecodeStep, "run", run)
    return seen


def _both_paths(model, cache, batch):
    """(module-path logits, arena after), (native logits, arena after), from one state."""
    before = cache.arena.clone()
    model.native_decode = False
    try:
        want = model(batch, cache)
    finally:
        model.native_decode = True
    want_arena = cache.arena.clone()
    cache.arena.copy_(before)
    got = model(batch, cache)
    return (want, want_arena), (got, cache.arena.clone())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_decode_steps_equal_the_module_path_bit_for_bit(preset, dtype, tiny_dirs, make_book, runs):
    _decode_steps_equal(tiny_dirs[preset], dtype, make_book, runs)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from hybridserve.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-moe-native")
    return {p: write_tiny_checkpoint(root / p, preset=p, seed=7) for p in ("moe-a", "moe-b")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["moe-a", "moe-b"])
def test_moe_decode_steps_equal_the_module_path_bit_for_bit(preset, dtype, moe_dirs, make_book, runs):
    """An MoE model takes the native step too (its sparse blocks as their module, the
    routed experts' native call): bit-identical to the module path, top-3 of 7 experts
    and top-1 of 5, each with a shared expert."""
    _decode_steps_equal(moe_dirs[preset], dtype, make_book, runs)


def _decode_steps_equal(path, dtype, make_book, runs):
    model, config = load_model(path, dtype=dtype, progress=False)
    assert NativeDecodeStep.applies_to(model)
    cache = model.new_cache(96, 16)
    book = make_book(cache, seed=1)
    rng = random.Random(5)
    seqs = [book.new_seq([rng.randrange(259) for _ in range(n)]) for n in (9, 17, 3)]
    batch, _ = book.step([(s, len(s.tokens)) for s in seqs])  # prefill: the module path
    model(batch, cache)
    assert runs["native"] == 0
    steps = 0
    for i in range(6):
        live = seqs if i != 2 else seqs[1:2]  # one sequence alone too
        for s in live:
            s.tokens.append(rng.randrange(259))
        if i == 3:  # a checkpoint of the state after this token
            seqs[0].checkpoint = (1, book.alloc_state())
        if i == 4:  # a sequence one token behind: it decodes but does not sample
            seqs[2].tokens.append(rng.randrange(259))
        batch, _ = book.step([(s, 1) for s in live])
        if i == 4:
            assert batch.logits_indices.tolist() == [0, 1]
        (want, want_arena), (got, got_arena) = _both_paths(model, cache, batch)
        steps += 1
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), f"step {i}: logits differ by {(got - want).abs().max().item()}"
        assert torch.equal(got_arena, want_arena), f"step {i}: the cache state differs"
    assert runs["native"] == steps


def test_prefill_and_re_laid_out_weights_take_the_module_path(tiny_dirs, make_book, runs):
    model, _ = load_model(tiny_dirs["test-a"], dtype="float32", progress=False)
    cache = model.new_cache(64, 16)
    book = make_book(cache, seed=2)
    seq = book.new_seq([5, 7, 11, 13])
    batch, _ = book.step([(seq, 4)])
    model(batch, cache)
    seq.tokens.append(17)
    batch, _ = book.step([(seq, 1)])
    model(batch, cache)
    assert runs["native"] == 1
    # A projection stored transposed (the column-major layout): the native step's views
    # are stale and its GEMM would not read it; the model notices and steps the module way.
    mlp = model.layers[0].mlp.down_proj
    mlp.weight.data = transposed_copy(mlp.weight.data)
    seq.tokens.append(19)
    batch, _ = book.step([(seq, 1)])
    (want, _), (got, _) = _both_paths(model, cache, batch)
    assert runs["native"] == 1
    assert torch.equal(got, want)


def test_a_forward_hook_sends_decode_steps_to_the_module_path(tiny_dirs, make_book, runs):
    """Tensor parallelism sums each mixer's and MLP's output in forward hooks; the native
    step would skip them, so a hooked model decodes through its modules (hook included)."""
    model, _ = load_model(tiny_dirs["test-b"], dtype="bfloat16", progress=False)
    cache = model.new_cache(64, 16)
    book = make_book(cache, seed=3)
    seq = book.new_seq([3, 1, 4, 1, 5])
    model(book.step([(seq, 5)])[0], cache)
    seq.tokens.append(9)
    batch, _ = book.step([(seq, 1)])
    before = cache.arena.clone()
    plain = model(batch, cache)
    assert runs["native"] == 1
    handle = model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    try:
        cache.arena.copy_(before)
        hooked = model(batch, cache)
    finally:
        handle.remove()
    assert runs["native"] == 1
    assert not torch.equal(hooked, plain)  # the hook ran
    cache.arena.copy_(before)
    assert torch.equal(model(batch, cache), plain) and runs["native"] == 2  # and without it, native again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rope_table_rows_are_cos_sin_of_each_position(tiny_dirs, dtype):
    """The native step looks rope's cos/sin rows up in a table it grows on demand; each
    row must be the bits ``RotaryEmbedding.cos_sin`` gives that position in any batch
    (the module path computes them per step)."""
    model, _ = load_model(tiny_dirs["test-a"], dtype=dtype, progress=False)
    step = NativeDecodeStep(model)
    rng = random.Random(2)
    # Small positions first, then past the first table (it grows), then a batch mixing both.
    for positions in ([0], [3, 1, 2, 7], [rng.randrange(5000) for _ in range(9)], [4999, 0, 1500, 1024, 1023]):
        p = torch.tensor(positions, dtype=torch.int64)
        cos, sin = model.rotary.cos_sin(p, model.dtype)
        got_cos, got_sin = step._cos_sin(p.numpy())
        bits = torch.uint16 if dtype == "bfloat16" else torch.float32
        assert np.array_equal(got_cos, cos.view(bits).numpy()) and np.array_equal(got_sin, sin.view(bits).numpy())


def test_the_draft_argmax_is_torchs_first_maximum_on_bfloat16(tiny_dirs):
    """Drafts take numpy's argmax of the bfloat16 logits widened to float32: the same
    first maximum as torch's argmax, with ties and NaN (first NaN) included."""
    model, _ = load_model(tiny_dirs["test-a"], dtype="bfloat16", progress=False)
    step = NativeDecodeStep(model)
    torch.manual_seed(0)
    h = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    vocab = model.lm_head.weight.shape[0]
    got = step._draft_argmax(h.view(torch.uint16).numpy(), 3, None)
    # The logits the call computed (its buffer), through torch's argmax.
    want = torch.from_numpy(step._widen[(3, vocab)][0].copy()).view(torch.bfloat16).argmax(dim=-1)
    assert torch.equal(got, want)
    # Ties, negatives, -0.0 / +0.0 and NaN through the same widening.
    x = torch.tensor([[-1.0, -0.0, 0.0, -0.0], [2.0, 5.0, 5.0, 1.0], [-3.0, float("nan"), 7.0, float("nan")],
                      [-5.0, -2.0, -2.0, -9.0]], dtype=torch.bfloat16)
    w = (x.view(torch.uint16).numpy().astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(np.argmax(w, axis=-1), x.argmax(dim=-1).numpy())
