"""The kernel entry points the model calls; each dispatches to an implementation.

Tensors on CUDA run the Triton kernels (``*_triton.py``) when Triton imports; anything
else runs the plain-PyTorch CPU path (``*_cpu`` beside each reference, tested against
it). Set ``HYBRIDSERVE_NO_TRITON=1`` to force the PyTorch path everywhere (debugging).
The signatures below are the contract for both.

``plans`` (optional, a dict owned by the caller, one per step) lets the PyTorch path
build its per-step layout (groups, gather indices) once and reuse it in every layer;
the Triton path ignores it.
"""

from __future__ import annotations

import torch

from hybridserve.kernels import native
from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.causal_conv1d import Conv1dPlan, causal_conv1d_cpu
from hybridserve.kernels.gated_delta_rule import DeltaRulePlan, gated_delta_rule_cpu
from hybridserve.kernels.paged_attention import AttentionPlan, paged_attention_cpu
from hybridserve.kernels.state_pages import item_coords

# --- Triton dispatch (owned by the kernels/Triton work; keep it to this block) ---
_TRITON_IMPORTS: bool | None = None


def _use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` is on CUDA and Triton imports (probed once, lazily).

    The kernel modules are imported only on this path, so CPU-only processes never
    import Triton and the interpreter setting of the tests is not captured early.
    """
    global _TRITON_IMPORTS
    if not t.is_cuda:
        return False
    if _TRITON_IMPORTS is None:
        import importlib.util
        import os

        _TRITON_IMPORTS = (
            os.environ.get("HYBRIDSERVE_NO_TRITON", "") not in ("1", "true", "yes")
            and importlib.util.find_spec("triton") is not None
        )
    return _TRITON_IMPORTS
# --- end of Triton dispatch ---


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """See :func:`hybridserve.kernels.cache_write.write_kv_ref`."""
    if _use_triton(key):
        from hybridserve.kernels.cache_write_triton import write_kv_triton

        return write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    if native.usable(key, value, k_cache, v_cache) or native.usable_bf16(key, value, k_cache, v_cache):
        # One row copy per token instead of torch's advanced-index index_put_.
        return native.write_kv(key, value, k_cache, v_cache, slot_mapping)
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def _plan(plans, key, build):
    if plans is None:
        return build()
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = build()
    return plan


def _varlen(plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions,
            checkpoint_pages, read_only=None) -> native.Varlen:
    return _plan(plans, ("varlen", read_only is not None), lambda: native.Varlen(
        query_start_loc, state_pages, has_initial_state, checkpoint_positions, checkpoint_pages, read_only))


def _ro(read_only, pool: torch.Tensor) -> torch.Tensor | None:
    """``read_only`` as the Triton kernels take it: a bool/int8 ``[B]`` tensor on the
    pool's device, or None (every run writes its state)."""
    if read_only is None:
        return None
    ro = torch.as_tensor(read_only, device=pool.device)
    return ro if ro.dtype in (torch.bool, torch.int8) else ro.to(torch.bool)


class _KeepItems:
    """The read-only (speculative) runs' state items, saved before a kernel that has no
    read-only flag (the PyTorch path) and put back after it: the same result as the
    native and Triton kernels' flag, for one copy of those runs' items of the layer.
    A no-op without read-only runs."""

    def __init__(self, pool, state_pages, item_base: int, n_items: int, read_only):
        self.saved = None
        if read_only is None:
            return
        ro = torch.as_tensor(read_only, device=pool.device)
        if not bool(ro.any()):
            return
        seqs = torch.nonzero(ro).flatten()
        rows = torch.as_tensor(state_pages, device=pool.device).index_select(0, seqs)
        pages, within = item_coords(rows, item_base, n_items, pool.shape[1])
        self.saved = (pool, pages, within, pool[pages, within].clone())

    def restore(self) -> None:
        if self.saved is not None:
            pool, pages, within, items = self.saved
            pool[pages, within] = items


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                    plans: dict | None = None) -> torch.Tensor:
    """See :func:`hybridserve.kernels.paged_attention.paged_attention_ref`."""
    if _use_triton(q):
        from hybridserve.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    # Decodes go to the native kernel when it can run (float32 or bfloat16 CPU); the
    # rest to SDPA groups.
    split = native.usable(q, k_cache, v_cache) or native.usable_bf16(q, k_cache, v_cache)
    plan = _plan(plans, ("attention", k_cache.shape[1], split), lambda: AttentionPlan(
        query_start_loc, seq_lens, block_tables, k_cache.shape[1], q.device, split_decodes=split))
    return paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, plan)


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, state_pages, has_initial_state,
                  activation="silu", plans: dict | None = None, *, item_base: int,
                  checkpoint_positions=None, checkpoint_pages=None, read_only=None) -> torch.Tensor:
    """See :func:`hybridserve.kernels.causal_conv1d.causal_conv1d_ref` (state through the
    state page table, :mod:`hybridserve.kernels.state_pages`). ``read_only`` bool ``[B]``
    (or None): those runs read their conv state but leave it as it was (speculative
    verify runs)."""
    ck = dict(item_base=item_base, checkpoint_positions=checkpoint_positions, checkpoint_pages=checkpoint_pages)
    if native.usable(x, weight, conv_state) and (bias is None or native.usable(bias)):
        return native.causal_conv1d(x, weight, bias, conv_state, _varlen(
            plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions, checkpoint_pages,
            read_only), activation, item_base=item_base)
    if native.usable_bf16(x, weight, conv_state) and (bias is None or native.usable_bf16(bias)):
        return native.causal_conv1d_bf16(x, weight, bias, conv_state, _varlen(
            plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions, checkpoint_pages,
            read_only), activation, item_base=item_base)
    if _use_triton(x) and 2 <= weight.shape[-1] <= 4:
        from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_triton

        # The kernel's own flag: read-only runs write nothing back, no copy.
        return causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, state_pages,
                                    has_initial_state, activation, read_only=_ro(read_only, conv_state), **ck)
    keep = _KeepItems(conv_state, state_pages, item_base, 1, read_only)
    plan = _plan(plans, ("conv1d", weight.shape[-1]), lambda: Conv1dPlan(
        query_start_loc, has_initial_state, weight.shape[-1], x.device, checkpoint_positions))
    y = causal_conv1d_cpu(x, weight, bias, conv_state, query_start_loc, state_pages,
                          has_initial_state, activation, plan, **ck)
    keep.restore()
    return y


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state,
                     scale, use_qk_l2norm=True, plans: dict | None = None, *, item_base: int,
                     checkpoint_positions=None, checkpoint_pages=None, read_only=None) -> torch.Tensor:
    """See :func:`hybridserve.kernels.gated_delta_rule.gated_delta_rule_recurrent_ref`;
    ``q``/``k`` may have ``Hk`` heads dividing the ``H`` of ``v`` (grouped heads, read
    without expanding them). ``read_only`` bool ``[B]`` (or None): those runs start from
    their state but leave it as it was (speculative verify runs)."""
    ck = dict(item_base=item_base, checkpoint_positions=checkpoint_positions, checkpoint_pages=checkpoint_pages)
    if not _use_triton(q) and native.usable(q, k, v, g, beta, state):
        t, hk, kd = q.shape
        h, vd = v.shape[1], v.shape[2]
        o = native.gated_delta_rule(
            q.reshape(t, hk * kd), k.reshape(t, hk * kd), v.reshape(t, h * vd), state,
            _varlen(plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions,
                    checkpoint_pages, read_only), key_heads=hk, value_heads=h,
            scale=scale, use_qk_l2norm=use_qk_l2norm, g=g, beta=beta, item_base=item_base)
        return o.view(t, h, vd)
    if _use_triton(q):
        # Per sequence: recurrent kernel under 16 tokens (decode), chunked kernel above;
        # read-only runs by the kernels' own flag (no copy).
        from hybridserve.kernels.gated_delta_rule_triton import gated_delta_rule_triton

        return gated_delta_rule_triton(q, k, v, g, beta, state, query_start_loc, state_pages,
                                       has_initial_state, scale, use_qk_l2norm, read_only=_ro(read_only, state), **ck)
    keep = _KeepItems(state, state_pages, item_base, v.shape[1], read_only)
    plan = _plan(plans, ("delta_rule",), lambda: DeltaRulePlan(
        query_start_loc, has_initial_state, device=q.device, checkpoint_positions=checkpoint_positions))
    o = gated_delta_rule_cpu(q, k, v, g, beta, state, query_start_loc, state_pages,
                             has_initial_state, scale, use_qk_l2norm, plan=plan, **ck)
    keep.restore()
    return o


def gated_delta_net_mixer(q, k, v, a, b, A_log, dt_bias, z, norm_weight, norm_eps, state, query_start_loc,
                          state_pages, has_initial_state, scale, *, key_heads: int, value_heads: int,
                          item_base: int, checkpoint_positions=None, checkpoint_pages=None,
                          plans: dict | None = None, read_only=None) -> torch.Tensor | None:
    """Gated DeltaNet after its conv, fused: gates from ``a``/``b``, the delta rule, and
    the gated output norm, all ``[T, X]`` (column ranges of the projections allowed);
    returns ``[T, H * V]``. Only where the native kernels run (float32 CPU, or
    bfloat16 CPU inputs and parameters over the float32 state); ``None`` elsewhere, and the
    caller composes :func:`gated_delta_rule` with its own norm."""
    if native.usable_bf16(q, k, v, a, b, z, A_log, dt_bias, norm_weight) and native.usable(state):
        # bfloat16 model: the kernel reads the bfloat16 inputs in place over the float32
        # recurrent state (as HF keeps it); the output is bfloat16 for the output projection.
        return native.gated_delta_rule(
            q, k, v, state, _varlen(plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions,
                                    checkpoint_pages, read_only),
            key_heads=key_heads, value_heads=value_heads, scale=scale, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
            z=z, norm_weight=norm_weight, norm_eps=norm_eps, item_base=item_base)
    if not native.usable(q, k, v, a, b, z, state, norm_weight):
        return None
    return native.gated_delta_rule(
        q, k, v, state, _varlen(plans, query_start_loc, state_pages, has_initial_state, checkpoint_positions,
                                checkpoint_pages, read_only),
        key_heads=key_heads, value_heads=value_heads, scale=scale, a=a, b=b,
        A_log=A_log.float(), dt_bias=dt_bias.float(), z=z, norm_weight=norm_weight, norm_eps=norm_eps,
        item_base=item_base)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    """The routed experts of an MoE block; see :func:`hybridserve.kernels.moe.fused_moe_ref`
    (the CPU's float32 path runs the whole block natively instead, ``native.moe_block``)."""
    if _use_triton(x):
        from hybridserve.kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    from hybridserve.kernels.moe import fused_moe_ref

    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
