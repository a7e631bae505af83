"""The speculative-decoding half of :class:`~hybridserve.model.native_decode.NativeDecodeStep`
(issue 34): the MTP layer's passes (one pass, or a step's drafts in one call through
``_core.MtpDraftPlan``) and the commit's replay of the accepted rows (one call through
``_core.ReplayPlan``), each bit-identical to its module path. A mixin: it reads the
step's layer entries, buffers and GEMM kernels, which the step sets up."""

from __future__ import annotations

import numpy as np
import torch

from hybridserve.kernels import native
from hybridserve.model.native_buffers import DECODE_ROWS, _Buffers, _SpecProj, _view


class NativeSpecPasses:
    """MTP passes, drafts and the speculative commit on the native kernels (mixed into
    :class:`~hybridserve.model.native_decode.NativeDecodeStep`)."""

    def run_mtp(self, hidden: torch.Tensor, input_ids: torch.Tensor, batch, cache, vocab: int | None = None):
        """One MTP pass (:meth:`Qwen3_5ForServing.mtp_forward`'s contract) on the native
        kernels, the same kernels in the same order as the module path
        (:class:`~hybridserve.model.mtp.MultiTokenPredictor` with its attention as one
        decode query per row), so bit-identical to it: ``(logits, mtp_hidden)``, or
        ``None`` (nothing run) where that path must run: no MTP layer, more rows than
        the native GEMM takes, no per-row decode layout in ``batch.op_plans``."""
        m = self._mtp
        t = int(input_ids.shape[0])
        if m is None or cache.dtype != self.model.dtype or cache.mtp_layer_index is None:
            return None
        lay = batch.op_plans.get(DECODE_ROWS)
        if not 0 < t <= self.max_rows or lay is None or lay[1].shape[0] != t or input_ids.device.type != "cpu":
            return None
        self._bind_cache(cache)
        b, x = self._mtp_bufs(t)
        hidden = hidden.detach()
        if hidden.dtype != self.model.dtype or not hidden.is_contiguous():
            hidden = hidden.to(self.model.dtype).contiguous()
        self._mtp_pass(hidden, input_ids, b, x, self._attention_inputs(batch, b))
        return self._lm_head(b, batch.logits_indices, t, vocab), b.normed.clone()

    def _mtp_bufs(self, t: int):
        got = self._mtp_buffers.get(t)
        if got is None:
            with torch.inference_mode(False):
                dt, h = self.model.dtype, self.model.config.hidden_size
                extra = {name: torch.empty(t, w, dtype=dt) for name, w in (("emb", h), ("cat", 2 * h))}
                extra.update({name + "_np": _view(x) for name, x in list(extra.items())})
                extra["e_np"], extra["h_np"] = extra["cat_np"][:, :h], extra["cat_np"][:, h:]
                extra["e_norm_np"] = _view(torch.empty(t, h, dtype=dt))
                extra["h_norm_np"] = _view(torch.empty(t, h, dtype=dt))
                got = self._mtp_buffers[t] = (_Buffers(self.model, t), extra)
        return got

    def _mtp_pass(self, hidden: torch.Tensor, input_ids: torch.Tensor, b: _Buffers, x: dict, attn_args,
                  hidden_np: np.ndarray | None = None) -> None:
        """The MTP layer over ``t`` rows into ``b.normed`` (the layer's normed output),
        the kernels of :class:`~hybridserve.model.mtp.MultiTokenPredictor` in its order.
        ``hidden`` is read before ``b`` is written (so it may be ``b.normed`` itself)."""
        m = self._mtp
        eps, gemm, norm = self.eps, self.k_gemm, self.k_norm
        self._embed(input_ids, x["emb"])
        # [pre_fc_norm_embedding(embed) | pre_fc_norm_hidden(hidden)], then fc.
        h_np = _view(hidden) if hidden_np is None else hidden_np
        if input_ids.shape[0] == 1:
            # One row: the halves of ``cat`` are contiguous, the norms write them in place.
            norm(x["emb_np"], m["norm_e"], eps, x["e_np"], None, True)
            norm(h_np, m["norm_h"], eps, x["h_np"], None, True)
        else:
            norm(x["emb_np"], m["norm_e"], eps, x["e_norm_np"], None, True)
            norm(h_np, m["norm_h"], eps, x["h_norm_np"], None, True)
            x["e_np"][...] = x["e_norm_np"]
            x["h_np"][...] = x["h_norm_np"]
        gemm(x["cat_np"], m["fc"], b.residual_np)
        e = m["layer"]
        res, normed = b.residual_np, b.normed_np
        norm(res, e["in_norm"], eps, normed, None, True)
        self._attention(e, b, attn_args)
        norm(b.mixer_out_np, e["post_norm"], eps, normed, res, True)
        self._mlp(e, b)
        norm(b.mlp_out_np, m["norm"], eps, normed, res, True)

    def mtp_draft(self, hidden: torch.Tensor, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                  tables: np.ndarray, last: np.ndarray, steps: int, cache, vocab: int | None = None
                  ) -> np.ndarray | None:
        """The proposer's passes in one call, without a ForwardBatch per pass, where
        every drafting sequence drafts ``steps`` tokens.

        Pass 0 (the MTP prefill of a step's committed rows): ``R`` rows, row ``r`` fed
        ``hidden[r]`` and token ``input_ids[r]`` at ``positions[r]``, writing MTP KV slot
        ``slots[r]`` and attending as one decode query over positions ``0 ..
        positions[r]`` of its sequence's block-table row ``tables[r]`` (``[R, W]``), as
        :meth:`run_mtp` of that layout does. Its rows ``last`` (``n``, one per drafting
        sequence, the sequence's last row) give draft 1 and the state the chain starts
        from; pass ``j >= 1`` is one row per drafting sequence at the next position, fed
        the previous pass's state and draft. Drafts are the argmax over token ids below
        ``vocab`` (None: all). Returns them ``[steps, n]``, or ``None`` (nothing run)
        where :meth:`run_mtp` would refuse. The same kernels on the same inputs as
        :meth:`run_mtp` pass by pass, so the same drafts and MTP KV bits."""
        m = self._mtp
        t, n = int(input_ids.shape[0]), int(last.shape[0])
        dt = self._dtype
        if m is None or cache.dtype != dt or cache.mtp_layer_index is None:
            return None
        if not (0 < t <= self.max_rows and 0 < n <= t and steps >= 1) or hidden.device.type != "cpu":
            return None
        self._bind_cache(cache)
        hidden = hidden.detach()
        if hidden.dtype != dt or not hidden.is_contiguous():
            hidden = hidden.to(dt).contiguous()
        tables = np.ascontiguousarray(tables, dtype=np.int32)
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty((steps, n), dtype=np.int64)
        plan = self._fused_plan(cache)
        if plan is not None:
            # Every pass in one native call (the same kernels in the same order as below).
            cos, sin = self._rope_table(int(positions.max()) + steps + 1)
            rows = self.lm_head.shape[0]
            plan.draft(_view(hidden), np.ascontiguousarray(input_ids, dtype=np.int64), positions,
                       np.ascontiguousarray(slots, dtype=np.int64), tables,
                       np.ascontiguousarray(last, dtype=np.int64), steps, rows if vocab is None else min(vocab, rows),
                       cos, sin, out)
            return out
        b = self._mtp_rows(hidden, torch.from_numpy(np.asarray(input_ids, dtype=np.int64)), positions,
                           np.asarray(slots, dtype=np.int64), tables)
        every = t == n
        if every:
            sel_np, h = b.normed_np, b.normed
        else:
            last_t = torch.from_numpy(np.asarray(last, dtype=np.int64))
            h = b.normed.index_select(0, last_t)
            sel_np = _view(h)
        ids = self._draft_argmax(sel_np, n, vocab)
        out[0] = ids.numpy()
        if steps == 1:
            return out
        # (h may be b.normed of the next pass's row count: a pass reads its hidden input
        # before it writes normed.)
        pos = positions[last] if not every else positions
        tab = tables[last] if not every else tables
        # Every chained pass's positions, slots, lengths and rope rows at once.
        bs = cache.block_size
        p = pos[None, :] + np.arange(1, steps)[:, None]  # [steps - 1, n]
        slots_all = tab[np.arange(n)[None, :], p // bs].astype(np.int64) * bs + p % bs
        lens_all = p + 1
        cos_all, sin_all = self._cos_sin(p.reshape(-1))
        rows = self._qsl(n)[:n]
        b, x = self._mtp_bufs(n)
        for j in range(1, steps):
            r = slice((j - 1) * n, j * n)
            self._mtp_pass(h, ids, b, x, (cos_all[r], sin_all[r], slots_all[j - 1], rows, lens_all[j - 1], tab,
                                          None), hidden_np=None if j == 1 else b.normed_np)
            h = b.normed
            ids = self._draft_argmax(b.normed_np, n, vocab)
            out[j] = ids.numpy()
        return out

    def _fused_plan(self, cache):
        """The draft passes' native plan (``_core.MtpDraftPlan``) over this cache, or None
        where the Python passes must run: a quantized model or embedding, an MoE MTP
        layer, an older extension, or :attr:`fused_mtp` off."""
        got = self._plan
        if got is not None and got[0] is cache:
            return got[1]
        plan = None
        m = self._mtp
        e = m["layer"] if m is not None else None
        make = getattr(native._k, "MtpDraftPlan", None)
        if (self.fused_mtp and make is not None and e is not None and "moe" not in e and not self.quantized
                and self.embed_module is None and self.embed is not None and "kc" in e):
            plan = self._make_plan(make, m, e)
        self._plan = (cache, plan)
        return plan

    def _make_plan(self, make, m: dict, e: dict):
        c, dt, rows = self.model.config, self.model.dtype, self.max_rows
        h, nh, nkv, d = c.hidden_size, e["heads"], e["kv_heads"], e["head_dim"]
        qr, kvr = 2 * nh * d, nkv * d
        rot = self._rope_table(1)[0].shape[1]
        widths = {"emb": h, "e_norm": h, "h_norm": h, "hid": h, "cat": 2 * h, "residual": h, "normed": h,
                  "qkv": qr + 2 * kvr, "rq": nh * d, "rk": kvr, "attn": nh * d, "gated": nh * d, "mixer_out": h,
                  "gate_up": 2 * self.inter, "mlp_out": h, "cos": rot, "sin": rot,
                  "logits": self.lm_head.shape[0]}
        with torch.inference_mode(False):
            bufs = {k: torch.empty(rows, w, dtype=dt) for k, w in widths.items()}
            sig = torch.empty(rows, nh, d, dtype=dt)
        # The attention's sigmoid output gate, as _attention runs it (torch's ops and
        # rounding), on the plan's buffers: called back from the native passes.
        gate = bufs["qkv"][:, :qr].view(rows, nh, 2 * d)[..., d:]
        attn3, gated3 = bufs["attn"].view(rows, nh, d), bufs["gated"].view(rows, nh, d)
        views = [None] + [(gate[:t], sig[:t], attn3[:t], gated3[:t]) for t in range(1, rows + 1)]
        sigmoid, mul = torch.sigmoid, torch.mul

        def gate_fn(t: int) -> None:
            g, s, a, o = views[t]
            sigmoid(g, out=s)
            mul(a, s, out=o)

        weights = {"embed": _view(self.embed), "norm_e": m["norm_e"], "norm_h": m["norm_h"], "fc": m["fc"],
                   "in_norm": e["in_norm"], "post_norm": e["post_norm"], "out_norm": m["norm"], "qkv": e["qkv_w"],
                   "q_norm": e["q_norm"], "k_norm": e["k_norm"], "o": e["o_w"], "gate_up": e["gate_up"],
                   "down": e["down"], "head": self.lm_head}
        if not all(isinstance(w, np.ndarray) and w.flags.c_contiguous for w in weights.values()):
            return None
        dims = {"hidden": h, "heads": nh, "kv_heads": nkv, "head_dim": d, "inter": self.inter,
                "vocab": int(self.embed.shape[0]), "rot": rot, "eps": self.eps, "q_eps": e["q_eps"],
                "k_eps": e["k_eps"], "scale": e["scale"], "rows": rows}
        return make(weights, {k: _view(t) for k, t in bufs.items()}, e["kc"], e["vc"], dims, gate_fn, self.bf16)

    def _rope_table(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rope's cos and sin tables (numpy views) over at least positions 0 .. n-1."""
        tab = self._rope
        if tab is None or tab[0].shape[0] < n:
            self._cos_sin(np.array([n - 1]))
            tab = self._rope
        return tab[0], tab[1]

    def _mtp_rows(self, hidden: torch.Tensor, ids: torch.Tensor, p: np.ndarray, slots: np.ndarray,
                  tables: np.ndarray) -> _Buffers:
        """One MTP pass over rows that each attend as one decode query at position
        ``p[r]`` (their sequence's block-table row ``tables[r]``); returns the buffers
        (``normed``: the layer's output)."""
        t = int(p.shape[0])
        b, x = self._mtp_bufs(t)
        cos, sin = self._cos_sin(p)
        self._mtp_pass(hidden, ids, b, x, (cos, sin, slots, self._qsl(t)[:t], p + 1, tables, None))
        return b

    def _draft_argmax(self, sel_np: np.ndarray, n: int, vocab: int | None) -> torch.Tensor:
        """The argmax over the LM head's first ``vocab`` rows (None: all) of ``n`` rows:
        _lm_head's GEMM into a buffer, logits in the model's dtype (whose argmax is that
        of their float32 widening)."""
        head = self._head(vocab)
        key = (n, head.shape[0])
        got = self._widen.get(key)
        if got is None:
            with torch.inference_mode(False):
                lg = torch.empty(n, head.shape[0], dtype=self.model.dtype)
            got = self._widen[key] = (_view(lg), np.empty(lg.shape, dtype=np.uint32) if self.bf16 else None)
        lg_np, w = got
        self.k_gemm(sel_np, head, lg_np)
        if w is None:
            return torch.from_numpy(np.argmax(lg_np, axis=-1))
        # bfloat16 bits << 16 are the float32 of the same value (exact), and numpy's
        # argmax takes the first maximum (and the first NaN) as torch's does.
        np.left_shift(lg_np, 16, out=w, dtype=np.uint32)
        return torch.from_numpy(np.argmax(w.view(np.float32), axis=-1))

    def replay(self, ring: dict, sel: torch.Tensor | None, query_start_loc, state_pages, has_initial_state,
               cache) -> bool:
        """:meth:`Qwen3_5ForServing.commit_speculative`'s replay on the native kernels:
        every DeltaNet layer's conv and delta rule over the ring's rows ``sel`` (None:
        all of them), runs by ``query_start_loc`` over ``state_pages``, the same kernel
        calls on the same inputs as :meth:`GatedDeltaNet.replay`, so the state pages end
        bit-identical. False (nothing run) where that path must run."""
        if cache.dtype != self.model.dtype or not self._layers:
            return False
        self._bind_cache(cache)
        varlen = native.Varlen(query_start_loc, state_pages, has_initial_state)
        qsl, table, init = varlen.qsl, varlen.table, varlen.init
        n = int(qsl[-1])
        b = self._replay_buffers.get(n)
        if b is None:
            with torch.inference_mode(False):
                c, dt = self.model.config, self.model.dtype
                conv = _view(torch.empty(n, c.linear_conv_dim, dtype=dt))
                kd = c.linear_key_dim
                # z = 0: the state does not depend on the output gate (the output is dropped).
                b = self._replay_buffers[n] = (conv, conv[:, :kd], conv[:, kd:2 * kd], conv[:, 2 * kd:],
                                               _view(torch.empty(n, c.linear_value_dim, dtype=dt)),
                                               _view(torch.zeros(n, c.linear_value_dim, dtype=dt)))
        conv, q, k, v, out, z = b
        views = ring.get("np")
        if self.fused_replay and views and (sel is None or isinstance(sel, slice)):
            # The ring is the verify step's own in_proj buffers (every row speculative)
            # and the rows a prefix of them: every layer in one native call.
            plan = self._replay_plan(next(iter(views.values()))[0].shape[0])
            if plan is not None:
                plan.run(n, qsl, table, init)
                return True
        for e in self._layers:
            if e["attn"]:
                continue
            if views is not None and (sel is None or isinstance(sel, slice)):
                # (A prefix of the rows: a view of the ring's views.)
                m_np, ba_np = views[e["idx"]]
                if sel is not None:
                    m_np, ba_np = m_np[sel], ba_np[sel]
            else:
                mixed, ba = ring[e["idx"]]
                if isinstance(sel, slice):
                    mixed, ba = mixed[sel], ba[sel]
                elif sel is not None:
                    mixed, ba = mixed.index_select(0, sel), ba.index_select(0, sel)
                m_np, ba_np = _view(mixed), _view(ba)
            hv = e["value_heads"]
            self.k_conv(m_np, e["conv_w"], None, e["conv_pool"], qsl, table, init, conv,
                        item_base=e["conv_base"], silu=True)
            self.k_rule(q, k, v, e["rec_pool"], qsl, table, init, out, item_base=e["rec_base"],
                        key_heads=e["key_heads"], value_heads=hv, scale=e["scale"], l2norm=True,
                        norm_eps=e["norm_eps"], a=ba_np[:, hv:], b=ba_np[:, :hv], a_log=e["a_log"],
                        dt_bias=e["dt_bias"], z=z, norm_weight=e["norm_w"])
        return True

    def _replay_plan(self, t: int):
        """The commit's replay of a ``t``-row verify step in one native call
        (``_core.ReplayPlan``): every DeltaNet layer's ring buffer (:meth:`_spec_proj`),
        conv weight, gate parameters and state pools of the bound cache, bound once. The
        same conv and delta-rule kernels on the same inputs as the per-layer calls of
        :meth:`replay`, so the same state bits. None (the per-layer calls) with an older
        extension or an array the plan cannot bind in place."""
        if t in self._replay_plans:
            return self._replay_plans[t]
        make = getattr(native._k, "ReplayPlan", None)
        plan = None
        if make is not None:
            c, dt = self.model.config, self.model.dtype
            cd, vd = c.linear_conv_dim, c.linear_value_dim
            projs = self._spec_proj(t)
            layers = [dict(ring=projs[e["idx"]].proj_np, mixed_col=0, ba_col=cd + vd, conv_w=e["conv_w"],
                           conv_pool=e["conv_pool"], conv_base=e["conv_base"], rec_pool=e["rec_pool"],
                           rec_base=e["rec_base"], a_log=e["a_log"], dt_bias=e["dt_bias"],
                           key_heads=e["key_heads"], value_heads=e["value_heads"], scale=e["scale"])
                      for e in self._layers if not e["attn"]]
            dense = ("ring", "conv_w", "a_log", "dt_bias")
            if layers and all(isinstance(x[k], np.ndarray) and x[k].flags.c_contiguous for x in layers
                              for k in dense):
                with torch.inference_mode(False):
                    conv = _view(torch.empty(t, cd, dtype=dt))
                    out = _view(torch.empty(t, vd, dtype=dt))
                plan = make(layers, conv, out, self.bf16)
        self._replay_plans[t] = plan
        return plan

    def _spec_proj(self, t: int) -> dict:
        """Per DeltaNet layer, a ``t``-row in_proj output buffer with its column views (the
        ring of a verify step whose rows are all speculative)."""
        got = self._spec_projs.get(t)
        if got is None:
            c, dt = self.model.config, self.model.dtype
            cd, vd, hv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
            got = {}
            with torch.inference_mode(False):
                for e in self._layers:
                    if e["attn"]:
                        continue
                    pb = _SpecProj()
                    proj = torch.empty(t, cd + vd + 2 * hv, dtype=dt)
                    p = pb.proj_np = _view(proj)
                    pb.ring_mixed, pb.ring_ba = proj[:, :cd], proj[:, cd + vd:]
                    pb.mixed_np, pb.z_np, pb.ba_np = p[:, :cd], p[:, cd:cd + vd], p[:, cd + vd:]
                    pb.b_np, pb.a_np = p[:, cd + vd:cd + vd + hv], p[:, cd + vd + hv:]
                    got[e["idx"]] = pb
            self._spec_projs[t] = got
        return got
