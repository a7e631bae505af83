"""The tensor-parallel pieces of a sharded :class:`Qwen3_5ForServing`.

The model class itself is unchanged: a rank builds it with its shard's shape
(:meth:`ShardPlan.local_config`), so every projection already has its local rows or
columns, and this module adds what sharding needs on top:

* :class:`VocabParallelEmbedding`: looks up the ids in this rank's vocabulary range
  (zeros elsewhere) and all-reduces;
* :class:`VocabParallelQuantizedEmbedding`: the same over a table kept in blocks;
* :class:`VocabParallelLMHead`: this rank's vocabulary slice of the logits, gathered on
  the driver (rank 0) in vocabulary order;
* :func:`install_all_reduces`: one all-reduce on the output of each mixer
  (``self_attn`` / ``linear_attn``) and each MLP/MoE block, as forward hooks, so the
  decoder's code (and parameter names, which the loader and checkpoints use) stay as
  they are and a CUDA graph captured over the forward captures the all-reduces too;
* :func:`make_mtp_parallel`: the MTP layer's ``fc`` as a row-parallel projection over
  this rank's input columns (its decoder layer is already the shard's shape, and
  :func:`install_all_reduces` sums its mixer, MLP and ``fc`` like the trunk's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.model.qwen3_5 import Projection, Qwen3_5ForServing
from hybridserve.parallel.group import TPGroup
from hybridserve.quant.gguf.weights import QuantizedEmbedding


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the full embedding table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, group: TPGroup, **kw) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out, kind="embedding")


class VocabParallelQuantizedEmbedding(QuantizedEmbedding):
    """Rows ``[start, start + num_embeddings)`` of a token embedding kept in blocks (a
    GGUF's): this rank's rows of the table, looked up (dequantizing the rows read) for
    the ids in its range, zeros elsewhere, then all-reduced."""

    def __init__(self, qweight, dtype: torch.dtype, start: int, group: TPGroup) -> None:
        super().__init__(qweight, dtype)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(local.clamp(0, self.num_embeddings - 1))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out, kind="embedding")


class VocabParallelLMHead(Projection):
    """This rank's vocabulary rows of the LM head; rank 0 returns the full logits."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather_last_dim(super().forward(x))


def make_vocab_parallel(model: Qwen3_5ForServing, group: TPGroup, vocab_start: int) -> None:
    """Swap the model's embedding and LM head for their vocabulary-parallel versions
    (same parameter names and shapes; on the meta device, before weights exist)."""
    emb = model.embed_tokens
    device, dtype = emb.weight.device, emb.weight.dtype
    model.embed_tokens = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, vocab_start, group,
                                                device=device, dtype=dtype)
    model.embed_tokens.requires_grad_(False)
    head = model.lm_head
    head.__class__ = VocabParallelLMHead  # same module, same parameter: only forward changes
    head.group = group
    model.tie_weights()


def make_mtp_parallel(model: Qwen3_5ForServing, columns: tuple[int, int]) -> None:
    """Give the MTP layer's ``fc`` (``[H, 2H]`` in the checkpoint) this rank's input
    ``columns`` only (on the meta device, before weights exist): the full ``2H`` input
    (every rank has it: the embedding is all-reduced and the trunk's hidden state is
    replicated) is cut to them on the way in, and the partial output is summed by
    :func:`install_all_reduces`."""
    fc = model.mtp.fc
    a, b = columns
    local = Projection(b - a, fc.out_features, bias=False, device=fc.weight.device, dtype=fc.weight.dtype)
    local.requires_grad_(False)

    def own_columns(module, args):
        return (args[0][..., a:b].contiguous(),) + tuple(args[1:])

    local.register_forward_pre_hook(own_columns)
    model.mtp.fc = local


def install_all_reduces(model: Qwen3_5ForServing, group: TPGroup) -> list:
    """Sum every mixer's and every MLP/MoE block's partial output over the ranks (the
    MTP layer's too, and its row-parallel ``fc``'s)."""

    def reduce(kind: str):
        def hook(module, args, out):
            return group.all_reduce(out, kind=kind)
        return hook

    handles = []
    layers = list(model.layers)
    if model.mtp is not None:
        layers += list(model.mtp.layers)
        handles.append(model.mtp.fc.register_forward_hook(reduce("mtp_fc")))
    for layer in layers:
        mixer = layer.self_attn if layer.is_attention else layer.linear_attn
        handles.append(mixer.register_forward_hook(reduce("mixer")))
        handles.append(layer.mlp.register_forward_hook(reduce("mlp")))
    return handles
