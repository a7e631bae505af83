"""A decode step of the model (dense or MoE) on the CPU's native kernels, without per-op Python.

At one sequence the model's decode step is a few dozen small kernel calls per layer,
and before this path most of the time outside the GEMMs was the Python around them,
not the kernels: module calls, dtype checks, ``torch.split``/``torch.empty`` and a
fresh numpy view of every tensor for every call (about 450 views per step at the
0.1B bench shape), some 5 ms of a ~27 ms bfloat16 step against well under 1 ms of
kernel work (benches/RESULTS.md, issue 22's one-sequence section).

:class:`NativeDecodeStep` runs the same kernels in the same order on the same
tensors as :meth:`Qwen3_5ForServing.forward`'s module path, so its logits and the
state it leaves are bit-identical to that path's (``tests/model/test_native_decode.py``
checks both, and the HF fidelity tests run through it on every decode step). What it
saves is the glue: every weight's, parameter's and cache pool's numpy view is made
once, the activations live in buffers allocated once per row count with their views
(column ranges of the fused projections included), the per-step host arrays are built
once per step, and each layer is a straight run of native calls.

It takes pure-decode steps (every scheduled sequence one token) of a dense model on
the CPU in float32 or bfloat16, up to the row count where :class:`Projection` still
uses the native GEMM (so the GEMM choice is the module path's), and the same for
speculative decoding (issue 34): verify steps whose speculative runs (1 + d rows each)
sit next to one-token decodes (the DeltaNet kernels read those runs' state without
writing it and the step's ring records their inputs, as the module path does; every
row attends as one decode query, on both paths: :data:`DECODE_ROWS`), the MTP layer's
passes (:meth:`NativeDecodeStep.run_mtp`; :meth:`NativeDecodeStep.mtp_draft` runs a step's
passes in one call from host arrays, for the proposer: one native call, ``_core.MtpDraftPlan``,
where the MTP layer is dense and unquantized, else pass by pass) and the replay that commits the accepted rows
(:meth:`NativeDecodeStep.replay`), each bit-identical to its module path
(``tests/spec/test_spec_verify_commit.py``, ``tests/spec/test_mtp_model.py``; those methods live in
:mod:`hybridserve.model.native_spec`, the buffers in :mod:`hybridserve.model.native_buffers`); everything else
(prefill, mixed steps, biases, a weight not in the row-major layout, tensor
parallelism or any forward hook, ``HYBRIDSERVE_NO_NATIVE``) takes the module path.

An MoE model's sparse blocks (:class:`~hybridserve.model.moe.SparseMoeBlock`) run as
their module, called on the step's buffer: that module is already one native call for
the routed experts (and the shared expert) on every CPU form of the weights (float32's
``moe_block``, bfloat16's ``moe_block_bf16``, a GGUF's ``quant_experts``), with its own
checks and caches, so calling it keeps the step bit-identical to the module path while
the rest of the layer (norms, mixers) runs as native calls without the glue.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from hybridserve.kernels import native
from hybridserve.model.layers import Projection
from hybridserve.model.moe import SparseMoeBlock
from hybridserve.model.native_buffers import _BF16, DECODE_ROWS, _Buffers, _view  # noqa: F401 (DECODE_ROWS: re-exported)
from hybridserve.model.native_spec import NativeSpecPasses
from hybridserve.model.quant_gemm import QuantGemm, quant_matmul_kernel


def _hooked(modules) -> bool:
    """Any forward (pre-)hook on these modules or on every module: the module path
    would run it, this path cannot."""
    from torch.nn.modules import module as mm

    if mm._global_forward_hooks or mm._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)




# The key of ``ForwardBatch.op_plans`` under which the :class:`NativeDecodeStep` that ran
# the batch's forward lies: the step's commit and drafts run on it without checking the
# weights' views again (they were checked for this step).
NATIVE_STEP = "native_step"


def decode_rows_layout(batch, expand) -> None:
    """Put the layout of :func:`rows_as_decodes` (sequences with ``expand[b]`` as decodes)
    into ``batch.op_plans[DECODE_ROWS]``."""
    dev = batch.input_ids.device
    if dev.type == "cpu":
        # (Host tensors: from numpy arrays, several times cheaper than torch.tensor of a list.)
        qsl = batch.host_query_start_loc()
        q_e, l_e, s_e = rows_as_decodes(qsl, batch.host_seq_lens(), expand)
        tables = batch.block_tables if len(s_e) == batch.block_tables.shape[0] and s_e == list(range(len(s_e))) \
            else batch.block_tables.index_select(0, torch.from_numpy(np.array(s_e, dtype=np.int64)))
        batch.op_plans[DECODE_ROWS] = (torch.from_numpy(np.array(q_e, dtype=np.int32)),
                                       torch.from_numpy(np.array(l_e, dtype=np.int32)), tables)
        return
    qsl = batch.host_query_start_loc()
    q_e, l_e, s_e = rows_as_decodes(qsl, batch.host_seq_lens(), expand)
    tables = batch.block_tables if s_e == list(range(len(s_e))) and len(s_e) == batch.block_tables.shape[0] \
        else batch.block_tables.index_select(0, torch.tensor(s_e, dtype=torch.long, device=dev))
    batch.op_plans[DECODE_ROWS] = (torch.tensor(q_e, dtype=torch.int32, device=dev),
                                   torch.tensor(l_e, dtype=torch.int32, device=dev), tables)


def rows_as_decodes(qsl, seq_lens, expand) -> tuple[list[int], list[int], list[int]]:
    """An attention layout where the sequences with ``expand[b]`` become one decode query
    per row: row ``j`` of an ``n``-row run sees ``seq_lens[b] - (n-1-j)`` positions (the
    causal mask of the run, as decodes). Returns ``(query_start_loc, seq_lens, seq)``
    of the entries, ``seq[i]`` the sequence whose block-table row entry ``i`` reads."""
    q_e, l_e, s_e = [0], [], []
    for b, length in enumerate(seq_lens):
        n = qsl[b + 1] - qsl[b]
        if expand[b]:
            for j in range(n):
                q_e.append(q_e[-1] + 1)
                l_e.append(length - (n - 1 - j))
                s_e.append(b)
        else:
            q_e.append(q_e[-1] + n)
            l_e.append(length)
            s_e.append(b)
    return q_e, l_e, s_e


def _served(proj):
    """What a projection is served from: its quantized weight, else its weight."""
    return proj.weight if proj.qweight is None else proj.qweight


class NativeDecodeStep(NativeSpecPasses):
    """The decode step of one :class:`Qwen3_5ForServing` over one cache (see the module
    docstring). Built lazily by the model, which asks :meth:`takes` before each step
    and rebuilds it when it is no longer :meth:`current`; :attr:`ok` False (a weight
    the native GEMM does not read in place) sends every step to the module path."""

    def __init__(self, model):
        self.model = model
        c = model.config
        self.bf16 = model.dtype == _BF16
        k = native._k
        sfx = "_bf16" if self.bf16 else ""
        self.k_norm, self.k_conv = getattr(k, "rms_norm" + sfx), getattr(k, "causal_conv1d" + sfx)
        self.k_rule, self.k_rope = getattr(k, "gated_delta_rule" + sfx), getattr(k, "qk_norm_rope" + sfx)
        self.k_attn = getattr(k, "paged_attention_decode" + sfx)
        self.k_gemm = k.matmul_bf16 if self.bf16 else k.matmul_rows
        # A quantized checkpoint: its projections' entries are QuantGemm objects, and
        # every product goes through _gemm (a float weight's view still to k_gemm).
        self.quantized = any(getattr(m, "qweight", None) is not None for m in model.modules())
        self._float_gemm = self.k_gemm
        if self.quantized:
            self.k_gemm = self._gemm
        self._quant_matmul = quant_matmul_kernel()
        # mtp_draft runs every pass in one native call where it can (off: the Python
        # passes, the same kernels call by call; tests compare the two).
        self.fused_mtp = not os.environ.get("HYBRIDSERVE_NO_FUSED_MTP")
        # replay runs every DeltaNet layer in one native call where it can (off: a conv
        # and a delta-rule call per layer, the same kernels; tests compare the two).
        self.fused_replay = not os.environ.get("HYBRIDSERVE_NO_FUSED_REPLAY")
        self._dtype = model.dtype  # (the model's is a property that walks its parameters)
        self.k_silu_mul, self.k_write_kv = k.silu_mul, k.write_kv
        self.max_rows = Projection.NATIVE_MAX_ROWS_BF16 if self.bf16 else Projection.NATIVE_MAX_ROWS
        self.eps = c.rms_norm_eps
        self.inter = c.intermediate_size
        self._buffers: dict[int, _Buffers] = {}
        self._aranges: dict[int, torch.Tensor] = {}
        self._qsls: dict[int, np.ndarray] = {}
        self._cache = None
        # Rope's cos/sin of positions 0 .. n-1 (numpy views, grown on demand): a step's
        # rows are looked up, not computed (cos_sin is elementwise per position, so a
        # row of the table has the bits cos_sin gives that position in any batch).
        self._rope: tuple | None = None
        # The verify steps' per-layer in_proj outputs (row count -> layer -> buffers):
        # the ring is views of them, no copy (see :meth:`_spec_proj`).
        self._spec_projs: dict[int, dict] = {}
        # Per (rows, draft vocabulary): a draft pass's logits buffer (numpy view) and, in
        # bfloat16, the float32 widening its argmax reads (numpy's argmax, the same
        # first-maximum rule as torch's, several times faster than torch's on bfloat16).
        self._widen: dict[tuple, tuple] = {}
        # The GEMM weights (Parameters) and where their memory was when the views were
        # made: a re-layout (``weight.data = ...``) moves it, and :meth:`current` sees that.
        self._modules = list(model.modules())
        # Every module's hook dicts (registering a hook adds to them in place): checked
        # on every call, in C, not module by module.
        self._hook_dicts = [d for m in self._modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        owners = list(self._weight_owners())
        self._weights = [_served(p) for p in owners]
        self._fingerprint = self._weights_fingerprint()
        # Every GEMM weight [out, in] row-major in the model's dtype, no bias: the
        # module path's Projection runs the same native kernel on it (a quantized
        # one: QuantGemm runs its parts as its linear does).
        self.ok = all(p.bias is None and (
            p.weight.dtype == model.dtype and p.weight.is_contiguous() if p.qweight is None
            else self._quant_matmul is not None and QuantGemm.supports(p.qweight, model.dtype)) for p in owners)
        self._layers = self._build_layers() if self.ok else []

    @staticmethod
    def applies_to(model) -> bool:
        """Whether this path can serve the model at all (CPU, float32 or bfloat16, dense
        or MoE, no attention biases, the native kernels loaded, the model's own module classes
        and no forward hooks: tensor parallelism swaps in vocabulary-parallel embedding
        and LM head classes and sums each mixer's and MLP's output in hooks, none of
        which this path would run)."""
        # (An embedding kept in a quantized checkpoint's blocks has ``qweight``.)
        if (type(model.embed_tokens) is not nn.Embedding and getattr(model.embed_tokens, "qweight", None) is None) \
                or type(model.lm_head) is not Projection:
            return False
        if _hooked(model.modules()):
            return False
        # A quantized checkpoint's projections (Projection.qweight) need the native
        # block GEMM (_core.kernels.quant_matmul).
        if quant_matmul_kernel() is None and any(getattr(m, "qweight", None) is not None
                                                 for m in model.modules()):
            return False
        c = model.config
        if not native.available() or model.device.type != "cpu" or model.dtype not in (torch.float32, _BF16):
            return False
        # (A model without layers has no residual stream to add: the module path's case.)
        return not bool(c.raw.get("attention_bias", False)) and len(model.layers) > 0

    def _weight_owners(self):
        m = self.model
        for layer in m.layers:
            if layer.is_attention:
                yield layer.self_attn.qkv_proj
                yield layer.self_attn.o_proj
            else:
                yield layer.linear_attn.in_proj
                yield layer.linear_attn.out_proj
            # (A sparse MoE block runs as its module: not a GEMM of this path's.)
            if not isinstance(layer.mlp, SparseMoeBlock):
                yield layer.mlp.gate_up_proj
                yield layer.mlp.down_proj
        if m.mtp is not None:
            ml = m.mtp.layers[0]
            yield from (m.mtp.fc, ml.self_attn.qkv_proj, ml.self_attn.o_proj)
            if not isinstance(ml.mlp, SparseMoeBlock):
                yield from (ml.mlp.gate_up_proj, ml.mlp.down_proj)
        yield m.lm_head

    def _weights_fingerprint(self) -> list[int]:
        return [w.data_ptr() if isinstance(w, torch.Tensor) else id(w) for w in self._weights]

    def _gemm(self, x: np.ndarray, w, out: np.ndarray) -> None:
        """A quantized model's products: a float weight's view to the float kernel, a
        quantized one's QuantGemm."""
        if isinstance(w, np.ndarray):
            self._float_gemm(x, w, out)
        else:
            w(x, out)

    def _entry(self, proj) -> np.ndarray | QuantGemm:
        """A projection's GEMM entry: its weight's view, or a QuantGemm of its qweight."""
        if proj.qweight is None:
            return _view(proj.weight)
        return QuantGemm(proj.qweight, self.model.dtype, self._float_gemm, self._quant_matmul)

    def current(self) -> bool:
        """The views still describe the model's weights (none was moved or re-laid out)
        and no module got a forward hook since they were made."""
        from torch.nn.modules import module as mm

        return (self._fingerprint == self._weights_fingerprint() and _served(self.model.lm_head) is self._weights[-1]
                and not any(self._hook_dicts) and not mm._global_forward_hooks
                and not mm._global_forward_pre_hooks)

    def _layer_entry(self, layer) -> dict:
        entry = self._entry
        e = {"attn": layer.is_attention,
                 "in_norm": _view(layer.input_layernorm.weight),
                 "post_norm": _view(layer.post_attention_layernorm.weight)}
        if isinstance(layer.mlp, SparseMoeBlock):
            e["moe"] = layer.mlp
        else:
            e.update(gate_up=entry(layer.mlp.gate_up_proj), down=entry(layer.mlp.down_proj))
        if layer.is_attention:
            a = layer.self_attn
            e.update(idx=a.layer_idx, qkv_w=entry(a.qkv_proj), o_w=entry(a.o_proj),
                     heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim, scale=a.scale,
                     q_norm=_view(a.q_norm.weight), k_norm=_view(a.k_norm.weight),
                     q_eps=a.q_norm.eps, k_eps=a.k_norm.eps)
        else:
            d = layer.linear_attn
            e.update(idx=d.layer_idx, in_w=entry(d.in_proj), out_w=entry(d.out_proj),
                     conv_w=_view(d.conv1d.weight[:, 0, :]), a_log=_view(d.A_log), dt_bias=_view(d.dt_bias),
                     norm_w=_view(d.norm.weight), norm_eps=d.norm.eps, key_heads=d.num_k_heads,
                     value_heads=d.num_v_heads, scale=d.head_k_dim ** -0.5)
        return e

    def _build_layers(self) -> list[dict]:
        m = self.model
        layers = [self._layer_entry(layer) for layer in m.layers]
        self._mtp = None
        if m.mtp is not None:
            t = m.mtp
            self._mtp = {"layer": self._layer_entry(t.layers[0]), "fc": self._entry(t.fc),
                         "norm_e": _view(t.pre_fc_norm_embedding.weight),
                         "norm_h": _view(t.pre_fc_norm_hidden.weight), "norm": _view(t.norm.weight)}
        self._mtp_buffers: dict[int, tuple[_Buffers, dict]] = {}
        # The draft passes' native plan and the cache it was bound to (see _fused_plan).
        self._plan = None
        self._replay_buffers: dict[int, tuple] = {}
        # The commit's native replay plans (verify row count -> plan or None), bound to
        # the cache of _bind_cache (cleared when it changes).
        self._replay_plans: dict[int, object] = {}
        self.final_norm = _view(m.norm.weight)
        self.lm_head = self._entry(m.lm_head)
        self._draft_heads: dict[int, QuantGemm] = {}
        # A quantized embedding: its module looks the rows up (dequantized).
        self.embed = getattr(m.embed_tokens, "weight", None)
        self.embed_module = m.embed_tokens if getattr(m.embed_tokens, "qweight", None) is not None else None
        self._embed_blocks = self._embed_rows_source()
        return layers

    def _embed_rows_source(self):
        """A quantized embedding held as one GGML block tensor in the model's dtype:
        ``(qweight, its blocks' numpy view, type id, dequantize kernel)``, so a step's
        rows are picked and dequantized in two calls into the step's buffer (the kernel
        the module's ``embedding`` runs, on the same rows: the same bits); else None
        (the module runs)."""
        mod = self.embed_module
        q = getattr(mod, "qweight", None)
        dq = getattr(native._k, "quant_dequantize", None)
        if q is None or dq is None or getattr(mod, "dtype", None) != self.model.dtype:
            return None
        data, ty = getattr(q, "data", None), getattr(getattr(q, "type", None), "ggml_id", None)
        if ty is None or not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2 \
                or not data.is_contiguous() or data.device.type != "cpu" or getattr(q, "embedding", None) is None:
            return None
        return q, data.numpy(), int(ty), dq

    def _bind_cache(self, cache) -> None:
        if self._cache is cache:
            return
        mtp = [self._mtp["layer"]] if self._mtp is not None and cache.mtp_layer_index is not None else []
        for e in self._layers + mtp:
            if e["attn"]:
                kc, vc = cache.kv(e["idx"])
                e["kc"], e["vc"] = _view(kc), _view(vc)
            else:
                st = cache.state(e["idx"])
                e["conv_pool"], e["conv_base"] = _view(st.conv_pool), int(st.conv_item_base)
                e["rec_pool"], e["rec_base"] = _view(st.recurrent_pool), int(st.recurrent_item_base)
        self._replay_plans = {}
        self._cache = cache

    def takes(self, batch) -> bool:
        """A step of at most :attr:`max_rows` rows where every row is a decode query: a
        pure-decode step (every sequence one token), or a speculative verify step whose
        other sequences are one-token decodes (:meth:`run` checks the layout the model's
        ``_open_ring`` made: one attention entry per row)."""
        t = batch.input_ids.shape[0]
        if not (0 < t <= self.max_rows and batch.input_ids.device.type == "cpu"):
            return False
        return batch.seq_lens.shape[0] == t if batch.spec_ring is None else True

    def run(self, batch, cache) -> torch.Tensor | None:
        """The step's float32 logits ``[S, vocab]`` for ``batch.logits_indices``; the
        caches and states advance as the module path leaves them. ``None`` (nothing
        run) when a sequence schedules other than one token: the module path's step."""
        if cache.dtype != self.model.dtype:
            # The native kernels read and write the cache in the model's dtype; a cache
            # of another kv_cache_dtype is the module path's (it converts per layer).
            return None
        t = int(batch.input_ids.shape[0])
        ring = batch.spec_ring
        if ring is None:
            varlen = native.Varlen(batch.query_start_loc, batch.state_pages, batch.has_initial_state,
                                   batch.checkpoint_positions, batch.checkpoint_pages)
            if not np.array_equal(varlen.qsl, self._qsl(t)):
                return None
        else:
            # Speculative runs (several rows each) next to one-token decodes: every row
            # one attention entry, else a prefill chunk is in the step (module path).
            lay = batch.op_plans.get(DECODE_ROWS)
            if lay is None or lay[1].shape[0] != t:
                return None
            varlen = native.Varlen(batch.query_start_loc, batch.state_pages, batch.has_initial_state,
                                   batch.checkpoint_positions, batch.checkpoint_pages, batch.speculative)
        self._bind_cache(cache)
        b = self._buffers.get(t)
        if b is None:
            # Normal tensors, not inference tensors: the runner steps under inference
            # mode, other callers under no_grad only, and both write these buffers.
            with torch.inference_mode(False):
                b = self._buffers[t] = _Buffers(self.model, t)
        # Checkpoints, and with speculative runs their read-only flags.
        ck = varlen.writes
        qsl, table, init = varlen.qsl, varlen.table, varlen.init
        eps, gemm, norm = self.eps, self.k_gemm, self.k_norm
        self._embed(batch.input_ids, b.residual)
        res, normed = b.residual_np, b.normed_np
        attn_args = None
        ring_views = ring_np = None
        if ring is not None and ring.get("all"):
            ring_views = self._spec_proj(t)
            ring_np = ring["np"] = {}
        first = True
        for e in self._layers:
            if first:
                norm(res, e["in_norm"], eps, normed, None, True)
                first = False
            else:
                norm(b.mlp_out_np, e["in_norm"], eps, normed, res, True)
            if e["attn"]:
                if attn_args is None:
                    attn_args = self._attention_inputs(batch, b)
                self._attention(e, b, attn_args)
            else:
                if ring_views is not None:
                    # Every row is a speculative row: this layer's in_proj output goes to
                    # its own buffer, and the ring is views of it (valid until the next
                    # verify step of this row count; the commit reads it before).
                    pb = ring_views[e["idx"]]
                    gemm(normed, e["in_w"], pb.proj_np)
                    ring[e["idx"]] = (pb.ring_mixed, pb.ring_ba)
                    ring_np[e["idx"]] = (pb.mixed_np, pb.ba_np)
                else:
                    pb = b
                    gemm(normed, e["in_w"], b.proj_np)
                    if ring is not None:
                        rows_r = ring["rows"]
                        ring[e["idx"]] = (b.ring_mixed.index_select(0, rows_r), b.ring_ba.index_select(0, rows_r))
                self.k_conv(pb.mixed_np, e["conv_w"], None, e["conv_pool"], qsl, table, init, b.conv_np,
                            item_base=e["conv_base"], silu=True, **ck)
                self.k_rule(b.q_np, b.k_np, b.v_np, e["rec_pool"], qsl, table, init, b.rule_out_np,
                            item_base=e["rec_base"], key_heads=e["key_heads"], value_heads=e["value_heads"],
                            scale=e["scale"], l2norm=True, norm_eps=e["norm_eps"], a=pb.a_np, b=pb.b_np,
                            a_log=e["a_log"], dt_bias=e["dt_bias"], z=pb.z_np, norm_weight=e["norm_w"], **ck)
                gemm(b.rule_out_np, e["out_w"], b.mixer_out_np)
            norm(b.mixer_out_np, e["post_norm"], eps, normed, res, True)
            self._mlp(e, b)
        # The last residual add and the final norm, row-wise (so every row, then the
        # sampled ones: the same values as selecting first), then the LM head.
        norm(b.mlp_out_np, self.final_norm, eps, normed, res, True)
        # Every row's post-norm state (the MTP's input): valid until the next step of
        # this row count overwrites the buffer; the model copies it out when asked.
        self.last_hidden = b.normed
        return self._lm_head(b, batch.logits_indices, t)

    def _mlp(self, e: dict, b: _Buffers) -> None:
        """The layer's MLP from ``b.normed`` into ``b.mlp_out``: the dense SwiGLU's two
        GEMMs, or the sparse MoE block's module (see the module docstring)."""
        moe = e.get("moe")
        if moe is not None:
            b.mlp_out.copy_(moe(b.normed))
            return
        self.k_gemm(b.normed_np, e["gate_up"], b.gate_up_np)
        self.k_silu_mul(b.gate_up_np, self.inter)
        self.k_gemm(b.act_np, e["down"], b.mlp_out_np)

    def _embed(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if self.embed_module is None:
            torch.index_select(self.embed, 0, ids, out=out)
            return
        src = self._embed_blocks
        if src is not None and self.embed_module.qweight is src[0] and ids.device.type == "cpu":
            blocks = src[1]
            i = ids.numpy()
            # (Ids out of range: the module's IndexError.)
            if i.ndim == 1 and i.size and 0 <= i.min() and i.max() < blocks.shape[0]:
                src[3](blocks[i], src[2], _view(out))
                return
        out.copy_(self.embed_module(ids))

    def _head(self, vocab: int | None):
        """The LM head's GEMM operand, or its first ``vocab`` rows (a reduced draft vocabulary)."""
        if vocab is None:
            return self.lm_head
        if isinstance(self.lm_head, QuantGemm):
            head = self._draft_heads.get(vocab)
            if head is None:
                head = self._draft_heads[vocab] = self.lm_head.rows(vocab)
            return head
        return self.lm_head[:vocab]

    def _lm_head(self, b: _Buffers, rows: torch.Tensor, t: int, vocab: int | None = None) -> torch.Tensor:
        """float32 logits of ``rows`` of ``b.normed`` (of token ids below ``vocab`` only:
        the LM head's first rows, a reduced draft vocabulary)."""
        head = self._head(vocab)
        if rows.shape[0] == t and bool((rows == self._arange(t)).all()):
            sel, sel_np = b.normed, b.normed_np
        else:
            sel = b.normed.index_select(0, rows)
            sel_np = _view(sel)
        if self.bf16:
            if sel is b.normed and vocab is None:
                self.k_gemm(sel_np, head, b.logits_np)
                return b.logits.float()
            logits = torch.empty(sel.shape[0], head.shape[0], dtype=_BF16)  # (QuantGemm has .shape too)
            self.k_gemm(sel_np, head, _view(logits))
            return logits.float()
        logits = torch.empty(sel.shape[0], head.shape[0], dtype=torch.float32)
        self.k_gemm(sel_np, head, logits.numpy())
        return logits

    def _cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rope's cos and sin rows of ``positions`` in the model's dtype (numpy, bfloat16
        as bits): rows of a table of :meth:`RotaryEmbedding.cos_sin` over 0 .. n-1."""
        n = int(positions.max()) + 1 if positions.size else 0
        tab = self._rope
        if tab is None or tab[0].shape[0] < n:
            size = max(n, 2 * tab[0].shape[0] if tab is not None else 1024)
            with torch.inference_mode(False):
                cos, sin = self.model.rotary.cos_sin(torch.arange(size), self.model.dtype)
            tab = self._rope = (_view(cos), _view(sin), cos, sin)
        return tab[0][positions], tab[1][positions]

    def _qsl(self, t: int) -> np.ndarray:
        """``query_start_loc`` of ``t`` one-token sequences."""
        a = self._qsls.get(t)
        if a is None:
            a = self._qsls[t] = np.arange(t + 1, dtype=np.int64)
        return a

    def _arange(self, t: int) -> torch.Tensor:
        a = self._aranges.get(t)
        if a is None:
            a = self._aranges[t] = torch.arange(t)
        return a

    def _attention_inputs(self, batch, b: _Buffers):
        """What every attention layer of the step shares: rope's cos/sin, the cache
        slots, and the decode kernel's rows, lengths and block tables."""
        t = b.residual.shape[0]
        # (An MTP pass has no speculative runs: its layout is in op_plans alone.)
        cos, sin = self._cos_sin(batch.positions.numpy())
        lay = batch.op_plans.get(DECODE_ROWS)
        if lay is None:
            lens, tables = batch.seq_lens, batch.block_tables
        else:
            # One decode query per row (row j of an n-row run sees seq_len - (n-1-j)
            # positions), as the module path's attention runs such a step.
            _, lens, tables = lay
        if tables.dtype != torch.int32 or not tables.is_contiguous():
            tables = tables.to(torch.int32).contiguous()
        return (cos, sin, batch.slot_mapping.numpy().astype(np.int64, copy=False),
                self._qsl(t)[:t], lens.numpy().astype(np.int64), tables.numpy(), tables)

    def _attention(self, e: dict, b: _Buffers, args) -> None:
        cos, sin, slots, rows, lens, tables, _keep = args
        d = e["head_dim"]
        self.k_gemm(b.normed_np, e["qkv_w"], b.qkv_np)
        self.k_rope(b.qg_np, e["heads"], 2 * d, e["q_norm"], e["q_eps"], cos, sin, b.rq_np)
        self.k_rope(b.kx_np, e["kv_heads"], d, e["k_norm"], e["k_eps"], cos, sin, b.rk_np)
        self.k_write_kv(b.rk_np, b.vx_np, slots, e["kc"], e["vc"])
        self.k_attn(b.rq_np, e["kc"], e["vc"], rows, lens, tables, e["scale"], b.attn_np)
        # The sigmoid output gate, rounded as the module path's torch ops round it.
        torch.sigmoid(b.gate, out=b.sig)
        torch.mul(b.attn3, b.sig, out=b.gated3)
        self.k_gemm(b.gated_np, e["o_w"], b.mixer_out_np)
