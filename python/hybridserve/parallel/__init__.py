"""Tensor parallelism: one model split over N ranks (torch.distributed: gloo on the
CPU, NCCL on CUDA), driven by the one scheduler on rank 0.

One file per concept: :mod:`.shard` (what each rank holds), :mod:`.layers` (the
vocabulary-parallel embedding / LM head and the all-reduce hooks), :mod:`.loader`
(each rank reads only its slices), :mod:`.group` (the ranks and their collectives),
:mod:`.plan_message` (a step's plan as two broadcasts), :mod:`.runner` (the driver's
runner), :mod:`.launcher` / :mod:`.worker` (workers on one host), :mod:`.errors`
and :mod:`.tensor_parallel` (what the engine calls).
"""

from hybridserve.parallel.errors import TensorParallelError
from hybridserve.parallel.shard import ShardPlan

__all__ = ["ShardPlan", "TensorParallelError"]
