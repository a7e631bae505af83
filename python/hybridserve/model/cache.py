"""The two pools of a hybrid model: paged K/V for attention layers, state slots for DeltaNet."""

from __future__ import annotations

import torch

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError

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


def _pairs(pairs: torch.Tensor, limit: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
    # Pairs already on an accelerator are not range-checked here: that would read
    # device data back every step. The runner checks the plan's host arrays before
    # they travel.
    if pairs.device.type == "cpu" and pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= limit):
        raise ValueError(f"{what} pair ids must lie in 0..{limit - 1}, got {pairs.tolist()}")
    return pairs[:, 0], pairs[:, 1]


class HybridCache:
    """Owns the KV block pool and the DeltaNet state pool of one model instance.

    Layouts (contiguous, one tensor per layer, indexed by the layer's ordinal among its
    kind; see :meth:`kv` / :meth:`state` to go from a model layer index):

    * attention layer: ``k_caches[i]``, ``v_caches[i]``
      ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype; token at
      flat slot ``s`` lives at ``[s // block_size, s % block_size]``.
    * DeltaNet layer: ``conv_states[i]`` ``[num_state_slots, conv_dim, conv_kernel - 1]``
      in the model dtype (the last inputs, oldest first) and ``recurrent_states[i]``
      float32 ``[num_state_slots, num_value_heads, key_head_dim, value_head_dim]``.

    Allocated zeroed; a sequence that starts with ``has_initial_state=False`` never reads
    its slot, so slots need no clearing between owners.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1 or num_state_slots < 1:
            raise ConfigError(
                f"HybridCache needs at least one block, one token per block and one state slot; got "
                f"num_blocks={num_blocks}, block_size={block_size}, num_state_slots={num_state_slots}"
            )
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        c = config
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        conv_shape = (num_state_slots, c.linear_conv_dim, c.linear_conv_kernel_dim - 1)
        rec_shape = (num_state_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                     c.linear_value_head_dim)
        self.attn_layer_ordinal = {layer: i for i, layer in enumerate(c.full_attention_layers)}
        self.linear_layer_ordinal = {layer: i for i, layer in enumerate(c.linear_attention_layers)}
        z = dict(device=self.device)
        self.k_caches = [torch.zeros(kv_shape, dtype=self.dtype, **z) for _ in self.attn_layer_ordinal]
        self.v_caches = [torch.zeros(kv_shape, dtype=self.dtype, **z) for _ in self.attn_layer_ordinal]
        self.conv_states = [torch.zeros(conv_shape, dtype=self.dtype, **z) for _ in self.linear_layer_ordinal]
        self.recurrent_states = [torch.zeros(rec_shape, dtype=torch.float32, **z)
                                 for _ in self.linear_layer_ordinal]

    # ---- access by model layer index ----------------------------------------
    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.attn_layer_ordinal[layer_idx]
        return self.k_caches[i], self.v_caches[i]

    def state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.linear_layer_ordinal[layer_idx]
        return self.conv_states[i], self.recurrent_states[i]

    # ---- copies ---------------------------------------------------------------
    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy-on-write: for each ``(src, dst)`` row of int ``[K, 2]``, block ``dst`` of every
        attention layer gets block ``src``'s K/V. All sources are read before any write, so
        the result does not depend on the order of the pairs. O(K * layers * block bytes)."""
        src, dst = _pairs(pairs, self.num_blocks, "copy_blocks")
        if not src.numel():
            return
        src, dst = src.to(self.device), dst.to(self.device)
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def copy_state_slots(self, pairs: torch.Tensor) -> None:
        """Fork: for each ``(src, dst)`` row of int ``[M, 2]``, slot ``dst`` of every DeltaNet
        layer gets slot ``src``'s conv and recurrent state (sources read before writes)."""
        src, dst = _pairs(pairs, self.num_state_slots, "copy_state_slots")
        if not src.numel():
            return
        src, dst = src.to(self.device), dst.to(self.device)
        for pool in (*self.conv_states, *self.recurrent_states):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def zero_state_slots(self, slots) -> None:
        """Clear slots (not needed for correctness: see the class docstring)."""
        idx = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        if idx.device.type == "cpu" and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_state_slots):
            raise ValueError(f"state slots must lie in 0..{self.num_state_slots - 1}, got {idx.tolist()}")
        idx = idx.to(self.device)
        for pool in (*self.conv_states, *self.recurrent_states):
            pool.index_fill_(0, idx, 0)

    # ---- sizes (for the planner and the runner's pool sizing) ----------------
    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: str | torch.dtype) -> int:
        """K and V of one block across all attention layers."""
        el = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        return (2 * config.num_full_attention_layers * block_size * config.num_key_value_heads
                * config.head_dim * el)

    @staticmethod
    def bytes_per_state_slot(config: ModelConfig, dtype: str | torch.dtype) -> int:
        """Conv state (model dtype) + float32 recurrent state of one slot, all DeltaNet layers."""
        el = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        c = config
        conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * el
        rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        return c.num_linear_attention_layers * (conv + rec)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (*self.k_caches, *self.v_caches, *self.conv_states, *self.recurrent_states))
