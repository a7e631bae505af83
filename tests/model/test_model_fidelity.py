"""Qwen3_5ForServing against HF Qwen3_5ForCausalLM on the same tiny checkpoints.

Every logits row our model produces is compared (1e-4 relative, float32) with HF's
logits at the same position of the same token sequence, run whole and without a cache;
greedy tokens must be identical.
"""

import random

import pytest
import torch

from hybridserve.kernels import native

PRESETS = ["test-a", "test-b"]


@pytest.fixture(autouse=True, params=["native", "pytorch"])
def cpu_path(request, monkeypatch):
    """Every fidelity test runs twice: with the native CPU kernels (the default for
    float32 on the CPU) and with them off, so the PyTorch CPU path stays checked
    against HF too (it serves other dtypes, and HYBRIDSERVE_NO_NATIVE=1)."""
    if request.param == "pytorch":
        monkeypatch.setattr(native, "_DISABLED", True)
    else:
        assert native.available(), "the extension was built without hybridserve._core.kernels"
    return request.param


def _prompt(rng, n, vocab=259):
    return [rng.randrange(vocab) for _ in range(n)]


def _greedy_append(wanted, logits, only=None):
    for (seq, _), row in zip(wanted, logits):
        if only is None or seq in only:
            seq.tokens.append(int(row.argmax()))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_batch_of_four_decoded_together(preset, block_size, our_models, hf_models, make_book,
                                        new_cache, recorder):
    model, config = our_models[preset]
    rec = recorder(hf_models[preset])
    rng = random.Random(block_size)
    cache = new_cache(config, block_size)
    book = make_book(cache, seed=block_size)
    seqs = [book.new_seq(_prompt(rng, n)) for n in (3, 17, 33, 9)]
    batch, wanted = book.step([(s, len(s.tokens)) for s in seqs])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    for _ in range(5):
        batch, wanted = book.step([(s, 1) for s in seqs])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    rec.check(min_rows=24)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_at_awkward_sizes_mixed_with_decodes(preset, block_size, our_models, hf_models, make_book,
                                                             new_cache, recorder):
    model, config = our_models[preset]
    rec = recorder(hf_models[preset])
    rng = random.Random(1)
    cache = new_cache(config, block_size)
    book = make_book(cache, seed=3)
    running = [book.new_seq(_prompt(rng, n)) for n in (5, 20)]
    batch, wanted = book.step([(s, len(s.tokens)) for s in running])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    # A 60-token prompt in chunks of 7 and 13 (not multiples of the block size nor of
    # each other); its chunk ends are checked mid-prompt too, the decodes every step.
    long = book.new_seq(_prompt(rng, 60))
    chunks = [7, 13, 7, 13, 7, 13]
    assert sum(chunks) == 60
    for n in chunks:
        batch, wanted = book.step([(running[0], 1), (long, n), (running[1], 1)], extra_logit_rows=[long])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits, only=running + ([long] if long.computed == 60 else []))
    for _ in range(2):
        batch, wanted = book.step([(s, 1) for s in (long, *running)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    rec.check(min_rows=2 + 6 * 3 + 6)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_n2_fork_after_prefill_shares_prompt_blocks(preset, block_size, our_models, hf_models, make_book, new_cache,
                                                    recorder):
    model, config = our_models[preset]
    rec = recorder(hf_models[preset])
    cache = new_cache(config, block_size)
    book = make_book(cache, seed=5)
    n = block_size + 5
    parent = book.new_seq(_prompt(random.Random(2), n))  # one full block + a partial tail
    batch, wanted = book.step([(parent, n)])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    child, page_pairs = book.fork(parent)
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    cache.copy_pages(torch.tensor(page_pairs))  # tail block copy-on-write + state pages, one copy
    # The two samples take different first tokens (best and second best) so that any
    # state leaking between them would show.
    top2 = logits[0].topk(2).indices.tolist()
    parent.tokens.append(top2[0])
    child.tokens.append(top2[1])
    for _ in range(4):
        batch, wanted = book.step([(child, 1), (parent, 1)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    rec.check(min_rows=9)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_preempted_sequence_recomputes_to_the_same_logits(preset, block_size, our_models, hf_models, make_book,
                                                          new_cache, recorder):
    model, config = our_models[preset]
    rec = recorder(hf_models[preset])
    rng = random.Random(4)
    # Tight: 3 states' pages + a few blocks, so the newcomer reuses the victim's pages.
    cache = new_cache(config, block_size, num_pages=3 * 3 + 8)
    book = make_book(cache, seed=9)
    victim = book.new_seq(_prompt(rng, 18))
    other = book.new_seq(_prompt(rng, 6))
    batch, wanted = book.step([(victim, 18), (other, 6)])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    for _ in range(2):
        batch, wanted = book.step([(victim, 1), (other, 1)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    # Preempt: the victim's blocks and slot go back and are overwritten by a newcomer.
    book.free(victim)
    newcomer = book.new_seq(_prompt(rng, 40))
    batch, wanted = book.step([(newcomer, 40), (other, 1)])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    # Recompute: prompt + generated tokens prefilled again from an empty state.
    book.free(newcomer)
    book.recompute(victim)
    batch, wanted = book.step([(other, 1), (victim, len(victim.tokens))])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    for _ in range(2):
        batch, wanted = book.step([(victim, 1), (other, 1)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    rec.check(min_rows=14)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_checkpoint_inside_a_chunk_serves_a_prefix_hit(preset, block_size, our_models, hf_models, make_book,
                                                      new_cache, recorder):
    """A chunk that runs past the prompt's last full block writes the state at that
    block boundary into checkpoint pages (no split chunk); a second sequence sharing the
    prefix restores it (one page copy into its own state pages), shares the prefix
    blocks, and continues: every logit matches HF on its whole token sequence."""
    model, config = our_models[preset]
    rec = recorder(hf_models[preset])
    cache = new_cache(config, block_size)
    book = make_book(cache, seed=13)
    rng = random.Random(block_size + 1)
    k = 2 * block_size
    prefix = _prompt(rng, k)
    a = book.new_seq(prefix + _prompt(rng, 9))
    other = book.new_seq(_prompt(rng, 5))
    ckpt = book.alloc_state()
    # First chunk of 7 tokens, then one chunk to the prompt's end with the checkpoint
    # inside it (at the second block boundary), mixed with another sequence's prefill.
    batch, wanted = book.step([(a, 7)], extra_logit_rows=[a])
    rec.add(wanted, model(batch, cache))
    a.checkpoint = (k - 7, ckpt)
    batch, wanted = book.step([(other, 5), (a, len(a.tokens) - 7)])
    assert batch.checkpoint_positions.tolist() == [-1, k - 7]
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    for _ in range(2):
        batch, wanted = book.step([(a, 1), (other, 1)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    # The prefix hit: shared blocks, state restored from the checkpoint.
    b = book.new_seq(prefix + _prompt(rng, 4))
    b.blocks = list(a.blocks[:2])
    for blk in b.blocks:
        book.refs[blk] += 1
    b.computed = k
    cache.copy_pages(torch.tensor(list(zip(ckpt, b.state))))
    batch, wanted = book.step([(a, 1), (b, 4)])
    logits = model(batch, cache)
    rec.add(wanted, logits)
    _greedy_append(wanted, logits)
    for _ in range(2):
        batch, wanted = book.step([(b, 1), (a, 1)])
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
    rec.check(min_rows=1 + 2 + 4 + 2 + 4)


def test_hf_cached_generation_matches_our_greedy_decode(our_models, hf_models, tiny_dirs, make_book,
                                                        new_cache):
    """HF's own cached step-by-step generate() as a second oracle for decode."""
    model, config = our_models["test-a"]
    hf = hf_models["test-a"]
    prompt = _prompt(random.Random(11), 13)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                          pad_token_id=0)
    cache = new_cache(config, 16)
    book = make_book(cache, seed=1)
    seq = book.new_seq(prompt)
    batch, _ = book.step([(seq, 13)])
    ours = [model(batch, cache)[0]]
    for _ in range(7):
        seq.tokens.append(int(ours[-1].argmax()))
        batch, _ = book.step([(seq, 1)])
        ours.append(model(batch, cache)[0])
    seq.tokens.append(int(ours[-1].argmax()))
    assert seq.tokens == out.sequences[0].tolist()
    for mine, ref in zip(ours, out.logits):
        torch.testing.assert_close(mine, ref[0].float(), rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_bench_preset_prefill_and_decode(tmp_path, make_book, recorder):
    """The ~10M-parameter preset that benchmarks and ``serve``'s default use."""
    import transformers

    from hybridserve.model import load_model
    from hybridserve.model.tiny import write_tiny_checkpoint

    d = write_tiny_checkpoint(tmp_path / "bench", preset="bench", seed=0)
    model, config = load_model(d, progress=False)
    assert 9_000_000 < sum(p.numel() for p in model.parameters()) < 11_000_000
    rec = recorder(transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
    cache = model.new_cache(64, 16)
    book = make_book(cache, seed=2)
    rng = random.Random(6)
    seqs = [book.new_seq(_prompt(rng, n)) for n in (24, 7)]
    batch, wanted = book.step([(s, len(s.tokens)) for s in seqs])
    for _ in range(3):
        logits = model(batch, cache)
        rec.add(wanted, logits)
        _greedy_append(wanted, logits)
        batch, wanted = book.step([(s, 1) for s in seqs])
    rec.check(min_rows=6)


def test_unsupported_shapes_are_config_errors():
    from hybridserve.config import ModelConfig
    from hybridserve.errors import ConfigError
    from hybridserve.model import Qwen3_5ForServing
    from hybridserve.model.tiny import text_config

    for bad, match in (({"num_key_value_heads": 3}, "multiple"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"linear_num_key_heads": 3, "linear_num_value_heads": 4}, "multiple")):
        with pytest.raises(ConfigError, match=match):
            Qwen3_5ForServing(ModelConfig.from_dict(text_config("test-a", **bad)), device="meta")
