"""The kernel entry points the model calls; each dispatches to an implementation.

Today every op runs its plain-PyTorch reference (the CPU path). The Triton kernels
plug in here ("if the tensor is on CUDA and Triton is available, use Triton") without
the model changing: the signatures below are the contract for both.
"""

from __future__ import annotations

import torch

from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.causal_conv1d import causal_conv1d_ref
from hybridserve.kernels.gated_delta_rule import gated_delta_rule_ref
from hybridserve.kernels.paged_attention import paged_attention_ref


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """See :func:`hybridserve.kernels.cache_write.write_kv_ref`."""
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale) -> torch.Tensor:
    """See :func:`hybridserve.kernels.paged_attention.paged_attention_ref`."""
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state,
                  activation="silu") -> torch.Tensor:
    """See :func:`hybridserve.kernels.causal_conv1d.causal_conv1d_ref`."""
    return causal_conv1d_ref(x, weight, bias, conv_state, query_start_loc, state_slots,
                             has_initial_state, activation)


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state,
                     scale, use_qk_l2norm=True) -> torch.Tensor:
    """See :func:`hybridserve.kernels.gated_delta_rule.gated_delta_rule_recurrent_ref`."""
    return gated_delta_rule_ref(q, k, v, g, beta, state, query_start_loc, state_slots,
                                has_initial_state, scale, use_qk_l2norm)
