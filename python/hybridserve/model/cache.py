"""One memory arena for a hybrid model: KV blocks, DeltaNet state and checkpoints in equal pages.

The arena is one byte tensor of ``num_pages * layout.page_bytes`` bytes
(:mod:`hybridserve.memory.layout` says where each byte lives). Every cache tensor the
model and the kernels touch is a strided *view* of it, so a page holds whatever the
scheduler put there (a KV block, part of a sequence's state, part of a checkpoint)
without a copy or a second pool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.memory.layout import ArenaLayout

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``torch.bfloat16``/... -> ``torch.dtype``; ConfigError for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    else:
        name = str(dtype).removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"unsupported dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LayerState(NamedTuple):
    """Where one DeltaNet layer's state lives: a pool view ``[num_pages, per_page, *item]``
    of each kind and the layer's first item number (see :mod:`hybridserve.kernels.state_pages`)."""

    conv_pool: torch.Tensor
    conv_item_base: int
    recurrent_pool: torch.Tensor
    recurrent_item_base: int


class HybridCache:
    """The arena of one model instance, and its views.

    * ``arena``: uint8 ``[num_pages * page_bytes]`` (:attr:`pages` views it ``[num_pages,
      page_bytes]``).
    * attention layer ``a`` (ordinal among attention layers): ``k_caches[a]``,
      ``v_caches[a]`` ``[num_pages, block_size, num_kv_heads, head_dim]`` in the cache
      dtype, page stride ``page_bytes``; bytes ``[a * L, (a + 1) * L)`` of each page with
      ``L = layout.kv_layer_block_bytes``, K then V. Token at flat slot ``s`` lives at
      ``[s // block_size, s % block_size]`` as before. With
      ``layout.extra_attention_layers`` (the MTP layer), those follow the trunk's:
      :meth:`kv` takes layer index ``num_hidden_layers`` for it (:attr:`mtp_k_cache`).
    * ``recurrent_pool`` float32 ``[num_pages, recurrent_per_page, key_head_dim,
      value_head_dim]`` and ``conv_pool`` (cache dtype) ``[num_pages, conv_per_page,
      conv_dim, conv_kernel - 1]``: the state items a page can hold. A sequence's state
      is addressed through its state page table (``layout.state_pages`` page ids): item
      ``i`` of a kind is ``pool[table[i // per_page], i % per_page]``; DeltaNet layer
      ``l``'s recurrent head ``h`` is recurrent item ``l * num_value_heads + h`` and its
      conv state conv item ``recurrent_pages * conv_per_page + l`` (the conv items come
      after the recurrent pages; :meth:`state` gives both bases).

    Allocated zeroed. A sequence that starts with ``has_initial_state=False`` never reads
    its state pages, so pages need no clearing between owners.
    """

    def __init__(self, config: ModelConfig, layout: ArenaLayout, num_pages: int,
                 dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"HybridCache needs at least one page; got num_pages={num_pages!r}")
        self.config = config
        self.layout = layout
        self.num_pages = num_pages
        self.block_size = layout.block_size
        self.dtype = resolve_dtype(dtype)
        if resolve_dtype(layout.kv_dtype) != self.dtype:
            raise ConfigError(
                f"the layout was computed for cache dtype {layout.kv_dtype}, the cache is {dtype_name(self.dtype)}; "
                "build both with the same dtype")
        self.device = torch.device(device)
        c = config
        self.attn_layer_ordinal = {layer: i for i, layer in enumerate(c.full_attention_layers)}
        # Attention layers beyond the trunk (the MTP layer) are numbered after it, as
        # vLLM numbers them (layer index num_hidden_layers + i), and their K/V come
        # after the trunk's in each page.
        for i in range(layout.extra_attention_layers):
            self.attn_layer_ordinal[c.num_hidden_layers + i] = len(c.full_attention_layers) + i
        self.linear_layer_ordinal = {layer: i for i, layer in enumerate(c.linear_attention_layers)}
        pb = layout.page_bytes
        self.arena = torch.zeros(num_pages * pb, dtype=torch.uint8, device=self.device)
        self.pages = self.arena.view(num_pages, pb)
        typed = self.arena.view(self.dtype)
        el = typed.element_size()
        page_el = pb // el
        bs, hkv, d = layout.block_size, c.num_key_value_heads, c.head_dim
        kv_shape = (num_pages, bs, hkv, d)
        kv_strides = (page_el, hkv * d, d, 1)
        layer_el = layout.kv_layer_block_bytes // el
        self.k_caches = [typed.as_strided(kv_shape, kv_strides, a * layer_el) for a in self.attn_layer_ordinal.values()]
        self.v_caches = [typed.as_strided(kv_shape, kv_strides, a * layer_el + bs * hkv * d)
                         for a in self.attn_layer_ordinal.values()]
        kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
        f32 = self.arena.view(torch.float32)
        self.recurrent_pool = f32.as_strided((num_pages, layout.recurrent_per_page, kd, vd),
                                             (pb // 4, kd * vd, vd, 1))
        cd, hw = c.linear_conv_dim, c.linear_conv_kernel_dim - 1
        self.conv_pool = typed.as_strided((num_pages, layout.conv_per_page, cd, hw), (page_el, cd * hw, hw, 1))
        self._conv_base = layout.recurrent_pages * layout.conv_per_page

    @property
    def mtp_layer_index(self) -> int | None:
        """The layer index :meth:`kv` takes for the MTP layer's K/V, or None when the
        arena holds none (``layout.extra_attention_layers == 0``)."""
        return self.config.num_hidden_layers if self.layout.extra_attention_layers else None

    @property
    def mtp_k_cache(self) -> torch.Tensor | None:
        i = self.mtp_layer_index
        return None if i is None else self.kv(i)[0]

    @property
    def mtp_v_cache(self) -> torch.Tensor | None:
        i = self.mtp_layer_index
        return None if i is None else self.kv(i)[1]

    @property
    def state_pages(self) -> int:
        """Pages of one sequence's state (the width of a state page table row)."""
        return self.layout.state_pages

    # ---- access by model layer index ----------------------------------------
    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.attn_layer_ordinal[layer_idx]
        return self.k_caches[i], self.v_caches[i]

    def state(self, layer_idx: int) -> LayerState:
        i = self.linear_layer_ordinal[layer_idx]
        return LayerState(self.conv_pool, self._conv_base + i, self.recurrent_pool,
                          i * self.layout.num_value_heads)

    # ---- copies ---------------------------------------------------------------
    def copy_pages(self, pairs: torch.Tensor) -> None:
        """For each ``(src, dst)`` row of int ``[K, 2]``, page ``dst`` gets page ``src``'s
        bytes: KV copy-on-write, state forks and checkpoint restores alike. One gather
        of every source, then one scatter: all sources are read before any write, so the
        result does not depend on the pairs' order. O(K * page_bytes)."""
        pairs = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
        # Pairs already on an accelerator are not range-checked here: that would read
        # device data back every step. The runner checks the plan's host arrays before
        # they travel.
        if pairs.device.type == "cpu" and pairs.numel() and (
                int(pairs.min()) < 0 or int(pairs.max()) >= self.num_pages):
            raise ValueError(f"copy_pages pair ids must lie in 0..{self.num_pages - 1}, got {pairs.tolist()}")
        if not pairs.numel():
            return
        pairs = pairs.to(self.device)
        src, dst = pairs[:, 0], pairs[:, 1]
        self.pages.index_copy_(0, dst, self.pages.index_select(0, src))

    def memory_bytes(self) -> int:
        return self.arena.numel()
