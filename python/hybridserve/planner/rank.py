"""The shapes one tensor-parallel rank holds, and the parameters they add up to.

Tensor parallelism of degree N splits the model the way vLLM and SGLang split this
architecture (issue 19):

* **attention** by query heads: each rank has ``num_attention_heads / N`` query heads
  (q_proj's gate half with them), ``num_key_value_heads / N`` KV heads, or exactly one
  when N exceeds the KV heads (each KV head then *replicated* on ``N / kv_heads``
  ranks); ``o_proj`` row-parallel over the rank's heads;
* **Gated DeltaNet** by key-head group: ``linear_num_key_heads / N`` key heads per rank,
  each carrying its ``num_value_heads / num_key_heads`` value heads, so in_proj_qkv /
  z / b / a, the conv1d channels, ``A_log``, ``dt_bias`` and the recurrent state split
  with them (no state is ever communicated); ``out_proj`` row-parallel;
* **MLP** and every **MoE expert** (routed and shared) by intermediate width;
* **embedding and LM head** by vocabulary rows;
* *replicated* on every rank: every RMSNorm weight (they scale the hidden size or one
  head's width), the MoE router ``mlp.gate``, ``shared_expert_gate`` and o_proj's
  bias.

:func:`rank_config` is that shard written as a :class:`ModelConfig` (every shape field
the rank's): the planner counts a rank's weights from it (:func:`rank_param_count`) and
sizes a rank's arena from it (the page layout of :mod:`hybridserve.memory.layout` over
the rank's KV heads and DeltaNet heads: 1/N of every sequence's state, the rank's share
of each KV block). It is a shape for counting, not a model to run alone: its vocabulary
is one rank's rows.

A degree that does not divide a split dimension is refused with a
:class:`~hybridserve.errors.ConfigError` naming the dimension; KV heads are the one
exception (they replicate when N is a multiple of them).
"""

from __future__ import annotations

import dataclasses

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.planner.units import positive_int
from hybridserve.planner.weights import ParamSplit, param_split

#: The largest degree the planner tries when it looks for the smallest that fits.
MAX_TENSOR_PARALLEL = 64


def _split_dims(config: ModelConfig) -> list[tuple[str, int, str]]:
    """``(config key, size, what splits by it)`` of every dimension N must divide."""
    c = config
    dims = [
        ("num_attention_heads", c.num_attention_heads, "attention query heads"),
        ("linear_num_key_heads", c.linear_num_key_heads,
         "Gated DeltaNet key-head groups (each with its value heads)"),
        ("vocab_size", c.vocab_size, "embedding and LM head rows"),
    ]
    if c.num_experts > 0:
        dims.append(("moe_intermediate_size", c.moe_intermediate_size, "each routed expert's intermediate width"))
        if c.shared_expert_intermediate_size:
            dims.append(("shared_expert_intermediate_size", c.shared_expert_intermediate_size,
                         "the shared expert's intermediate width"))
    else:
        dims.append(("intermediate_size", c.intermediate_size, "the MLP's intermediate width"))
    return dims


def _divisors(n: int, limit: int = MAX_TENSOR_PARALLEL) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def degree_problems(config: ModelConfig, n: int) -> list[str]:
    """Why ``n`` is not a valid tensor-parallel degree for ``config``: one sentence per
    dimension it does not split (empty when it is valid)."""
    positive_int("tensor-parallel size", n)
    problems = [
        f"{key} = {size} ({what}) is not divisible by {n}"
        for key, size, what in _split_dims(config) if size % n
    ]
    kv = config.num_key_value_heads
    if kv % n and n % kv:
        problems.append(
            f"num_key_value_heads = {kv} is neither divisible by {n} nor a divisor of {n} (KV "
            "heads split across the ranks, or replicate when the ranks are a multiple of them)"
        )
    # The model's own constraint that makes key-head groups whole: value heads per key head.
    if n > 1 and config.linear_num_value_heads % config.linear_num_key_heads:
        problems.append(
            f"linear_num_value_heads = {config.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads = {config.linear_num_key_heads}, so key-head groups cannot split"
        )
    return problems


def check_degree(config: ModelConfig, n: int) -> None:
    """ConfigError naming every dimension ``n`` does not split, with the degrees that work."""
    problems = degree_problems(config, n)
    if problems:
        valid = valid_degrees(config)
        raise ConfigError(
            f"tensor-parallel size {n} cannot shard this model: " + "; ".join(problems)
            + f". Valid sizes up to {MAX_TENSOR_PARALLEL}: {', '.join(map(str, valid))}"
        )


def valid_degrees(config: ModelConfig, up_to: int = MAX_TENSOR_PARALLEL) -> list[int]:
    """Every degree from 1 to ``up_to`` that shards ``config`` (see :func:`degree_problems`)."""
    return [n for n in range(1, up_to + 1) if not degree_problems(config, n)]


def kv_head_replicas(config: ModelConfig, n: int) -> int:
    """Ranks holding each KV head: 1 while ``n`` divides the KV heads, ``n / kv_heads``
    when the ranks outnumber them."""
    positive_int("tensor-parallel size", n)
    return max(1, n // config.num_key_value_heads)


def rank_config(config: ModelConfig, n: int) -> ModelConfig:
    """The shapes one of ``n`` ranks holds (see the module's rule); ConfigError naming the
    dimension when ``n`` does not shard the model. ``rank_config(c, 1)`` is ``c``."""
    check_degree(config, n)
    if n == 1:
        return config
    c = config
    return dataclasses.replace(
        c,
        num_attention_heads=c.num_attention_heads // n,
        num_key_value_heads=max(1, c.num_key_value_heads // n),
        linear_num_key_heads=c.linear_num_key_heads // n,
        linear_num_value_heads=c.linear_num_value_heads // n,
        vocab_size=c.vocab_size // n,
        intermediate_size=c.intermediate_size // n,
        moe_intermediate_size=c.moe_intermediate_size // n,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // n,
    )


def rank_param_split(config: ModelConfig, n: int) -> dict[str, ParamSplit]:
    """Parameters one of ``n`` ranks holds, by part: ``sharded`` is the rank's slice of
    split tensors (KV projections included, also when they are replicated copies),
    ``replicated`` what every rank holds whole (norms, router, shared_expert_gate)."""
    return param_split(rank_config(config, n))


def rank_param_count(config: ModelConfig, n: int) -> int:
    """Parameters one of ``n`` ranks holds (every rank holds the same count)."""
    return sum(p.total for p in rank_param_split(config, n).values())


def rank_weight_bytes(config: ModelConfig, n: int) -> int:
    """Weight bytes on each of ``n`` ranks: :func:`rank_param_count` x the model dtype."""
    return rank_param_count(config, n) * dtype_bytes(config.torch_dtype)
