"""How one rank's share of a Qwen3.5 model is cut from the full model.

The cuts follow vLLM's and SGLang's for this architecture, so that no recurrent state
and no KV ever crosses ranks:

* **attention** by query heads: rank r holds query heads ``[r*H/N, (r+1)*H/N)`` (each
  with its output gate) and the KV heads they read. With fewer KV heads than ranks
  the KV heads are *replicated*: N/KV ranks share one KV head, each computing and
  caching it (the cache grows, nothing is communicated);
* **Gated DeltaNet** by key-head group: rank r holds key heads ``[r*K/N, ...)`` and the
  value heads they serve (HF groups value heads per key head contiguously), so the
  q/k/v rows of ``in_proj_qkv`` and the conv channels (the same rows), ``in_proj_z``,
  ``in_proj_b``/``in_proj_a``, ``A_log``, ``dt_bias`` and the recurrent state all split
  with them; the gated norm's weight (per head dim) is replicated;
* **MLP** column-parallel gate/up, row-parallel down; **MoE**: every routed expert's
  and the shared expert's intermediate dimension split, router and shared-expert gate
  replicated (the block's output is a partial sum on each rank);
* **out_proj / o_proj / down_proj** row-parallel: each rank's output is a partial sum,
  reduced by one all-reduce after each mixer and one after each MLP/MoE block;
* **embedding and LM head** split over the vocabulary;
* **the MTP layer** (speculative decoding's drafter) as a decoder layer (its attention
  by heads, its MLP/MoE by intermediate dimension, its KV one more attention layer in
  every rank's arena), and its ``fc`` (``[H, 2H]``) row-parallel: rank r multiplies its
  share of the ``2H`` input columns and the partial outputs are all-reduced, as after
  an ``o_proj``.

Everything here is integer arithmetic over a :class:`ModelConfig` (no torch): the
engine, the loader and the planner read the same numbers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError

# (dim, [(start, stop), ...]): the full tensor's slices along ``dim``, concatenated.
Cut = tuple[int, list[tuple[int, int]]]


def _need_divisible(what: str, value: int, n: int) -> None:
    if value % n:
        raise ConfigError(
            f"tensor_parallel_size={n} does not divide {what} ({value}): choose a "
            f"tensor-parallel size that divides it"
        )


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world_size``'s slice of ``config`` (the full model's shape)."""

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if n < 1 or not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is not in 0..{n - 1}")
        _need_divisible("vocab_size", c.vocab_size, n)
        _need_divisible("num_attention_heads", c.num_attention_heads, n)
        kv = c.num_key_value_heads
        if kv >= n:
            _need_divisible("num_key_value_heads", kv, n)
        elif n % kv:
            # Replicating KV heads needs each to serve a whole number of ranks.
            raise ConfigError(
                f"tensor_parallel_size={n} exceeds num_key_value_heads ({kv}) and is not a "
                f"multiple of it: KV heads are replicated across ranks, so the size must be a "
                f"multiple of {kv} (or divide it)"
            )
        if c.num_linear_attention_layers:
            _need_divisible("linear_num_key_heads", c.linear_num_key_heads, n)
            _need_divisible("linear_num_value_heads", c.linear_num_value_heads, n)
        if c.is_moe:
            _need_divisible("moe_intermediate_size", c.moe_intermediate_size, n)
            if c.shared_expert_intermediate_size:
                _need_divisible("shared_expert_intermediate_size", c.shared_expert_intermediate_size, n)
        else:
            _need_divisible("intermediate_size", c.intermediate_size, n)

    # ---- per-rank counts ------------------------------------------------------
    def _range(self, total: int) -> tuple[int, int]:
        per = total // self.world_size
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self._range(self.config.vocab_size)

    @property
    def q_heads(self) -> tuple[int, int]:
        return self._range(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads: a 1/N share, or the one replicated head its query
        heads read when there are fewer KV heads than ranks."""
        c = self.config
        if c.num_key_value_heads >= self.world_size:
            return self._range(c.num_key_value_heads)
        group = c.num_attention_heads // c.num_key_value_heads  # query heads per KV head
        head = self.q_heads[0] // group
        return head, head + 1

    @property
    def key_heads(self) -> tuple[int, int]:
        return self._range(self.config.linear_num_key_heads)

    @property
    def value_heads(self) -> tuple[int, int]:
        return self._range(self.config.linear_num_value_heads)

    @property
    def mtp_fc_columns(self) -> tuple[int, int]:
        """This rank's input columns of the MTP layer's ``fc`` (``2 * hidden_size`` in all)."""
        _need_divisible("2 * hidden_size (the MTP layer's fc input)", 2 * self.config.hidden_size,
                        self.world_size)
        return self._range(2 * self.config.hidden_size)

    @property
    def replicates_kv(self) -> bool:
        return self.config.num_key_value_heads < self.world_size

    def local_config(self) -> ModelConfig:
        """The shape of this rank's model: what :class:`Qwen3_5ForServing` builds for the
        shard and what the arena's page layout is computed from (per-rank KV and state)."""
        c, n = self.config, self.world_size
        kv0, kv1 = self.kv_heads
        return dataclasses.replace(
            c,
            vocab_size=c.vocab_size // n,
            num_attention_heads=c.num_attention_heads // n,
            num_key_value_heads=kv1 - kv0,
            linear_num_key_heads=c.linear_num_key_heads // n,
            linear_num_value_heads=c.linear_num_value_heads // n,
            intermediate_size=c.intermediate_size // n,
            moe_intermediate_size=c.moe_intermediate_size // n,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size // n,
        )

    # ---- checkpoint slices ------------------------------------------------------
    def cut(self, name: str, shape: tuple[int, ...]) -> Cut | None:
        """Which part of checkpoint tensor ``name`` (local HF name, full ``shape``) this
        rank loads: ``(dim, ranges)``, or None for a replicated tensor (loaded whole)."""
        c = self.config
        leaf = name.rsplit(".", 2)
        kind = leaf[-1]  # weight / bias / A_log / dt_bias / gate_up_proj / down_proj
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, [self.vocab_range]
        if name == "mtp.fc.weight":
            return 1, [self.mtp_fc_columns]
        m = re.search(r"\.(self_attn|linear_attn|mlp)\.(.*)$", name)
        if m is None:
            return None  # layer norms, final norm
        block, rest = m.groups()
        if block == "self_attn":
            d = c.head_dim
            if rest.startswith("q_proj."):
                h0, h1 = self.q_heads
                return 0, [(h0 * 2 * d, h1 * 2 * d)]  # [q_h | gate_h] per head
            if rest.startswith(("k_proj.", "v_proj.")):
                k0, k1 = self.kv_heads
                return 0, [(k0 * d, k1 * d)]
            if rest == "o_proj.weight":
                h0, h1 = self.q_heads
                return 1, [(h0 * d, h1 * d)]
            return None  # q_norm / k_norm (per head dim); o_proj.bias: see row_bias
        if block == "linear_attn":
            dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
            k0, k1 = self.key_heads
            v0, v1 = self.value_heads
            kd = c.linear_key_dim
            qkv = [(k0 * dk, k1 * dk), (kd + k0 * dk, kd + k1 * dk), (2 * kd + v0 * dv, 2 * kd + v1 * dv)]
            if rest in ("in_proj_qkv.weight", "conv1d.weight"):
                return 0, qkv
            if rest == "in_proj_z.weight":
                return 0, [(v0 * dv, v1 * dv)]
            if rest in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                return 0, [(v0, v1)]
            if rest == "out_proj.weight":
                return 1, [(v0 * dv, v1 * dv)]
            return None  # norm.weight (per value head dim)
        # mlp: dense MLP, or MoE router / experts / shared expert
        if rest in ("gate.weight", "shared_expert_gate.weight"):
            return None  # router and shared-expert gate: replicated
        if rest.startswith("experts."):
            i = c.moe_intermediate_size
            a, b = self._range(i)
            if rest == "experts.gate_up_proj":  # HF fused [E, 2I, H]: gate rows then up rows
                return 1, [(a, b), (i + a, i + b)]
            if rest == "experts.down_proj":  # HF fused [E, H, I]
                return 2, [(a, b)]
            inter = i
        elif rest.startswith("shared_expert."):
            inter = c.shared_expert_intermediate_size
        else:
            inter = c.intermediate_size
        a, b = self._range(inter)
        if kind == "weight" and (rest.endswith("gate_proj.weight") or rest.endswith("up_proj.weight")):
            return 0, [(a, b)]
        if rest.endswith("down_proj.weight"):
            return 1, [(a, b)]
        return None

    def row_bias(self, name: str) -> bool:
        """A bias added after a row-parallel projection: the all-reduce would add it N
        times, so only rank 0 keeps it (the others hold zeros)."""
        return name.endswith("o_proj.bias")
