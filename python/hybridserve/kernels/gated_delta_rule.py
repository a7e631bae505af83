"""Gated delta rule (Gated DeltaNet's token mixer) over paged state: the references.

Per head, with state ``S`` ``[K, V]`` (float32) and, for each token,
``q, k`` ``[K]`` (l2-normalised, q scaled by ``scale``), ``v`` ``[V]``, log-decay ``g``
and write strength ``beta``::

    S   <- exp(g) * S
    S   <- S + k (beta * (v - S^T k))^T      # the delta rule: write only the correction
    o    = S^T q

Two formulations with the same result (up to float rounding): a token-by-token
recurrence and HF's chunked form (UT transform per chunk of ``chunk_size`` tokens, a
scan across chunks). The two ``*_ref`` functions apply them one sequence at a time
and follow ``transformers``' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule``: they are the obvious oracles. :func:`gated_delta_rule_cpu`
is the CPU path: the same formulas batched across a step's sequences without padding
them to a common length (decodes in one recurrent step, longer runs chunked per run),
tested against the references on random mixed batches.

State is addressed through the state page table (:mod:`hybridserve.kernels.state_pages`):
the pool is ``[num_pages, per_page, K, V]`` float32, value head ``h`` of sequence ``b``
is item ``item_base + h`` of its row of ``state_pages``.
"""

from __future__ import annotations

import torch

from hybridserve.kernels.state_pages import as_list, check_pool, item_coords


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


def _run(one, q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state,
         scale, use_qk_l2norm, item_base, checkpoint_positions, checkpoint_pages, **kw):
    if q.shape != k.shape or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, K] and v {tuple(v.shape)} "
            "[T, H, V] with the same T and H (expand key heads to value heads first)"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state pool must be float32, got {state.dtype}")
    h = v.shape[1]
    check_pool(state, (q.shape[2], v.shape[2]), "recurrent state")
    qsl = as_list(query_start_loc)
    init = as_list(has_initial_state)
    ckpt = as_list(checkpoint_positions) or [-1] * len(init)
    pages, within = item_coords(torch.as_tensor(state_pages), item_base, h, state.shape[1])
    if checkpoint_pages is not None:
        ck_pages, _ = item_coords(torch.as_tensor(checkpoint_pages), item_base, h, state.shape[1])
    o = torch.empty_like(v)
    for b in range(len(init)):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        # [L, H, X] -> [H, L, X] in float32
        qb, kb, vb = (x[start:end].float().transpose(0, 1) for x in (q, k, v))
        gb, bb = (x[start:end].float().t() for x in (g, beta))
        if use_qk_l2norm:
            qb, kb = _l2norm(qb), _l2norm(kb)
        qb = qb * scale
        s0 = state[pages[b], within[b]].clone() if init[b] else state.new_zeros(h, *state.shape[2:])
        c = ckpt[b]
        if c >= 0:
            if not 1 <= c <= end - start:
                raise ValueError(f"checkpoint position {c} of sequence {b} must lie in 1..{end - start}")
            # To the checkpoint, store it, then on from it: the same arithmetic as one pass.
            oa, s0 = one(qb[:, :c], kb[:, :c], vb[:, :c], gb[:, :c], bb[:, :c], s0, **kw)
            state[ck_pages[b], within[b]] = s0
            o[start:start + c] = oa.transpose(0, 1).to(v.dtype)
            start, qb, kb, vb, gb, bb = start + c, qb[:, c:], kb[:, c:], vb[:, c:], gb[:, c:], bb[:, c:]
            if start == end:
                state[pages[b], within[b]] = s0
                continue
        ob, s1 = one(qb, kb, vb, gb, bb, s0, **kw)
        state[pages[b], within[b]] = s1
        o[start:end] = ob.transpose(0, 1).to(v.dtype)
    return o


def gated_delta_rule_recurrent_ref(
    q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, scale,
    use_qk_l2norm=True, *, item_base, checkpoint_positions=None, checkpoint_pages=None,
) -> torch.Tensor:
    """Token-by-token gated delta rule over a flattened varlen batch.

    * ``q``, ``k`` ``[T, H, K]`` (key heads already expanded to the ``H`` value heads),
      ``v`` ``[T, H, V]``, ``g`` (log-decay, <= 0) and ``beta`` ``[T, H]``.
    * ``state`` pool float32 ``[num_pages, per_page, K, V]``; sequence ``b`` (rows
      ``query_start_loc[b]:query_start_loc[b+1]``) keeps value head ``h`` at item
      ``item_base + h`` of ``state_pages[b]`` (:mod:`hybridserve.kernels.state_pages`):
      it starts from there if ``has_initial_state[b]`` else from zeros, and its final
      state is written back there.
    * ``checkpoint_positions[b] = c >= 1``: the state after the run's first ``c`` tokens
      is also written at the same items of ``checkpoint_pages[b]``.
    * q/k are l2-normalised (eps 1e-6) when ``use_qk_l2norm``; q is then multiplied by
      ``scale`` (HF: ``K ** -0.5``).

    Float32 throughout; returns ``o`` ``[T, H, V]`` in ``v``'s dtype. O(T * H * K * V).
    """
    return _run(_recurrent_one, q, k, v, g, beta, state, query_start_loc, state_pages,
                has_initial_state, scale, use_qk_l2norm, item_base, checkpoint_positions, checkpoint_pages)


def gated_delta_rule_chunked_ref(
    q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, scale,
    use_qk_l2norm=True, chunk_size=64, *, item_base, checkpoint_positions=None, checkpoint_pages=None,
) -> torch.Tensor:
    """Same contract as :func:`gated_delta_rule_recurrent_ref`, computed in chunks.

    Each sequence is padded to a multiple of ``chunk_size``; within a chunk the updates
    are condensed by a triangular solve, across chunks the state is scanned.
    O(T * H * (chunk_size * (K + V) + K * V)).
    """
    return _run(_chunked_one, q, k, v, g, beta, state, query_start_loc, state_pages,
                has_initial_state, scale, use_qk_l2norm, item_base, checkpoint_positions, checkpoint_pages,
                chunk_size=chunk_size)


# ----------------------------------------------------------------------------- CPU path
# Chunk length of the CPU path. Measured side by side (1 thread, 7 runs of 290 tokens,
# 8 value heads): 16 tokens took 20 / 55 / 132 ms at K = V = 32 / 64 / 128, 64 tokens
# 52 / 111 / 164 ms (the c^2 intra-chunk terms dominate on CPU); one 2,048-token run
# costs about the same at 16, 32 or 64.
CPU_CHUNK = 16

class _Phase:
    """One pass over the step's runs (see :class:`DeltaRulePlan`): run ``b`` is rows
    ``starts[b] .. starts[b] + lens[b]``."""

    def __init__(self, starts, lens, init, chunk_size, device):
        import numpy as np

        def t(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=device)

        def fresh_of(sel):
            """Positions (within ``sel``) of runs starting from zeros; None when none do."""
            pos = np.nonzero(~init[sel])[0]
            return t(pos) if len(pos) else None

        dec = np.nonzero(lens == 1)[0]
        self.decode = None
        if len(dec):
            self.decode = (t(starts[dec]), t(dec), fresh_of(dec))
        self.groups = []
        multi = np.nonzero(lens > 1)[0]
        if len(multi):
            c_of = np.minimum(chunk_size, -(-lens[multi] // 16) * 16)
            for c in np.unique(c_of):
                c = int(c)
                seqs = multi[c_of == c]
                nch = -(-lens[seqs] // c)
                order = np.argsort(-nch, kind="stable")
                seqs, nch = seqs[order], nch[order]
                # chunk-index-major: all first chunks, then all second chunks, ...
                ii, jj = np.nonzero(np.arange(int(nch[0]))[:, None] < nch[None, :])
                counts = np.bincount(ii).tolist()
                tok = starts[seqs[jj]][:, None] + ii[:, None] * c + np.arange(c)[None, :]
                valid = tok < (starts + lens)[seqs[jj]][:, None]
                flat_valid = np.nonzero(valid.ravel())[0]
                self.groups.append({
                    "c": c,
                    "counts": counts,
                    # padding tokens read row 0 (any finite row); g and beta are zeroed there
                    "rows": t(np.where(valid, tok, 0).ravel()),
                    "pad": None if valid.all() else torch.as_tensor(~valid, device=device),
                    "out_pos": t(flat_valid),
                    "out_rows": t(tok.ravel()[flat_valid]),
                    "seqs": t(seqs),
                    "fresh": fresh_of(seqs),
                })


class DeltaRulePlan:
    """How one step's runs are laid out for :func:`gated_delta_rule_cpu`; depends only on
    the step's lengths, fresh flags and checkpoint positions, so it is built once and
    shared by every DeltaNet layer of the step.

    * Single-token runs (decodes) advance in one batched recurrent step.
    * Longer runs are cut into chunks of ``c = min(chunk_size, len rounded up to 16)``
      tokens; runs sharing a ``c`` form one group. Only a run's own last chunk is padded
      (inert tokens), never to the longest run of the step. Inside a group, runs are
      sorted by chunk count, longest first, and chunks are stored chunk-index-major,
      so scan step ``i`` advances the first ``counts[i]`` runs over contiguous rows.
    * A step with checkpoints goes in two phases: every checkpointed run's first ``c``
      tokens, the checkpoint copies, then the rest of every run. Runs without a
      checkpoint are all in the second phase, so the work stays one pass per token.
    """

    def __init__(self, query_start_loc, has_initial_state, chunk_size: int = CPU_CHUNK,
                 device: torch.device | str = "cpu", checkpoint_positions=None):
        import numpy as np

        qsl = np.asarray(_as_list(query_start_loc), dtype=np.int64)
        init = np.asarray(_as_list(has_initial_state), dtype=bool)
        starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
        self.num_tokens = int(qsl[-1]) if len(qsl) else 0
        ckpt = None if checkpoint_positions is None else np.asarray(_as_list(checkpoint_positions), dtype=np.int64)
        self.checkpoint_seqs = None
        if ckpt is None or not (ckpt >= 0).any():
            self.phases = [_Phase(starts, lens, init, chunk_size, device)]
            return
        bad = np.nonzero((ckpt >= 0) & ((ckpt < 1) | (ckpt > lens)))[0]
        if len(bad):
            b = int(bad[0])
            raise ValueError(f"checkpoint position {int(ckpt[b])} of sequence {b} must lie in 1..{int(lens[b])}")
        first = np.where(ckpt >= 0, ckpt, 0)
        self.phases = [_Phase(starts, first, init, chunk_size, device),
                       _Phase(starts + first, lens - first, init | (first > 0), chunk_size, device)]
        self.checkpoint_seqs = torch.as_tensor(np.nonzero(ckpt >= 0)[0], dtype=torch.long, device=device)


def _decode_step(q, k, v, g, beta, state, at, rows, seqs, fresh, o):
    """One recurrent step for every decode at once; q/k ``[T, Hk, K]`` (normalised, q
    scaled), v ``[T, H, V]``; key head j serves value heads ``j*rep .. j*rep+rep-1``."""
    n = rows.shape[0]
    hk, kd = q.shape[1], q.shape[2]
    h, vd = v.shape[1], v.shape[2]
    rep = h // hk
    qd = q.index_select(0, rows).view(n, hk, 1, 1, kd)
    kk = k.index_select(0, rows).view(n, hk, 1, 1, kd)
    vv = v.index_select(0, rows).float().view(n, hk, rep, 1, vd)
    decay = g.index_select(0, rows).float().exp().view(n, hk, rep, 1, 1)
    b = beta.index_select(0, rows).float().view(n, hk, rep, 1, 1)
    pages, within = at[0].index_select(0, seqs), at[1].index_select(0, seqs)
    s = state[pages, within].view(n, hk, rep, kd, vd)
    if fresh is not None:
        s.index_fill_(0, fresh, 0.0)
    s.mul_(decay)
    delta = (vv - kk @ s) * b  # the correction to write, [n, Hk, rep, 1, V]
    s.add_(kk.transpose(-1, -2) * delta)
    o.index_copy_(0, rows, (qd @ s).view(n, h, vd).to(o.dtype))
    state[pages, within] = s.view(n, h, kd, vd)


def _chunk_group(q, k, v, g, beta, state, at, grp, o):
    """Chunked form over one group of runs (see :class:`DeltaRulePlan`)."""
    c, rows = grp["c"], grp["rows"]
    nc = rows.shape[0] // c
    hk, kd = q.shape[1], q.shape[2]
    h, vd = v.shape[1], v.shape[2]
    rep = h // hk
    # [N, Hk, 1, c, K] for the key-head tensors, [N, Hk, rep, c, X] for value-head ones.
    qc = q.index_select(0, rows).view(nc, c, hk, 1, kd).permute(0, 2, 3, 1, 4)
    kc = k.index_select(0, rows).view(nc, c, hk, 1, kd).permute(0, 2, 3, 1, 4)
    vc = v.index_select(0, rows).float().view(nc, c, hk, rep, vd).permute(0, 2, 3, 1, 4)
    gc = g.index_select(0, rows).float().view(nc, c, h)
    bc = beta.index_select(0, rows).float().view(nc, c, h)
    if grp["pad"] is not None:
        # Inert padding: no decay (g = 0) and no write (beta = 0).
        pad = grp["pad"][..., None]
        gc = gc.masked_fill(pad, 0.0)
        bc = bc.masked_fill(pad, 0.0)
    gc = gc.view(nc, c, hk, rep).permute(0, 2, 3, 1)  # [N, Hk, rep, c]
    bc = bc.view(nc, c, hk, rep).permute(0, 2, 3, 1)
    cum = gc.cumsum(-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    kkt = kc @ kc.transpose(-1, -2)  # per key head: shared by its value heads
    # The UT transform: u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta k exp(cum)) with A the
    # strictly-lower part of (beta_i k_i . k_j) * decay. One unit-lower triangular solve
    # for both right-hand sides: c^2 (K + V) per chunk and head, against c^3 log c for the
    # inverse (solve_triangular reads only the strict lower triangle here).
    a = kkt * decay * bc[..., :, None]
    ecum = cum.exp()
    rhs = torch.cat([vc * bc[..., None], (kc * (bc * ecum)[..., None])], dim=-1)
    uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :vd], uw[..., vd:]
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_dec = qc * ecum[..., None]
    k_dec_t = (kc * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # [N, Hk, rep, K, c]
    chunk_decay = ecum[..., -1, None, None]
    pages, within = at[0].index_select(0, grp["seqs"]), at[1].index_select(0, grp["seqs"])
    s = state[pages, within].view(-1, hk, rep, kd, vd)
    if grp["fresh"] is not None:
        s.index_fill_(0, grp["fresh"], 0.0)
    out = torch.empty(nc, hk, rep, c, vd, dtype=torch.float32, device=q.device)
    # Contiguous operands: the elementwise results above keep the permuted layout of
    # their inputs, and every scan step would otherwise copy its slices again.
    u, w, q_dec, intra, k_dec_t = (x.contiguous() for x in (u, w, q_dec, intra, k_dec_t))
    at = 0
    for m in grp["counts"]:  # scan across chunk indices; step i moves the m runs that have one
        r = slice(at, at + m)
        si = s[:m]
        v_new = u[r] - w[r] @ si
        out[r] = q_dec[r] @ si + intra[r] @ v_new
        s[:m] = si * chunk_decay[r] + k_dec_t[r] @ v_new
        at += m
    state[pages, within] = s.view(-1, h, kd, vd)
    flat = out.permute(0, 3, 1, 2, 4).reshape(nc * c, h, vd)
    o.index_copy_(0, grp["out_rows"], flat.index_select(0, grp["out_pos"]).to(o.dtype))


def gated_delta_rule_cpu(
    q, k, v, g, beta, state, query_start_loc, state_pages, has_initial_state, scale,
    use_qk_l2norm=True, chunk_size=CPU_CHUNK, plan: DeltaRulePlan | None = None, *, item_base,
    checkpoint_positions=None, checkpoint_pages=None,
) -> torch.Tensor:
    """The CPU path; same contract as :func:`gated_delta_rule_recurrent_ref`, except that
    ``q``/``k`` may also have ``Hk`` heads dividing ``H`` (key head ``j`` serves value
    heads ``j*H/Hk ..``, HF's ``repeat_interleave``), read without expanding them.

    Decodes take one batched recurrent step; longer runs go through the chunked form per
    :class:`DeltaRulePlan` (pass one to share it across layers; it must have been built
    with the same checkpoint positions). Work is proportional to the step's tokens (plus
    at most one partial chunk per run and checkpoint), whatever the mix.
    """
    if q.shape != k.shape or q.shape[0] != v.shape[0] or v.shape[1] % q.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, Hk, K] and v {tuple(v.shape)} "
            "[T, H, V] with the same T and H a multiple of Hk"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state pool must be float32, got {state.dtype}")
    h = v.shape[1]
    check_pool(state, (q.shape[2], v.shape[2]), "recurrent state")
    if plan is None:
        plan = DeltaRulePlan(query_start_loc, has_initial_state, chunk_size, q.device, checkpoint_positions)
    at = item_coords(torch.as_tensor(state_pages, device=q.device), item_base, h, state.shape[1])
    o = torch.empty_like(v)
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    for i, phase in enumerate(plan.phases):
        if i == 1:  # the checkpointed runs stopped at their checkpoint: copy their state
            cs = plan.checkpoint_seqs
            ck, _ = item_coords(torch.as_tensor(checkpoint_pages, device=q.device), item_base, h, state.shape[1])
            within = at[1].index_select(0, cs)
            state[ck.index_select(0, cs), within] = state[at[0].index_select(0, cs), within]
        if phase.decode is not None:
            _decode_step(q, k, v, g, beta, state, at, *phase.decode, o)
        for grp in phase.groups:
            _chunk_group(q, k, v, g, beta, state, at, grp, o)
    return o
