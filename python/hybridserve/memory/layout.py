"""The arena's page layout: one page size for KV blocks, DeltaNet state and checkpoints.

Pure integer arithmetic over a :class:`~hybridserve.config.ModelConfig` (no torch): the
planner, the engine, the cache and the kernels' addressing all read the same numbers
from here, so there is one source of truth for where a byte lives.

**Why grouped pages.** The engine keeps one pool of equal pages and one free count. A
page is one *KV block*: ``block_size`` tokens of K and V for every attention layer (the
unit the block tables, the prefix cache and copy-on-write already speak). A sequence's
DeltaNet state is a short list of pages (its *state page table*), the same for a state
checkpoint. Inside its pages the state is cut into *items* that never straddle a page:

* a **recurrent item**: one value head of one DeltaNet layer, ``[key_head_dim,
  value_head_dim]`` float32 (the unit the kernels' (sequence, head) tasks touch);
* a **conv item**: one DeltaNet layer's conv state, ``[conv_dim, conv_kernel - 1]`` in
  the cache dtype.

Recurrent items fill the first ``recurrent_pages`` pages (``recurrent_per_page`` each,
item ``layer * num_value_heads + head``), conv items the next ``conv_pages`` pages
(``conv_per_page`` each, item ``layer``). At the 27B shape a page is 1 MiB (16 layers x
one 64 KiB attention block), holds 16 heads' state exactly, and a sequence's state is
144 + 3 = 147 pages. KV blocks keep 16 tokens: no attention block is inflated to a
state's size (vLLM's hybrid allocator grows it to hundreds of tokens).

**Padding.** The page size is the KV block rounded up to 64 bytes, or the largest item
if an item is bigger than a block (tiny shapes only), so every item fits a page. What a
page cannot use is padding, reported per KV block and per sequence state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError

#: Pages are multiples of a cache line, so every view of the arena is aligned.
PAGE_ALIGN = 64
#: The recurrent (matrix) state is float32 whatever the model dtype (as HF keeps it).
RECURRENT_STATE_BYTES = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ArenaLayout:
    """Where each kind of data lives in a page, for one model shape, block size and cache dtype."""

    block_size: int
    kv_dtype: str
    #: Bytes of one page (the arena's unit).
    page_bytes: int
    #: K and V of ``block_size`` tokens, all attention layers (what a KV page holds).
    kv_block_bytes: int
    #: K and V of ``block_size`` tokens of one attention layer (``kv_block_bytes / layers``).
    kv_layer_block_bytes: int
    num_attention_layers: int
    num_linear_layers: int
    num_value_heads: int
    #: One value head's recurrent state: key_head_dim x value_head_dim x 4 B.
    recurrent_item_bytes: int
    #: One layer's conv state: conv_dim x (kernel - 1) x cache dtype.
    conv_item_bytes: int
    recurrent_per_page: int
    conv_per_page: int
    recurrent_pages: int
    conv_pages: int
    #: Attention layers outside the trunk whose K/V the page also holds, after the
    #: trunk's (the MTP layer of speculative decoding: 1). Counted in
    #: ``num_attention_layers`` and ``kv_block_bytes``.
    extra_attention_layers: int = 0

    # ---- per sequence -----------------------------------------------------------
    @property
    def state_pages(self) -> int:
        """Pages one sequence's DeltaNet state (or one checkpoint) takes."""
        return self.recurrent_pages + self.conv_pages

    @property
    def state_bytes(self) -> int:
        """Bytes of state a sequence actually has (without padding)."""
        return self.num_linear_layers * (self.num_value_heads * self.recurrent_item_bytes
                                         + self.conv_item_bytes)

    @property
    def state_padding_bytes(self) -> int:
        return self.state_pages * self.page_bytes - self.state_bytes

    @property
    def kv_padding_bytes(self) -> int:
        """Bytes of each KV page that hold nothing (0 unless an item outgrew a block)."""
        return self.page_bytes - self.kv_block_bytes

    # ---- addressing (byte offsets inside a page) -------------------------------
    def recurrent_item(self, layer: int, head: int) -> tuple[int, int]:
        """``(index into the state page table, byte offset in that page)`` of DeltaNet
        layer ordinal ``layer``'s value head ``head``."""
        i = layer * self.num_value_heads + head
        return i // self.recurrent_per_page, (i % self.recurrent_per_page) * self.recurrent_item_bytes

    def conv_item(self, layer: int) -> tuple[int, int]:
        """``(index into the state page table, byte offset in that page)`` of DeltaNet
        layer ordinal ``layer``'s conv state."""
        return (self.recurrent_pages + layer // self.conv_per_page,
                (layer % self.conv_per_page) * self.conv_item_bytes)

    # ---- capacity ---------------------------------------------------------------
    def num_pages(self, budget_bytes: int) -> int:
        """Pages a byte budget holds (rounded down)."""
        return max(0, int(budget_bytes) // self.page_bytes)

    def pages_for_sequence(self, num_tokens: int) -> int:
        """Pages a running sequence of ``num_tokens`` tokens holds: its state + its KV blocks."""
        return self.state_pages + _ceil_div(max(0, num_tokens), self.block_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(state_pages=self.state_pages, state_bytes=self.state_bytes,
                 state_padding_bytes=self.state_padding_bytes, kv_padding_bytes=self.kv_padding_bytes)
        return d


def arena_layout(config: ModelConfig, block_size: int = 16, kv_dtype: str | None = None,
                 extra_attention_layers: int = 0) -> ArenaLayout:
    """The page layout for ``config`` with blocks of ``block_size`` tokens and the KV/conv
    cache in ``kv_dtype`` (default: the model dtype). ``extra_attention_layers``: full
    attention layers beyond the trunk's whose KV the pages also hold (1 for the MTP
    layer when speculative decoding is on), so a KV page grows by one layer's block
    each. ConfigError for a bad block size."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    if isinstance(extra_attention_layers, bool) or not isinstance(extra_attention_layers, int) \
            or extra_attention_layers < 0:
        raise ConfigError(f"extra_attention_layers must be a non-negative integer, got {extra_attention_layers!r}")
    kv_dtype = config.torch_dtype if kv_dtype is None else kv_dtype
    el = dtype_bytes(kv_dtype)
    A = config.num_full_attention_layers + extra_attention_layers
    D = config.num_linear_attention_layers
    Hv = config.linear_num_value_heads
    layer_block = 2 * block_size * config.num_key_value_heads * config.head_dim * el
    kv_block = A * layer_block
    rec_item = config.linear_key_head_dim * config.linear_value_head_dim * RECURRENT_STATE_BYTES
    conv_item = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * el
    page = _ceil_div(max(kv_block, rec_item if D else 0, conv_item if D else 0, 1), PAGE_ALIGN) * PAGE_ALIGN
    rec_per_page = page // rec_item if rec_item else 1
    conv_per_page = page // conv_item if conv_item else 1
    return ArenaLayout(
        block_size=block_size, kv_dtype=kv_dtype, page_bytes=page, kv_block_bytes=kv_block,
        kv_layer_block_bytes=layer_block, num_attention_layers=A, num_linear_layers=D,
        num_value_heads=Hv, recurrent_item_bytes=rec_item, conv_item_bytes=conv_item,
        recurrent_per_page=rec_per_page, conv_per_page=conv_per_page,
        recurrent_pages=_ceil_div(D * Hv, rec_per_page), conv_pages=_ceil_div(D, conv_per_page),
        extra_attention_layers=extra_attention_layers,
    )
