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
* the **MTP layer** (speculative decoding's drafter) like a decoder layer, and its
  ``fc`` (``[H, 2H]``) by input columns;
* *replicated* on every rank: every RMSNorm weight (they scale the hidden size or one
  head's width), the MoE router ``mlp.gate``, ``shared_expert_gate`` and o_proj's
  bias.

The shapes themselves are the tensor-parallel runtime's own
(:meth:`hybridserve.parallel.shard.ShardPlan.local_config`, pure integer arithmetic
like this package): the shape the loader builds each rank's model from is the shape
the planner counts, so the two cannot drift. :func:`rank_config` is that shard as a
:class:`ModelConfig`: the planner counts a rank's weights from it
(:func:`rank_param_count`) and sizes a rank's arena from it (the page layout of
:mod:`hybridserve.memory.layout` over the rank's KV heads and DeltaNet heads: 1/N of
every sequence's state, the rank's share of each KV block). It is a shape for counting
and laying out, not a model to run alone: its vocabulary is one rank's rows.

A degree that does not divide a split dimension is refused with a
:class:`~hybridserve.errors.ConfigError` naming the dimension and listing the degrees
that work; KV heads are the one exception (they replicate when N is a multiple of them).
"""

from __future__ import annotations

from hybridserve.config import ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.parallel.shard import ShardPlan
from hybridserve.planner.units import positive_int
from hybridserve.planner.weights import ParamSplit, mtp_param_count, param_count, param_split, quantized_weight_bytes

#: The largest degree the planner tries when it looks for the smallest that fits.
MAX_TENSOR_PARALLEL = 64


def degree_error(config: ModelConfig, n: int) -> str | None:
    """Why ``n`` cannot shard ``config`` (the runtime's message, naming the dimension),
    or None when it can."""
    positive_int("tensor-parallel size", n)
    try:
        ShardPlan(config, 0, n)
    except ConfigError as e:
        return str(e)
    return None


def valid_degrees(config: ModelConfig, up_to: int = MAX_TENSOR_PARALLEL) -> list[int]:
    """Every degree from 1 to ``up_to`` that shards ``config``."""
    return [n for n in range(1, up_to + 1) if degree_error(config, n) is None]


def check_degree(config: ModelConfig, n: int) -> None:
    """ConfigError naming the dimension ``n`` does not split, with the degrees that work."""
    why = degree_error(config, n)
    if why is not None:
        valid = ", ".join(map(str, valid_degrees(config)))
        raise ConfigError(f"{why}. This model shards over {valid} devices (up to {MAX_TENSOR_PARALLEL})")


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
    # Every rank's shapes are equal (rank 0 stands for all of them).
    return ShardPlan(config, 0, n).local_config()


def rank_param_split(config: ModelConfig, n: int) -> dict[str, ParamSplit]:
    """Parameters one of ``n`` ranks holds, by part: ``sharded`` is the rank's slice of
    split tensors (KV projections included, also when they are replicated copies),
    ``replicated`` what every rank holds whole (norms, router, shared_expert_gate)."""
    return param_split(rank_config(config, n))


def rank_param_count(config: ModelConfig, n: int) -> int:
    """Parameters one of ``n`` ranks holds (every rank holds the same count)."""
    return sum(p.total for p in rank_param_split(config, n).values())


def rank_mtp_param_count(config: ModelConfig, n: int) -> int:
    """Parameters of the MTP layer one of ``n`` ranks holds: its decoder layer at the
    rank's shape, its norms whole, and ``2H / n`` of ``fc``'s input columns (ConfigError
    when ``n`` does not divide them)."""
    h = config.hidden_size
    if n > 1:
        ShardPlan(config, 0, n).mtp_fc_columns  # noqa: B018 - refuses a degree that does not divide 2H
    return mtp_param_count(rank_config(config, n)) - 2 * h * h + 2 * h * h // n


def rank_weight_bytes(config: ModelConfig, n: int) -> int:
    """Weight bytes on each of ``n`` ranks: :func:`rank_param_count` x the model dtype;
    for a quantized config, the quantized bytes in the share of parameters the rank
    holds (blocks split along rows with the weights, the replicated small tensors
    counted at the average rate), rounded up."""
    quantized = quantized_weight_bytes(config)
    if quantized is None:
        return rank_param_count(config, n) * dtype_bytes(config.torch_dtype)
    return -(-quantized * rank_param_count(config, n) // param_count(config))
