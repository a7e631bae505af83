"""HybridCache's arena: every view lands on the bytes the layout says (checked against
hand-computed byte offsets), views of different kinds never overlap, copy_pages against
a brute-force byte copy; ForwardBatch validation."""

import pytest
import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.model import ForwardBatch, HybridCache
from hybridserve.memory.layout import arena_layout
from hybridserve.model.tiny import text_config


@pytest.fixture
def config():
    return ModelConfig.from_dict(text_config("test-b"))


def _layout(config, block_size=4, dtype="bfloat16"):
    return arena_layout(config, block_size, dtype)


def _bytes_of(view: torch.Tensor, arena: torch.Tensor) -> set[int]:
    """The arena byte offsets a view covers (brute force, element by element)."""
    el = view.element_size()
    base = (view.data_ptr() - arena.data_ptr())
    out = set()
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in view.shape]).reshape(-1, view.dim()).tolist():
        off = base + sum(i * st for i, st in zip(idx, view.stride())) * el
        out.update(range(off, off + el))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_views_land_where_the_layout_says(config, dtype):
    lay = _layout(config, 4, dtype)
    cache = HybridCache(config, lay, 5, dtype=dtype)
    el = torch.empty((), dtype=cache.dtype).element_size()
    assert cache.memory_bytes() == 5 * lay.page_bytes and cache.arena.dtype == torch.uint8
    assert len(cache.k_caches) == len(cache.v_caches) == 2  # layers 1 and 4
    assert cache.k_caches[0].shape == (5, 4, 1, 16) and cache.k_caches[0].dtype == cache.dtype
    assert cache.recurrent_pool.dtype == torch.float32 and cache.conv_pool.dtype == cache.dtype
    assert cache.kv(4)[0] is cache.k_caches[1]
    blk = 4 * 1 * 16 * el  # K (or V) of one block of one layer
    # Page p, attention layer a: bytes [a * L, (a + 1) * L) of the page, K then V.
    for a in range(2):
        k, v = cache.k_caches[a], cache.v_caches[a]
        for p in (0, 3):
            start = p * lay.page_bytes + a * lay.kv_layer_block_bytes
            assert _bytes_of(k[p], cache.arena) == set(range(start, start + blk))
            assert _bytes_of(v[p], cache.arena) == set(range(start + blk, start + 2 * blk))
    # DeltaNet layer l (model layer 5 is ordinal 3), head h: through layout.recurrent_item.
    st = cache.state(5)
    assert st.recurrent_item_base == 3 * config.linear_num_value_heads
    for h in range(config.linear_num_value_heads):
        col, off = lay.recurrent_item(3, h)
        i = st.recurrent_item_base + h
        assert (i // lay.recurrent_per_page, (i % lay.recurrent_per_page) * lay.recurrent_item_bytes) == (col, off)
        page = 2  # as if the state page table row mapped column col to page 2
        item = cache.recurrent_pool[page, i % lay.recurrent_per_page]
        start = page * lay.page_bytes + off
        assert _bytes_of(item, cache.arena) == set(range(start, start + lay.recurrent_item_bytes))
    col, off = lay.conv_item(3)
    i = st.conv_item_base
    assert i // lay.conv_per_page == col
    item = cache.conv_pool[1, i % lay.conv_per_page]
    assert _bytes_of(item, cache.arena) == set(range(lay.page_bytes + off, lay.page_bytes + off + lay.conv_item_bytes))


def test_kv_views_of_one_page_never_overlap(config):
    lay = _layout(config, 4, "float32")
    cache = HybridCache(config, lay, 3, dtype="float32")
    seen: set[int] = set()
    for t in (*cache.k_caches, *cache.v_caches):
        got = _bytes_of(t[1], cache.arena)
        assert not got & seen and all(lay.page_bytes <= b < 2 * lay.page_bytes for b in got)
        seen |= got


def test_copy_pages_reads_all_sources_before_writing(config):
    lay = _layout(config, 4, "float32")
    cache = HybridCache(config, lay, 6, dtype="float32")
    gen = torch.Generator().manual_seed(0)
    cache.arena.copy_(torch.randint(0, 256, cache.arena.shape, generator=gen, dtype=torch.uint8))
    before = cache.arena.clone().view(6, lay.page_bytes)
    pairs = [(0, 1), (1, 0), (2, 5), (2, 4)]  # a swap and a one-to-many copy
    cache.copy_pages(torch.tensor(pairs))
    expect = before.clone()
    for s, d in pairs:
        expect[d] = before[s]
    assert torch.equal(cache.arena.view(6, lay.page_bytes), expect)
    with pytest.raises(ValueError, match="0..5"):
        cache.copy_pages(torch.tensor([[0, 6]]))
    cache.copy_pages(torch.zeros(0, 2, dtype=torch.long))  # nothing to do is fine


def test_bad_construction_is_a_config_error(config):
    with pytest.raises(ConfigError, match="at least one page"):
        HybridCache(config, _layout(config), 0)
    with pytest.raises(ConfigError, match="same dtype"):
        HybridCache(config, _layout(config, 4, "float32"), 2, dtype="bfloat16")


def _batch(**kw):
    args = dict(input_ids=[1, 2, 3], positions=[0, 1, 5], slot_mapping=[0, 1, 9],
                query_start_loc=[0, 2, 3], seq_lens=[2, 6], block_tables=[[0], [1, 2]],
                state_pages=[[0, 3], [1, 4]], has_initial_state=[False, True], logits_indices=[1, 2])
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
    with pytest.raises(ValueError, match="both checkpoint_positions and checkpoint_pages"):
        ForwardBatch(**{**_batch().__dict__, "checkpoint_positions": torch.tensor([-1, 1])}).validate()
    ok = _batch(checkpoint_positions=[-1, 1], checkpoint_pages=[[-1, -1], [5, 6]])
    ok.validate()
    assert ok.checkpoint_positions.dtype == torch.int32 and ok.checkpoint_pages.tolist() == [[-1, -1], [5, 6]]
