"""Qwen3.5 hybrid decoder (full attention + Gated DeltaNet) for serving.

Numerically follows ``transformers``' ``Qwen3_5ForCausalLM`` (the oracle in tests),
reorganised for a flattened varlen batch: there is no batch dimension, every
sequence's rows are contiguous, attention reads the paged KV cache and DeltaNet
layers read and write their sequence's state pages (all in one arena).

Projections that read the same input are fused into one GEMM each: the MLP's
gate+up (``gate_up_proj``), attention's q(+gate)/k/v (``qkv_proj``) and DeltaNet's
four input projections (``in_proj``). Checkpoints keep HF's separate tensors: each
fused module maps every HF name to a row range of its weight
(:meth:`Qwen3_5ForServing.checkpoint_tensors`), which the loader fills in place, and
``load_state_dict`` accepts HF names too (a pre-hook concatenates them).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.config import FULL_ATTENTION, ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.kernels import native, ops
from hybridserve.model.batch import ForwardBatch
from hybridserve.memory.layout import arena_layout
from hybridserve.model.cache import HybridCache, dtype_name, resolve_dtype
from hybridserve.model.hugepages import huge_page_copy, transposed_copy
from hybridserve.model.layers import MLP, GatedRMSNorm, Projection, ZeroCenteredRMSNorm, _Fused
from hybridserve.model.moe import SparseMoeBlock
from hybridserve.model.mtp import MultiTokenPredictor
from hybridserve.model.native_decode import DECODE_ROWS, NATIVE_STEP, NativeDecodeStep, decode_rows_layout


class RotaryEmbedding:
    """Partial rotary (first ``rotary_dim`` channels, half-split layout). Text-only
    positions, so HF's multimodal rope sections collapse to ordinary rope."""

    def __init__(self, config: ModelConfig):
        self.rotary_dim = config.rotary_dim
        self.theta = config.rope_theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
            inv = (1.0 / (self.theta ** exps)).to(positions.device)
            self._inv_freq[positions.device] = inv
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[T, H, D]``, cos/sin ``[T, rotary_dim]``."""
        r = cos.shape[-1]
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([x_rot, x_pass], dim=-1)


class Attention(_Fused, nn.Module):
    """Gated GQA attention over the paged cache (q/k norm, partial rope, sigmoid gate)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim ** -0.5
        bias = bool(c.raw.get("attention_bias", False))
        # HF's q_proj yields the query and the output gate interleaved per head:
        # [q_h | gate_h]; kept so in the fused rows, followed by k_proj's and v_proj's.
        self.q_rows = c.num_attention_heads * c.head_dim * 2
        self.kv_rows = c.num_key_value_heads * c.head_dim
        self.qkv_proj = Projection(c.hidden_size, self.q_rows + 2 * self.kv_rows, bias=bias)
        self._init_fused("qkv_proj", [("q_proj", self.q_rows), ("k_proj", self.kv_rows),
                                      ("v_proj", self.kv_rows)])
        self.o_proj = Projection(c.num_attention_heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: HybridCache):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qr, kvr = self.q_rows, self.kv_rows
        qg = qkv[:, :qr].view(t, self.num_heads, 2 * self.head_dim)
        gate = qg[..., self.head_dim:]
        v = qkv[:, qr + kvr:].view(t, self.num_kv_heads, self.head_dim)
        if qkv.is_contiguous() and (native.usable(qkv, cos, sin, self.q_norm.weight, self.k_norm.weight)
                                    or native.usable_bf16(qkv, cos, sin, self.q_norm.weight, self.k_norm.weight)):
            # One pass per tensor instead of ~15 ops: norm each head, then rope.
            q = native.qk_norm_rope(qkv[:, :qr], self.num_heads, 2 * self.head_dim, self.q_norm.weight,
                                    self.q_norm.eps, cos, sin)
            k = native.qk_norm_rope(qkv[:, qr:qr + kvr], self.num_kv_heads, self.head_dim,
                                    self.k_norm.weight, self.k_norm.eps, cos, sin)
        else:
            q = self.q_norm(qg[..., : self.head_dim])
            k = self.k_norm(qkv[:, qr:qr + kvr].view(t, self.num_kv_heads, self.head_dim))
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
        k_cache, v_cache = cache.kv(self.layer_idx)
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        # A speculative step's runs (and a short MTP pass's) attend as one decode query
        # per row: the native decode step's attention, bit for bit.
        lay = batch.op_plans.get(DECODE_ROWS)
        qsl, lens, tables = (batch.query_start_loc, batch.seq_lens, batch.block_tables) if lay is None else lay
        o = ops.paged_attention(q.contiguous(), k_cache, v_cache, qsl, lens, tables, self.scale,
                                plans=batch.op_plans)
        o = (o.view(t, self.num_heads, self.head_dim) * torch.sigmoid(gate)).view(t, -1)
        return self.o_proj(o)


class GatedDeltaNet(_Fused, nn.Module):
    """Gated DeltaNet token mixer over paged state (causal conv1d + gated delta rule)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_k_heads = c.linear_num_key_heads
        self.num_v_heads = c.linear_num_value_heads
        self.head_k_dim = c.linear_key_head_dim
        self.head_v_dim = c.linear_value_head_dim
        self.key_dim = c.linear_key_dim
        self.value_dim = c.linear_value_dim
        self.conv_dim = c.linear_conv_dim
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        hv = self.num_v_heads
        self.in_proj = Projection(c.hidden_size, self.conv_dim + self.value_dim + 2 * hv, bias=False)
        self._init_fused("in_proj", [("in_proj_qkv", self.conv_dim), ("in_proj_z", self.value_dim),
                                     ("in_proj_b", hv), ("in_proj_a", hv)])
        # Depthwise conv weight kept in the checkpoint's [C, 1, W] shape.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, c.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = Projection(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x, batch: ForwardBatch, cache: HybridCache):
        proj = self.in_proj(x)
        mixed, z, b, a = torch.split(
            proj, [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        ring = batch.spec_ring
        read_only = None
        if ring is not None:
            # Speculative runs: their state is read, not written; what a replay of their
            # accepted rows needs goes to the step's ring (see
            # Qwen3_5ForServing.commit_speculative): the conv's inputs and the gates' b, a
            # (adjacent columns of the projection), only those runs' rows.
            read_only = batch.speculative
            rows = ring["rows"]
            ring[self.layer_idx] = (mixed.index_select(0, rows),
                                    proj[:, self.conv_dim + self.value_dim:].index_select(0, rows))
        ck = dict(checkpoint_positions=batch.checkpoint_positions, checkpoint_pages=batch.checkpoint_pages,
                  read_only=read_only)
        o = self._mix(mixed, z, b, a, batch.query_start_loc, batch.state_pages, batch.has_initial_state,
                      cache, batch.op_plans, ck)
        return self.out_proj(o)

    def _mix(self, mixed, z, b, a, query_start_loc, state_pages, has_initial_state, cache, plans, ck):
        """Conv, gates, delta rule and gated output norm over ``[T, *]`` inputs (column
        ranges allowed); returns ``[T, value_dim]`` for the output projection."""
        t = mixed.shape[0]
        # The layer's state: items of the arena's pools, found through each sequence's
        # state page table row (state_pages) from the layer's first item.
        st = cache.state(self.layer_idx)
        mixed = ops.causal_conv1d(mixed, self.conv1d.weight[:, 0, :], None, st.conv_pool,
                                  query_start_loc, state_pages, has_initial_state, "silu", plans=plans,
                                  item_base=st.conv_item_base, **ck)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # float32 on the CPU: gates, delta rule and output norm in one native kernel.
        o = ops.gated_delta_net_mixer(
            q, k, v, a, b, self.A_log, self.dt_bias, z, self.norm.weight, self.norm.eps, st.recurrent_pool,
            query_start_loc, state_pages, has_initial_state, self.head_k_dim ** -0.5,
            key_heads=self.num_k_heads, value_heads=self.num_v_heads, item_base=st.recurrent_item_base,
            plans=plans, **ck)
        if o is not None:
            return o
        # Key head j serves value heads j*rep .. j*rep+rep-1 (HF's repeat_interleave); the
        # op reads the grouped heads directly.
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b)
        # In float32: in fp16 exp(A_log) could overflow.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = ops.gated_delta_rule(q, k, v, g, beta, st.recurrent_pool, query_start_loc,
                                 state_pages, has_initial_state,
                                 self.head_k_dim ** -0.5, True, plans=plans,
                                 item_base=st.recurrent_item_base, **ck)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return o.reshape(t, self.value_dim)

    def replay(self, mixed, ba, query_start_loc, state_pages, has_initial_state, cache, plans) -> None:
        """Advance the state pages over rows recorded by a speculative forward: ``mixed``
        the conv inputs ``[R, conv_dim]``, ``ba`` the gate inputs ``[R, 2 H]`` (b then a)
        of the accepted rows, runs by ``query_start_loc``. The same kernels as the
        forward, so the state is what decoding those rows would leave; the output
        (computed against a zero gate ``z``: the state does not depend on it) is dropped."""
        hv = self.num_v_heads
        z = mixed.new_zeros(mixed.shape[0], self.value_dim)
        self._mix(mixed, z, ba[:, :hv], ba[:, hv:], query_start_loc, state_pages, has_initial_state, cache,
                  plans, {})


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_attention = config.layer_types[layer_idx] == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = Attention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        if config.is_moe:
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch, cache):
        """``x``: the previous layer's output (the embeddings for the first layer, with
        ``residual`` None); returns this layer's output and the residual stream before
        it. The residual adds are fused into the norms that follow them."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        if self.is_attention:
            x = self.self_attn(x, cos, sin, batch, cache)
        else:
            x = self.linear_attn(x, batch, cache)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


def _check_supported(config: ModelConfig) -> None:
    """ConfigError for shapes or options this implementation does not compute."""
    act = config.raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; Qwen3.5 uses 'silu'")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.rotary_dim % 2 or config.rotary_dim > config.head_dim:
        raise ConfigError(
            f"rotary dim {config.rotary_dim} (head_dim x partial_rotary_factor) must be even and "
            f"at most head_dim {config.head_dim}"
        )
    if config.linear_conv_kernel_dim < 2:
        raise ConfigError("linear_conv_kernel_dim must be at least 2")


# Per row count n: (query_start_loc of n one-row entries, 0 .. n-1), the read-only
# index tensors of a batch-1 verify step's layout (see Qwen3_5ForServing._open_ring).
_ONE_RUN: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _one_run_layout(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    got = _ONE_RUN.get(n)
    if got is None:
        with torch.inference_mode(False):
            got = _ONE_RUN[n] = (torch.arange(n + 1, dtype=torch.int32), torch.arange(n, dtype=torch.int64))
    return got


class Qwen3_5ForServing(nn.Module):
    """The whole decoder plus LM head; one call = one step of the flattened batch.

    Parameters are named as in a ``Qwen3_5ForCausalLM`` checkpoint without the leading
    ``model.`` (``embed_tokens.weight``, ``layers.3.self_attn.q_proj.weight``, ...,
    ``norm.weight``, ``lm_head.weight``). With ``tie_word_embeddings`` the LM head is
    the embedding matrix (one Parameter, absent from :meth:`checkpoint_shapes`).
    """

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", mtp: bool = False):
        super().__init__()
        _check_supported(config)
        self.config = config
        dtype = resolve_dtype(dtype)
        with torch.device(device):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Projection(config.hidden_size, config.vocab_size, bias=False)
            # The MTP layer (speculative decoding's drafter): parameters ``mtp.*`` as the
            # checkpoints name them; its attention is cache layer num_hidden_layers.
            self.mtp = MultiTokenPredictor(config, self._mtp_decoder_layer(config)) if mtp else None
        self.tie_weights()
        self.rotary = RotaryEmbedding(config)
        self.to(dtype)
        self.requires_grad_(False)
        self.eval()

    @staticmethod
    def _mtp_decoder_layer(config: ModelConfig) -> DecoderLayer:
        """The MTP's decoder layer: the trunk's layer shape as full attention (an MoE
        block in an MoE model), its K/V at cache layer index ``num_hidden_layers``."""
        one = dataclasses.replace(config, num_hidden_layers=1, layer_types=(FULL_ATTENTION,))
        layer = DecoderLayer(one, 0)
        layer.self_attn.layer_idx = config.num_hidden_layers
        return layer

    def tie_weights(self) -> None:
        """Make the LM head the embedding matrix when the config ties them (again after
        ``to_empty``, which gives each module its own new tensor)."""
        # (A quantized model's tied head serves from the embedding's blocks instead:
        # see hybridserve.quant.gguf.load.)
        if self.config.tie_word_embeddings and isinstance(self.embed_tokens, nn.Embedding) \
                and self.lm_head.qweight is None:
            self.lm_head.weight = self.embed_tokens.weight

    def store_cpu_layout(self) -> None:
        """CPU layout of the projections, after loading.

        Dense projections (float32 and bfloat16) stay ``[out, in]`` as checkpoints store
        them: the native few-row kernels read each output's weight row contiguously, so
        a lone sequence's decode streams every weight at memory rate (benches/gemv.py:
        1.6-3.9x the column-major kernel's GB/s at one row; at 16 rows faster on every
        0.8B-shape GEMM, mixed at 0.1B's, where the 152K-row LM head is 0.86x; see
        benches/RESULTS.md), MKL reads that layout for long chunks as fast as the
        transposed one, and a tied LM head is the embedding table as it is (no second
        copy, row gathers).

        Each dense weight moves into huge-page memory
        (:func:`hybridserve.model.hugepages.huge_page_copy`). A float32 MoE block's router
        and shared expert are stored transposed instead (same values and shape, strides
        ``(1, out)``): the fused MoE kernel runs them on the column-major few-row GEMM
        with the routed experts."""
        with torch.no_grad():
            in_moe = set()
            for block in self.modules():
                if isinstance(block, SparseMoeBlock):
                    for m in block.modules():
                        if isinstance(m, nn.Linear) and m.weight is not None and m.weight.dtype != torch.bfloat16:
                            m.weight.data = transposed_copy(m.weight.data)
                            in_moe.add(m)
            for m in self.modules():
                # (A quantized projection's weight is None: its blocks stay as loaded.)
                if isinstance(m, nn.Linear) and m not in in_moe and m.weight is not None:
                    m.weight.data = huge_page_copy(m.weight.data)

    def new_cache(self, num_pages: int, block_size: int) -> HybridCache:
        """A zeroed :class:`HybridCache` arena of ``num_pages`` pages in this model's dtype
        and on its device; with the MTP layer loaded, every KV page also holds its K/V
        (one more attention layer's block, ``cache.mtp_k_cache`` / ``mtp_v_cache``)."""
        layout = arena_layout(self.config, block_size, dtype_name(self.dtype),
                              extra_attention_layers=1 if self.mtp is not None else 0)
        return HybridCache(self.config, layout, num_pages, self.dtype, self.device)

    # The final norm's weight: always a float parameter in the model's dtype, where the
    # embedding may be kept in a quantized checkpoint's blocks.
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a checkpoint must provide (local HF names) -> the parameter, or the
        rows of a fused parameter, that holds it (a view: copying into it loads it)."""
        out: dict[str, torch.Tensor] = {}
        fused = {name: m for name, m in self.named_modules() if isinstance(m, _Fused)}
        for prefix, m in fused.items():
            out.update({f"{prefix}.{k}": v for k, v in m.hf_views().items()})
        for name, p in self.named_parameters(remove_duplicate=True):
            parent, _, pleaf = name.rpartition(".")
            owner, _, leaf = parent.rpartition(".")
            # A fused Linear's weight (owner.gate_up_proj.weight) or a fused parameter
            # held directly (the experts' owner.gate_up_proj).
            if owner in fused and leaf in fused[owner].fused_param_names():
                continue
            if parent in fused and pleaf in fused[parent].fused_param_names():
                continue
            out[name] = p
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def checkpoint_aliases(self) -> dict[str, tuple[torch.Tensor, list[str]]]:
        """Tensors a checkpoint may carry instead of several of :meth:`checkpoint_tensors`:
        HF's fused 3-D expert tensors (``layers.N.mlp.experts.gate_up_proj`` ...) -> (the
        parameter to fill, the per-expert names it covers)."""
        out: dict[str, tuple[torch.Tensor, list[str]]] = {}
        for prefix, m in self.named_modules():
            views = getattr(m, "fused_views", None)
            if views is not None:
                for name, (t, covered) in views().items():
                    out[f"{prefix}.{name}"] = (t, [f"{prefix}.{c}" for c in covered])
        return out

    def expert_load(self) -> float | None:
        """Routing imbalance of the last step: over the MoE layers, the most rows any
        one expert received divided by the mean rows per expert (1.0 = perfectly
        even). None for a dense model or before the first step."""
        worst = None
        for layer in self.layers:
            m = getattr(layer.mlp, "last_max_load", None)
            if m is None:
                continue
            worst = m if worst is None else max(worst, m)
        self._moe_rows = getattr(self, "_moe_rows", 0)
        if worst is None or not self._moe_rows:
            return None
        c = self.config
        return float(worst) * c.num_experts / (self._moe_rows * c.num_experts_per_tok)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must provide (local HF names), with its shape."""
        return {name: tuple(t.shape) for name, t in self.checkpoint_tensors().items()}

    # Decode steps on the CPU's native kernels without the module path's per-op Python
    # (see hybridserve.model.native_decode); False turns it off (side-by-side benches;
    # HYBRIDSERVE_NO_NATIVE_DECODE=1 for a whole process, e.g. a server).
    native_decode = os.environ.get("HYBRIDSERVE_NO_NATIVE_DECODE", "") not in ("1", "true", "yes")

    def _native_decode_for(self, batch: ForwardBatch):
        """The :class:`NativeDecodeStep` that runs this step, or None (module path)."""
        step = self._usable_native_step()
        return step if step is not None and step.takes(batch) else None

    def _usable_native_step(self):
        """The model's usable :class:`NativeDecodeStep`, or None (module path)."""
        if not self.native_decode:
            return None
        step = self.__dict__.get("_native_step")
        if step is None or not step.current():
            # (Re)built when the weights moved: a dtype or device change moves them too.
            if not NativeDecodeStep.applies_to(self):
                self.__dict__["_native_step"] = None
                return None
            step = self.__dict__["_native_step"] = NativeDecodeStep(self)
        return step if step.ok else None

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: HybridCache, return_hidden: bool = False):
        """Run one step; returns float32 logits ``[S, vocab]`` for ``batch.logits_indices``,
        with ``return_hidden`` also ``hidden`` ``[T, H]``: every row's trunk output after
        the final norm (the MTP layer's input ``h_t``, see :mod:`hybridserve.model.mtp`).

        Writes the step's K/V into ``cache`` at ``batch.slot_mapping`` and leaves every
        scheduled sequence's DeltaNet state (conv + recurrent) in its state pages
        advanced past the scheduled tokens, so the next step continues with
        ``has_initial_state=True``; requested checkpoints go to their pages. Speculative
        sequences (``batch.speculative``) are the exception: their state pages are read,
        not written, and :meth:`commit_speculative` advances them over the accepted rows.
        """
        self._open_ring(batch)
        # The rows every MoE layer receives this step (expert_load's mean), on either path.
        self._moe_rows = int(batch.input_ids.shape[0])
        fast = self._native_decode_for(batch)
        if fast is not None:
            logits = fast.run(batch, cache)
            if logits is not None:
                batch.op_plans[NATIVE_STEP] = fast
                return (logits, fast.last_hidden.clone()) if return_hidden else logits
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, cache)
        if return_hidden:
            # Row-wise, so the sampled rows' values are those of the path below.
            h = x if residual is None else residual + x
            hidden = self.norm(h)
            return self.lm_head(hidden.index_select(0, batch.logits_indices)).float(), hidden
        # Only the sampled rows need the last residual add, the final norm and the
        # (large) LM head.
        rows = batch.logits_indices
        h = x.index_select(0, rows)
        if residual is not None:  # None only for a model without layers
            h = residual.index_select(0, rows) + h
        return self.lm_head(self.norm(h)).float()

    # ---- speculative decoding -------------------------------------------------
    @staticmethod
    def _open_ring(batch: ForwardBatch) -> None:
        """Set up ``batch.spec_ring`` when the batch has speculative runs: the rows the
        DeltaNet layers record (those runs' rows, in batch order). A ring already
        ``preset`` (a verify graph's, :mod:`hybridserve.runner.verify_graphs`) comes with
        its attention layout and is kept."""
        if batch.spec_ring is not None and batch.spec_ring.get("preset"):
            return
        flags = batch.speculative
        if flags is not None and flags.device.type == "cpu":
            # (CPU: host lists, tensors through numpy arrays.)
            flags = flags.tolist()
            if flags == [True]:
                # Batch 1: one speculative run of every row.
                n = batch.num_tokens
                length = int(batch.seq_lens.numpy()[0])
                q_e, rows = _one_run_layout(n)
                # (rows_as_decodes of this run: row j sees length - (n-1-j) positions,
                # through the sequence's block-table row, repeated by numpy: no torch op.)
                batch.op_plans[DECODE_ROWS] = (q_e, torch.from_numpy(np.arange(length - n + 1, length + 1,
                                                                                dtype=np.int32)),
                                               torch.from_numpy(np.repeat(batch.block_tables.numpy()[:1], n, 0)))
                batch.spec_ring = {"seqs": [0], "lens": [n], "rows": rows, "all": True}
                return
            seqs = [b for b, f in enumerate(flags) if f]
            if not seqs:
                batch.spec_ring = None
                batch.op_plans.pop(DECODE_ROWS, None)
                return
            qsl = batch.host_query_start_loc()
            lens = [qsl[b + 1] - qsl[b] for b in seqs]
            # "all": every row of the batch is a speculative row (rows = 0 .. T-1).
            every = sum(lens) == batch.num_tokens
            rows = torch.arange(batch.num_tokens) if every else torch.from_numpy(
                np.array([r for b in seqs for r in range(qsl[b], qsl[b + 1])], dtype=np.int64))
            decode_rows_layout(batch, flags)
            batch.spec_ring = {"seqs": seqs, "lens": lens, "rows": rows, "all": every}
            return
        seqs = batch.speculative_seqs()
        if not seqs:
            batch.spec_ring = None
            batch.op_plans.pop(DECODE_ROWS, None)
            return
        qsl = batch.host_query_start_loc()
        lens = [qsl[b + 1] - qsl[b] for b in seqs]
        rows = [r for b in seqs for r in range(qsl[b], qsl[b + 1])]
        spec = set(seqs)
        # The speculative runs attend as decodes, one per row (see Attention.forward).
        decode_rows_layout(batch, [b in spec for b in range(batch.num_seqs)])
        batch.spec_ring = {"seqs": seqs, "lens": lens, "all": len(rows) == batch.num_tokens,
                           "rows": torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device)}

    def spec_ring_bytes(self, batch: ForwardBatch) -> int:
        """Bytes the batch's ring holds (0 when it has none): per speculative row and
        DeltaNet layer, the conv input (``linear_conv_dim``) and the gate inputs
        (``2 * linear_num_value_heads``) in the model dtype."""
        ring = batch.spec_ring
        if not ring:
            return 0
        return sum(t.numel() * t.element_size() for k, v in ring.items() if isinstance(k, int) for t in v)

    @torch.no_grad()
    def commit_speculative(self, batch: ForwardBatch, cache: HybridCache, accepted) -> None:
        """After :meth:`forward` of a batch with speculative runs: advance each speculative
        sequence's DeltaNet state (conv and recurrent, in its state pages) over its first
        ``accepted[b]`` rows, replayed from the step's ring, so the pages hold the state
        after those tokens as decoding them one by one leaves it. ``accepted`` int ``[B]``
        (ignored for non-speculative entries; ``1 <= accepted[b] <=`` the rows of b). K/V of
        rejected rows stays in the cache, unreferenced once the sequence's length drops
        back. Once per forward."""
        ring = batch.spec_ring
        if ring is None:
            if batch.speculative_seqs():
                raise ValueError("commit_speculative: run forward on this batch first (its ring is empty), "
                                 "and commit once")
            return
        acc = accepted.tolist() if isinstance(accepted, np.ndarray) else \
            torch.as_tensor(accepted).reshape(-1).tolist()
        if len(acc) != batch.num_seqs:
            raise ValueError(f"commit_speculative: accepted has {len(acc)} entries, the batch {batch.num_seqs} "
                             "sequences")
        sel, qsl, off = [], [0], 0
        # Sequences without drafts in a ring (a verify graph runs plain decodes beside
        # the drafting ones, read-only too): their one row.
        plain = set(ring.get("plain", ()))
        for b, n in zip(ring["seqs"], ring["lens"]):
            k = int(acc[b]) or (1 if b in plain else 0)
            if not 1 <= k <= n:
                raise ValueError(f"commit_speculative: accepted[{b}] = {k} must lie in 1..{n} (the sequence's rows)")
            sel.extend(range(off, off + k))
            qsl.append(qsl[-1] + k)
            off += n
        dev = batch.input_ids.device
        seqs = ring["seqs"]
        if seqs == list(range(batch.num_seqs)):
            pages, init = batch.state_pages, batch.has_initial_state
        else:
            seqs_t = torch.tensor(seqs, dtype=torch.long, device=dev)
            pages = batch.state_pages.index_select(0, seqs_t)
            init = batch.has_initial_state.index_select(0, seqs_t)
        # Every row accepted: the ring as it is; one run: a prefix of it.
        sel_t = None if len(sel) == off else slice(0, len(sel)) if len(seqs) == 1 else \
            torch.tensor(sel, dtype=torch.long, device=dev)
        fast = None
        if dev.type == "cpu":
            fast = batch.op_plans.get(NATIVE_STEP) or self._usable_native_step()
        if fast is not None and fast.replay(ring, sel_t, qsl, pages, init, cache):
            batch.spec_ring = None
            return
        if sel_t is None:
            sel_t = torch.arange(off, device=dev)
        elif isinstance(sel_t, slice):
            sel_t = torch.arange(len(sel), device=dev)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=dev)
        plans: dict = {}
        for layer in self.layers:
            if not layer.is_attention:
                d = layer.linear_attn
                mixed, ba = ring[d.layer_idx]
                d.replay(mixed.index_select(0, sel_t), ba.index_select(0, sel_t), qsl_t, pages, init, cache, plans)
        batch.spec_ring = None

    @torch.no_grad()
    def mtp_forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch,
                    cache: HybridCache, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass over the R rows ``batch`` lays out (its slot_mapping and block
        tables address the MTP layer's own KV, ``cache.mtp_k_cache``): row r combines
        ``hidden[r]`` (the trunk's post-norm state h_t from ``forward(...,
        return_hidden=True)``, or the previous chained step's ``mtp_hidden``) with the
        embedding of ``input_ids[r]`` (token t+1), writes its K/V at ``slot_mapping[r]``
        and attends causally over the sequence's MTP KV. Returns float32 logits ``[S, V]``
        for ``batch.logits_indices`` and ``mtp_hidden`` ``[R, H]``; with ``vocab`` the
        logits of token ids ``0 .. vocab-1`` only (``[S, vocab]``: a reduced draft
        vocabulary, the LM head's first rows, see :mod:`hybridserve.spec.proposer`).
        ConfigError when the
        model was built without the MTP layer or the cache has no room for its KV.

        Layout (vLLM's proposer and our training, ``hybridserve.train``): the row of
        ``h_t`` with token ``t+1`` sits at position ``t`` and writes the MTP KV slot of
        position ``t`` (the sequence's own block table: every KV page holds the MTP
        layer's block too); a chained draft step then runs position ``t+1`` with the
        previous ``mtp_hidden`` and the token just drafted."""
        if self.mtp is None:
            raise ConfigError("this model was loaded without its MTP layer (load_model(..., load_mtp=True))")
        if cache.mtp_layer_index is None:
            raise ConfigError("the cache holds no MTP KV: build it with model.new_cache() of a model "
                              "loaded with load_mtp=True")
        v = self.config.vocab_size
        if vocab is not None and not 1 <= vocab <= v:
            raise ValueError(f"mtp_forward: vocab must lie in 1..{v}, got {vocab}")
        vocab = None if vocab == v else vocab
        rows = int(input_ids.shape[0])
        if batch.input_ids.device.type == "cpu" and rows <= self._mtp_decode_rows():
            # A pass of few rows (the draft passes, the MTP prefill of a step's accepted
            # rows) attends as one decode query per row on both paths, so the native
            # step below and the module path are bit-identical.
            decode_rows_layout(batch, [True] * batch.num_seqs)
            fast = self._usable_native_step()
            if fast is not None and hidden.shape[0] == rows:
                out = fast.run_mtp(hidden, input_ids, batch, cache, vocab)
                if out is not None:
                    return out
        return self.mtp(self, hidden, input_ids, batch, cache, self._draft_head(vocab))

    def _draft_head(self, vocab: int | None) -> Projection:
        """The LM head over token ids ``0 .. vocab-1`` (its first rows, no copy), cached
        while the LM head's weight stays where it is."""
        w = self.lm_head.weight
        if vocab is None:
            return self.lm_head
        got = self.__dict__.get("_draft_heads", {}).get(vocab)
        if got is None or got.weight.data_ptr() != w.data_ptr() or got.weight.dtype != w.dtype:
            with torch.device("meta"):
                got = Projection(self.config.hidden_size, vocab, bias=False)
            got.weight = nn.Parameter(w.detach()[:vocab], requires_grad=False)
            self.__dict__.setdefault("_draft_heads", {})[vocab] = got
        return got

    def _mtp_decode_rows(self) -> int:
        """The most rows an MTP pass attends as decodes (where the native GEMM runs)."""
        return Projection.NATIVE_MAX_ROWS_BF16 if self.dtype == torch.bfloat16 else Projection.NATIVE_MAX_ROWS
