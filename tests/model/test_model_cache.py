"""HybridCache layouts and copy operations against brute-force per-element copies;
ForwardBatch validation."""

import pytest
import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.model import ForwardBatch, HybridCache
from hybridserve.model.tiny import text_config


@pytest.fixture
def config():
    return ModelConfig.from_dict(text_config("test-b"))


def _fill_random(cache, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k_caches, *cache.v_caches, *cache.conv_states, *cache.recurrent_states):
        t.copy_(torch.randn(t.shape, generator=gen))


def test_layouts_and_sizes(config):
    cache = HybridCache(config, num_blocks=5, block_size=4, num_state_slots=3, dtype="bfloat16")
    assert len(cache.k_caches) == len(cache.v_caches) == 2  # layers 1 and 4
    assert len(cache.conv_states) == len(cache.recurrent_states) == 4
    assert cache.k_caches[0].shape == (5, 4, 1, 16) and cache.k_caches[0].dtype == torch.bfloat16
    assert cache.conv_states[0].shape == (3, 2 * 3 * 8 + 3 * 12, 2)
    assert cache.recurrent_states[0].shape == (3, 3, 8, 12)
    assert cache.recurrent_states[0].dtype == torch.float32
    assert cache.kv(4)[0] is cache.k_caches[1]
    assert cache.state(5)[1] is cache.recurrent_states[3]
    per_block = sum(t[0].numel() * t.element_size() for t in (*cache.k_caches, *cache.v_caches))
    per_slot = sum(t[0].numel() * t.element_size() for t in (*cache.conv_states, *cache.recurrent_states))
    assert HybridCache.bytes_per_block(config, 4, torch.bfloat16) == per_block
    assert HybridCache.bytes_per_state_slot(config, "bfloat16") == per_slot
    assert cache.memory_bytes() == 5 * per_block + 3 * per_slot
    with pytest.raises(ConfigError):
        HybridCache(config, num_blocks=0, block_size=4, num_state_slots=1)


def test_copy_blocks_reads_all_sources_before_writing(config):
    cache = HybridCache(config, num_blocks=6, block_size=4, num_state_slots=2)
    _fill_random(cache)
    before = [t.clone() for t in (*cache.k_caches, *cache.v_caches)]
    pairs = [(0, 1), (1, 0), (2, 5), (2, 4)]  # a swap and a one-to-many copy
    cache.copy_blocks(torch.tensor(pairs))
    for old, new in zip(before, (*cache.k_caches, *cache.v_caches)):
        expect = old.clone()
        for s, d in pairs:
            expect[d] = old[s]
        assert torch.equal(new, expect)
    states = [t.clone() for t in (*cache.conv_states, *cache.recurrent_states)]
    assert all(torch.equal(a, b) for a, b in zip(states, (*cache.conv_states, *cache.recurrent_states)))
    with pytest.raises(ValueError, match="0..5"):
        cache.copy_blocks(torch.tensor([[0, 6]]))
    cache.copy_blocks(torch.zeros(0, 2, dtype=torch.long))  # nothing to do is fine


def test_copy_and_zero_state_slots(config):
    cache = HybridCache(config, num_blocks=2, block_size=4, num_state_slots=4)
    _fill_random(cache, seed=1)
    before = [t.clone() for t in (*cache.conv_states, *cache.recurrent_states)]
    kv_before = [t.clone() for t in cache.k_caches]
    cache.copy_state_slots(torch.tensor([[3, 0], [3, 1]]))
    for old, new in zip(before, (*cache.conv_states, *cache.recurrent_states)):
        assert torch.equal(new[0], old[3]) and torch.equal(new[1], old[3])
        assert torch.equal(new[2:], old[2:])
    assert all(torch.equal(a, b) for a, b in zip(kv_before, cache.k_caches))
    cache.zero_state_slots([1])
    for t in (*cache.conv_states, *cache.recurrent_states):
        assert not t[1].any() and t[3].any()
    with pytest.raises(ValueError, match="0..3"):
        cache.copy_state_slots([[4, 0]])


def _batch(**kw):
    args = dict(input_ids=[1, 2, 3], positions=[0, 1, 5], slot_mapping=[0, 1, 9],
                query_start_loc=[0, 2, 3], seq_lens=[2, 6], block_tables=[[0], [1, 2]],
                state_slots=[0, 1], has_initial_state=[False, True], logits_indices=[1, 2])
    args.update(kw)
    return ForwardBatch.from_lists(**args)


def test_forward_batch_from_lists_and_validation():
    b = _batch()
    b.validate()
    assert b.block_tables.tolist() == [[0, 0], [1, 2]] and b.block_tables.dtype == torch.int32
    assert b.input_ids.dtype == torch.int64 and b.query_start_loc.dtype == torch.int32
    assert b.has_initial_state.dtype == torch.bool and (b.num_tokens, b.num_seqs) == (3, 2)
    with pytest.raises(ValueError, match="positions"):
        _batch(positions=[0, 1]).validate()
    with pytest.raises(ValueError, match="query_start_loc"):
        _batch(query_start_loc=[0, 3, 2]).validate()
    with pytest.raises(ValueError, match="seq_lens"):
        _batch(seq_lens=[1, 6]).validate()
    with pytest.raises(ValueError, match="logits_indices"):
        _batch(logits_indices=[3]).validate()
