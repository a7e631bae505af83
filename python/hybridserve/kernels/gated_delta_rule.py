"""Gated delta rule (Gated DeltaNet's token mixer) over state slots: the references.

Per head, with state ``S`` ``[K, V]`` (float32) and, for each token,
``q, k`` ``[K]`` (l2-normalised, q scaled by ``scale``), ``v`` ``[V]``, log-decay ``g``
and write strength ``beta``::

    S   <- exp(g) * S
    S   <- S + k (beta * (v - S^T k))^T      # the delta rule: write only the correction
    o    = S^T q

Two formulations with the same result (up to float rounding): a token-by-token
recurrence (decode, and the obvious oracle) and HF's chunked form (UT transform per
chunk of ``chunk_size`` tokens, a scan across chunks; the prefill path).
Both follow ``transformers``' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule``.
"""

from __future__ import annotations

import torch


def _as_list(t: torch.Tensor | list) -> list:
    return t if isinstance(t, list) else t.tolist()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as HF / FLA (rsqrt of sum + eps), not F.normalize, to match bit-closely.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _recurrent_one(q, k, v, g, beta, state):
    """One sequence; q,k [H,L,K], v [H,L,V], g/beta [H,L], state [H,K,V]; all float32."""
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", state, k[:, i])
        delta = (v[:, i] - kv_mem) * beta[:, i, None]
        state = state + k[:, i, :, None] * delta[:, None, :]
        out[:, i] = torch.einsum("hkv,hk->hv", state, q[:, i])
    return out, state


def _chunked(q, k, v, g, beta, state, chunk_size):
    """Chunked form over any leading batch dims: q,k [..., H, L, K], v [..., H, L, V],
    g/beta [..., H, L], state [..., H, K, V]; float32. Returns (o, final state)."""
    *lead, length, kd = q.shape
    vd = v.shape[-1]
    c = chunk_size
    pad = (-length) % c
    if pad:
        # Padding tokens have k = v = beta = 0 and g = 0: they neither decay nor write.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // c
    q = q.reshape(*lead, n, c, kd)
    k = k.reshape(*lead, n, c, kd)
    v = v.reshape(*lead, n, c, vd)
    g = g.reshape(*lead, n, c)
    beta = beta.reshape(*lead, n, c)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = g.cumsum(dim=-1)  # log of the decay from the chunk start to each position
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = prod of decays over (j, i], zero above the diagonal.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # The UT transform: T = (I + A)^-1 with A the strictly-lower part of (beta k) k^T * decay.
    # A is nilpotent, so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: log2(c) batched
    # matmuls instead of a triangular solve, which is slow for many small systems on CPU.
    neg_a = -torch.tril((k_beta @ k.transpose(-1, -2)) * decay, -1)
    inv = neg_a + torch.eye(c, dtype=q.dtype, device=q.device)
    power = neg_a
    for _ in range(max(0, (c - 1).bit_length() - 1)):
        power = power @ power
        inv = inv + inv @ power
    intra = (q @ k.transpose(-1, -2)) * decay
    u = inv @ v_beta
    w = inv @ (k_beta * cum.exp()[..., None])
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty(*lead, n, c, vd, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = u[..., i, :, :] - w[..., i, :, :] @ state
        out[..., i, :, :] = q_dec[..., i, :, :] @ state + intra[..., i, :, :] @ v_new
        state = state * chunk_decay[..., i, :, :] + k_dec[..., i, :, :].transpose(-1, -2) @ v_new
    return out.reshape(*lead, n * c, vd)[..., :length, :], state


def _chunked_one(q, k, v, g, beta, state, chunk_size):
    """One sequence in chunks; same shapes as ``_recurrent_one``."""
    return _chunked(q, k, v, g, beta, state, chunk_size)


def _run(one, q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state,
         scale, use_qk_l2norm, **kw):
    if q.shape != k.shape or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, K] and v {tuple(v.shape)} "
            "[T, H, V] with the same T and H (expand key heads to value heads first)"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state pool must be float32, got {state.dtype}")
    qsl = _as_list(query_start_loc)
    slots = _as_list(state_slots)
    init = _as_list(has_initial_state)
    o = torch.empty_like(v)
    for b, slot in enumerate(slots):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        # [L, H, X] -> [H, L, X] in float32
        qb, kb, vb = (x[start:end].float().transpose(0, 1) for x in (q, k, v))
        gb, bb = (x[start:end].float().t() for x in (g, beta))
        if use_qk_l2norm:
            qb, kb = _l2norm(qb), _l2norm(kb)
        qb = qb * scale
        s0 = state[slot].clone() if init[b] else torch.zeros_like(state[slot])
        ob, s1 = one(qb, kb, vb, gb, bb, s0, **kw)
        state[slot] = s1
        o[start:end] = ob.transpose(0, 1).to(v.dtype)
    return o


def gated_delta_rule_recurrent_ref(
    q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state, scale,
    use_qk_l2norm=True,
) -> torch.Tensor:
    """Token-by-token gated delta rule over a flattened varlen batch.

    * ``q``, ``k`` ``[T, H, K]`` (key heads already expanded to the ``H`` value heads),
      ``v`` ``[T, H, V]``, ``g`` (log-decay, <= 0) and ``beta`` ``[T, H]``.
    * ``state`` pool float32 ``[S, H, K, V]``; sequence ``b`` (rows
      ``query_start_loc[b]:query_start_loc[b+1]``) starts from ``state[state_slots[b]]``
      if ``has_initial_state[b]`` else zeros, and its final state is written back there.
    * q/k are l2-normalised (eps 1e-6) when ``use_qk_l2norm``; q is then multiplied by
      ``scale`` (HF: ``K ** -0.5``).

    Float32 throughout; returns ``o`` ``[T, H, V]`` in ``v``'s dtype. O(T * H * K * V).
    """
    return _run(_recurrent_one, q, k, v, g, beta, state, query_start_loc, state_slots,
                has_initial_state, scale, use_qk_l2norm)


def gated_delta_rule_chunked_ref(
    q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state, scale,
    use_qk_l2norm=True, chunk_size=64,
) -> torch.Tensor:
    """Same contract as :func:`gated_delta_rule_recurrent_ref`, computed in chunks.

    Each sequence is padded to a multiple of ``chunk_size``; within a chunk the updates
    are condensed by a triangular solve, across chunks the state is scanned.
    O(T * H * (chunk_size * (K + V) + K * V)).
    """
    return _run(_chunked_one, q, k, v, g, beta, state, query_start_loc, state_slots,
                has_initial_state, scale, use_qk_l2norm, chunk_size=chunk_size)


def gated_delta_rule_ref(
    q, k, v, g, beta, state, query_start_loc, state_slots, has_initial_state, scale,
    use_qk_l2norm=True, chunk_size=64,
) -> torch.Tensor:
    """The CPU path; same contract as :func:`gated_delta_rule_recurrent_ref`.

    Vectorised across sequences: all single-token runs (decodes) advance in one batched
    recurrent step; all longer runs are padded to a common length (padding tokens are
    inert) and go through the chunked form as one batch. Extra work is the padding,
    at most (B - 1) * max run length tokens.
    """
    qsl = _as_list(query_start_loc)
    slots = _as_list(state_slots)
    init = _as_list(has_initial_state)
    dev = q.device
    o = torch.empty_like(v)
    lens = [qsl[b + 1] - qsl[b] for b in range(len(slots))]
    for group in ([b for b, n in enumerate(lens) if n == 1], [b for b, n in enumerate(lens) if n > 1]):
        if not group:
            continue
        longest = max(lens[b] for b in group)
        # [n, longest] row indices into the step's tokens; T (one past the end) = inert padding.
        t = q.shape[0]
        idx = torch.full((len(group), longest), t, dtype=torch.long)
        for i, b in enumerate(group):
            idx[i, : lens[b]] = torch.arange(qsl[b], qsl[b + 1])
        idx = idx.to(dev)

        def padded(x):
            x = torch.cat([x.float(), x.new_zeros((1, *x.shape[1:]), dtype=torch.float32)])
            return x[idx].transpose(1, 2)  # [n, H, longest, ...]

        qb, kb, vb, gb, bb = (padded(x) for x in (q, k, v, g, beta))
        if use_qk_l2norm:
            qb, kb = _l2norm(qb), _l2norm(kb)
        qb = qb * scale
        dst = torch.tensor([slots[b] for b in group], device=dev)
        keep = torch.tensor([bool(init[b]) for b in group], device=dev)
        # where, not multiply: a fresh slot may hold anything, NaN included.
        s0 = torch.where(keep[:, None, None, None], state.index_select(0, dst), 0.0)
        if longest == 1:
            ob, s1 = _recurrent_one(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1),
                                    gb.flatten(0, 1), bb.flatten(0, 1), s0.flatten(0, 1))
            ob, s1 = ob.unflatten(0, qb.shape[:2]), s1.unflatten(0, qb.shape[:2])
        else:
            c = min(chunk_size, -(-longest // 16) * 16)
            ob, s1 = _chunked(qb, kb, vb, gb, bb, s0, c)
        state.index_copy_(0, dst, s1)
        ob = ob.transpose(1, 2)  # [n, longest, H, V]
        for i, b in enumerate(group):
            o[qsl[b]:qsl[b + 1]] = ob[i, : lens[b]].to(v.dtype)
    return o
