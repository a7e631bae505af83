"""The device side of the per-step path against the CPU path as the oracle."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.sampler import Sampler, SamplingRow, counter_uniform, make_generator
from hybridserve.sampling import SamplingParams


def test_counter_uniform_is_bit_identical_on_the_device(device):
    # int64 products must wrap the same way on the device as on the CPU.
    keys = torch.tensor([0, 1, -1, 1 << 62, -(1 << 63), 123456789])
    offs = torch.tensor([0, 3, 7, 1 << 40, 5, 2])
    cpu = counter_uniform(keys, offs, 1000)
    dev = counter_uniform(keys.to(device), offs.to(device), 1000).cpu()
    assert torch.equal(cpu, dev)


def test_sampler_on_the_device_matches_the_cpu(device):
    rng = random.Random(0)
    vocab = 1000
    rows_spec = []
    for i in range(24):
        p = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]), presence_penalty=rng.choice([0.0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]), seed=i, logit_bias={i: 2.0} if i % 4 == 0 else None,
            logprobs=2 if i % 5 == 0 else None)
        rows_spec.append((p, [rng.randrange(vocab) for _ in range(5)], [rng.randrange(vocab) for _ in range(3)]))
    logits = torch.randn(len(rows_spec), vocab) * 3
    outs = {}
    processed = {}
    for dev in (torch.device("cpu"), device):
        rows = [SamplingRow(p, pr, o, make_generator(p.seed, 0), key=i) for i, (p, pr, o) in enumerate(rows_spec)]
        s = Sampler()
        processed[dev.type] = s.process(logits.to(dev), rows).cpu()
        outs[dev.type] = s(logits.to(dev), rows)
    a, b = processed["cpu"], processed[device.type]
    # A token exactly at a top-p/min-p boundary may fall either side with float
    # rounding; anything beyond a couple of such tokens is a real difference.
    assert int((torch.isinf(a) != torch.isinf(b)).sum()) <= 2
    fin = torch.isfinite(a) & torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-5, atol=1e-5)
    same = sum(x == y for x, y in zip(outs["cpu"].token_ids, outs[device.type].token_ids))
    # Same noise, same probabilities up to float rounding: only near-ties may differ.
    assert same >= len(rows_spec) - 1


def _prefill(model, cache, prompts, device, block_size):
    """Prefill sequences i -> blocks [i*8, i*8+8), state slot i; return (lens, tables)."""
    ids, pos, slots, qsl, lens, tables = [], [], [], [0], [], []
    for i, p in enumerate(prompts):
        ids += p
        pos += list(range(len(p)))
        slots += [i * 8 * block_size + t for t in range(len(p))]
        qsl.append(qsl[-1] + len(p))
        lens.append(len(p))
        tables.append(list(range(i * 8, i * 8 + 8)))
    batch = ForwardBatch.from_lists(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl,
                                    seq_lens=lens, block_tables=tables, state_slots=list(range(len(prompts))),
                                    has_initial_state=[False] * len(prompts), logits_indices=[q - 1 for q in qsl[1:]],
                                    device=device)
    model(batch, cache)
    return lens, tables


@pytest.mark.parametrize("n", [1, 3, 5])
def test_decode_graph_replay_equals_eager_and_padding_writes_nothing(cuda_device, tiny_dir, n):
    from hybridserve.model.loader import load_model
    from hybridserve.runner.cuda_graphs import DecodeGraphs

    device = cuda_device
    bs = 16
    model, config = load_model(tiny_dir, dtype="float32", device=device, progress=False)
    num_slots = 8
    cache = model.new_cache(64, bs, num_slots + 1)  # the last slot is the graphs' scratch
    rng = random.Random(n)
    prompts = [[rng.randrange(259) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    lens, tables = _prefill(model, cache, prompts, device, bs)
    graphs = DecodeGraphs(model, cache, max_num_seqs=8, max_blocks_per_seq=8, scratch_slot=num_slots)
    graphs.capture()

    def snapshot():
        return [t[:-1].clone() for t in (*cache.conv_states, *cache.recurrent_states)] + \
               [t.clone() for t in (*cache.k_caches, *cache.v_caches)]

    def restore(snap):
        pools = [*cache.conv_states, *cache.recurrent_states]
        for t, s in zip(pools, snap[: len(pools)]):
            t[:-1].copy_(s)
        for t, s in zip((*cache.k_caches, *cache.v_caches), snap[len(pools):]):
            t.copy_(s)

    before = snapshot()
    toks = [rng.randrange(259) for _ in range(n)]
    batch = ForwardBatch.from_lists(
        input_ids=toks, positions=lens, slot_mapping=[i * 8 * bs + lens[i] for i in range(n)],
        query_start_loc=list(range(n + 1)), seq_lens=[x + 1 for x in lens], block_tables=tables,
        state_slots=list(range(n)), has_initial_state=[True] * n, logits_indices=list(range(n)), device=device)
    eager = model(batch, cache).clone()
    after_eager = snapshot()
    restore(before)
    table_buf = torch.zeros(8, 8, dtype=torch.int32, device=device)
    table_buf[:n] = torch.tensor(tables, dtype=torch.int32)
    got = graphs.run(batch, table_buf, torch.arange(n, device=device)).clone()
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(snapshot(), after_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # no write outside the real rows


def test_copies_and_staging_do_not_synchronise(cuda_device, tiny_dir):
    from hybridserve.model.loader import load_model
    from hybridserve.staging import StagingBuffer

    model, _ = load_model(tiny_dir, dtype="float32", device=cuda_device, progress=False)
    cache = model.new_cache(16, 16, 4)
    buf = StagingBuffer(cuda_device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            blocks, slots = buf.stage([[0, 5, 1, 6], [0, 2]])
            cache.copy_blocks(blocks.view(-1, 2))
            cache.copy_state_slots(slots.view(-1, 2))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(cache.k_caches[0][5], cache.k_caches[0][0])
