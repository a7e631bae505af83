"""The arena's page layout against a brute-force placement of every byte.

The oracle here is independent of layout.py's arithmetic: it lays out one sequence's
state item by item (first fit into pages of the layout's size, recurrent heads first,
then conv layers, never straddling a page) and checks that layout.py's addresses are
the same, that no two items overlap, and that nothing spills past a page.
"""

from __future__ import annotations

import random

import pytest

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.memory import arena_layout
from hybridserve.presets import preset_path



def _config(**kw) -> ModelConfig:
    layers = kw.pop("layer_types")
    base = dict(
        model_type="qwen3_5_text", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layers), layer_types=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, torch_dtype="float32",
    )
    base.update(kw)
    return ModelConfig.from_dict(base)


def _brute_force(page: int, items: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """First-fit placement of ``(name, size)`` items, kinds kept in separate pages
    (a page holds one kind), returning ``name -> (page index, byte offset)``."""
    out, page_idx, used, kind = {}, -1, page, None
    for name, size in items:
        k = name.split(":")[0]
        if used + size > page or k != kind:
            page_idx, used, kind = page_idx + 1, 0, k
        out[name] = (page_idx, used)
        used += size
    return out


def _check(cfg: ModelConfig, block_size: int, kv_dtype: str | None) -> None:
    lay = arena_layout(cfg, block_size, kv_dtype)
    el = dtype_bytes(kv_dtype or cfg.torch_dtype)
    A, D, Hv = cfg.num_full_attention_layers, cfg.num_linear_attention_layers, cfg.linear_num_value_heads
    kv_block = 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * el * A
    rec = cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * el
    assert lay.kv_block_bytes == kv_block
    assert lay.page_bytes % 64 == 0 and lay.page_bytes >= max(kv_block, rec, conv)
    assert lay.page_bytes < max(kv_block, rec, conv) + 64
    items = [(f"rec:{d}:{h}", rec) for d in range(D) for h in range(Hv)]
    items += [(f"conv:{d}", conv) for d in range(D)]
    where = _brute_force(lay.page_bytes, items)
    for d in range(D):
        for h in range(Hv):
            assert lay.recurrent_item(d, h) == where[f"rec:{d}:{h}"]
        assert lay.conv_item(d) == where[f"conv:{d}"]
    assert lay.state_pages == max(p for p, _ in where.values()) + 1
    # No overlap, nothing past a page: mark every byte.
    seen: dict[int, set[int]] = {}
    for name, size in items:
        p, off = where[name]
        assert off + size <= lay.page_bytes, name
        taken = seen.setdefault(p, set())
        span = set(range(off, off + size))
        assert not taken & span, name
        taken |= span
    assert lay.state_bytes == sum(s for _, s in items)
    assert lay.state_padding_bytes == lay.state_pages * lay.page_bytes - lay.state_bytes
    assert lay.pages_for_sequence(0) == lay.state_pages
    assert lay.pages_for_sequence(block_size + 1) == lay.state_pages + 2


def test_27b_shape_matches_hand_arithmetic():
    # The 27B shape ships in the package (the seed's model; no file outside it needed).
    cfg = ModelConfig.from_json(preset_path("qwen3.5-27b"))
    lay = arena_layout(cfg, 16)
    # 16 attention layers x K,V x 16 tokens x 4 heads x 256 x 2 B = 1 MiB; one head's
    # state 128 x 128 x 4 B = 64 KiB (16 per page); conv 10,240 x 3 x 2 B = 61,440 B
    # (17 per page): 48 x 48 / 16 = 144 + ceil(48 / 17) = 3 pages.
    assert lay.page_bytes == 1 << 20 and lay.kv_padding_bytes == 0
    assert (lay.recurrent_pages, lay.conv_pages, lay.state_pages) == (144, 3, 147)
    assert lay.state_padding_bytes == 3 * (1 << 20) - 48 * 61_440
    # The seed's table: a 32K session is 2,048 KV pages + 147 state pages; 23,859 MiB
    # holds 10 of them.
    assert lay.num_pages(23_859 << 20) // lay.pages_for_sequence(32_768) == 10
    _check(cfg, 16, None)


@pytest.mark.parametrize("seed", range(40))
def test_random_shapes_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    layers = [rng.choice(["linear_attention", "full_attention"]) for _ in range(n)]
    layers[rng.randrange(n)] = "full_attention"
    layers[rng.randrange(n)] = "linear_attention"
    if layers.count("full_attention") == 0:
        layers[0] = "full_attention"
    hk = rng.randint(1, 4)
    cfg = _config(
        layer_types=layers, num_key_value_heads=rng.randint(1, 3), head_dim=rng.choice([8, 12, 16, 64]),
        linear_num_key_heads=hk, linear_num_value_heads=hk * rng.randint(1, 3),
        linear_key_head_dim=rng.choice([4, 8, 12, 32]), linear_value_head_dim=rng.choice([4, 6, 16, 32]),
        linear_conv_kernel_dim=rng.randint(2, 4),
    )
    _check(cfg, rng.choice([1, 4, 16, 32]), rng.choice([None, "bfloat16", "float16"]))


def test_item_larger_than_a_block_pads_the_page():
    # One attention layer of 1 KV head x 8 dims at 2 tokens per block is 128 B, far
    # smaller than one 32 x 32 float32 head state (4 KiB): the page grows to the item
    # and the KV padding says by how much.
    cfg = _config(layer_types=["linear_attention", "full_attention"], num_key_value_heads=1,
                  head_dim=8, linear_key_head_dim=32, linear_value_head_dim=32)
    lay = arena_layout(cfg, 2)
    assert lay.page_bytes == 4096 and lay.kv_padding_bytes == 4096 - 128
    _check(cfg, 2, None)


@pytest.mark.parametrize("bad", [0, -16, 1.5, True, "16"])
def test_bad_block_size_is_a_clear_error(bad):
    cfg = _config(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        arena_layout(cfg, bad)
