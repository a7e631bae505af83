"""The sparse mixture-of-experts block of the Qwen3.5 MoE models (35B-A3B, 122B-A10B,
397B-A17B), in place of the dense MLP in every layer.

Numerically HF's ``Qwen3_5MoeSparseMoeBlock``: a router ``gate`` (linear, no bias),
softmax over experts in float32, top-k, the k weights renormalised; the chosen
SwiGLU experts' outputs weighted and summed; plus the shared expert scaled by
``sigmoid(shared_expert_gate(x))``.

Expert weights live in one tensor per kind, with HF's in-memory shapes
(``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``). In
float32 (and on the GPU) they are stored per expert transposed, i.e. ``[E, H, 2I]``
and ``[E, I, H]`` in memory, which the float32 native kernel's GEMMs and the Triton
kernel read in place; in bfloat16 on the CPU they are loaded as HF holds them
(``[N, K]`` row-major per expert, like every bfloat16 projection), and the first
forward through the bfloat16 native block (``native.moe_block_bf16``) rearranges them
in place, expert matrix by expert matrix, into the panel layout its kernel reads
without lane sums (:meth:`Experts.pack_bf16`; ``rust/kernels/src/moe_bf16/panels.rs``).
While packed, the parameters' values are not HF's: every accessor that hands them out
as HF's (``hf_views``, ``fused_views``, ``w13``/``w2``, ``state_dict``, ``to``/``_apply``,
``load_state_dict``) puts them back first (:meth:`Experts.unpack_bf16`), and the next
forward packs them again.
Checkpoints store one tensor per expert and
projection (``experts.{e}.gate_proj.weight`` ...) or HF's fused 3-D tensors; both are
views of these two parameters (:meth:`Experts.hf_views`, :meth:`Experts.fused_views`),
so the loader streams either straight into place.

On the CPU the two expert tensors live in memory advised for transparent huge pages
(:func:`hybridserve.model.hugepages.huge_page_empty`): at decode every step streams most
experts' weights from memory once, and with 4 KiB pages the hardware prefetcher stops at
every page boundary (measured, ``benches/moe_layer.py``: 12-14% off the MoE layer at 16
tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.config import ModelConfig
from hybridserve.kernels import native, ops
from hybridserve.kernels.moe import expert_counts, route_ref
from hybridserve.model.hugepages import huge_page_empty
from hybridserve.model.layers import MLP, Projection, _Fused


class Experts(_Fused, nn.Module):
    """``num`` routed SwiGLU experts of ``inter`` channels on ``hidden``."""

    def __init__(self, num: int, hidden: int, inter: int):
        super().__init__()
        self.num, self.hidden, self.inter = num, hidden, inter
        # HF's shapes, per-expert transposed storage (see the module docstring).
        self.gate_up_proj = nn.Parameter(torch.empty(num, hidden, 2 * inter).transpose(1, 2))
        self.down_proj = nn.Parameter(torch.empty(num, inter, hidden).transpose(1, 2))
        self._register_load_state_dict_pre_hook(self._stack_hf_tensors)
        # True while gate_up_proj / down_proj hold the bfloat16 panel layout.
        self.packed_bf16 = False
        self._use_huge_pages()

    # Below this many bytes a tensor cannot hold one 2 MiB page.
    HUGE_PAGE_MIN_BYTES = 4 << 20

    def _use_huge_pages(self) -> None:
        """Move both expert tensors (CPU only) into huge-page memory, same values, in
        the CPU layout of their dtype (module docstring: transposed storage for
        float32, HF's for bfloat16, whose kernels read ``[N, K]`` rows). One tensor at
        a time: never a second copy of more than one layer's experts of one kind (the
        loader allocates layer by layer through ``to_empty``)."""
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            if p.device.type != "cpu":
                continue
            hf_layout = p.dtype == torch.bfloat16
            # The storage the kernels read: [E, 2I, H] / [E, H, I] (bfloat16) or
            # [E, H, 2I] / [E, I, H] (float32), contiguous.
            stored = p.data if hf_layout else p.data.transpose(1, 2)
            big = p.numel() * p.element_size() >= self.HUGE_PAGE_MIN_BYTES
            new = huge_page_empty(tuple(stored.shape), stored.dtype) if big else None
            if new is None:
                if stored.is_contiguous():
                    continue
                new = torch.empty(stored.shape, dtype=stored.dtype)
            with torch.no_grad():
                new.copy_(stored)
            p.data = new if hf_layout else new.transpose(1, 2)

    def pack_bf16(self) -> bool:
        """Rearrange the bfloat16 CPU expert tensors in place into the native block's
        panel layout (once; no copy of more than one expert matrix). False (nothing
        done) where they are not bfloat16 C-contiguous CPU tensors or the native
        kernels are unavailable."""
        if self.packed_bf16:
            return True
        gu, dn = self.gate_up_proj.data, self.down_proj.data
        if not (native.usable_bf16(gu, dn) and gu.is_contiguous() and dn.is_contiguous()):
            return False
        native.pack_experts_bf16(gu, dn)
        self.packed_bf16 = True
        return True

    def unpack_bf16(self) -> None:
        """Put HF's layout back (the inverse of :meth:`pack_bf16`), in place."""
        if self.packed_bf16:
            native.pack_experts_bf16(self.gate_up_proj.data, self.down_proj.data, unpack=True)
            self.packed_bf16 = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.unpack_bf16()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):
        self.unpack_bf16()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # Whatever fn makes of the tensors, it gets HF's values.
        self.unpack_bf16()
        # to_empty / to / float on the module allocate new tensors: keep them in
        # huge-page memory too.
        out = super()._apply(fn, recurse)
        self._use_huge_pages()
        return out

    def fused_param_names(self) -> set[str]:
        return {"gate_up_proj", "down_proj"}

    @property
    def w13(self) -> torch.Tensor:
        """``[E, H, 2I]`` (contiguous in float32): ``x @ w13[e]`` is expert e's gate then up."""
        self.unpack_bf16()
        return self.gate_up_proj.transpose(1, 2)

    @property
    def w2(self) -> torch.Tensor:
        """``[E, I, H]`` (contiguous in float32)."""
        self.unpack_bf16()
        return self.down_proj.transpose(1, 2)

    def hf_views(self) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint names (the published checkpoints') -> views."""
        self.unpack_bf16()
        out, i = {}, self.inter
        for e in range(self.num):
            out[f"{e}.gate_proj.weight"] = self.gate_up_proj[e, :i]
            out[f"{e}.up_proj.weight"] = self.gate_up_proj[e, i:]
            out[f"{e}.down_proj.weight"] = self.down_proj[e]
        return out

    def fused_views(self) -> dict[str, tuple[torch.Tensor, list[str]]]:
        """HF's fused 3-D names -> (the parameter, the per-expert names it stands for)."""
        self.unpack_bf16()
        return {
            "gate_up_proj": (self.gate_up_proj, [f"{e}.{p}.weight" for e in range(self.num)
                                                 for p in ("gate_proj", "up_proj")]),
            "down_proj": (self.down_proj, [f"{e}.down_proj.weight" for e in range(self.num)]),
        }

    def _stack_hf_tensors(self, state_dict, prefix, *args) -> None:
        # load_state_dict with per-expert HF names: stack them into the fused tensors.
        keys = [f"{prefix}{e}.{p}.weight" for e in range(self.num) for p in ("gate_proj", "up_proj", "down_proj")]
        if all(k in state_dict for k in keys):
            gu = [torch.cat([state_dict.pop(f"{prefix}{e}.gate_proj.weight"),
                             state_dict.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(self.num)]
            state_dict[f"{prefix}gate_up_proj"] = torch.stack(gu)
            state_dict[f"{prefix}down_proj"] = torch.stack(
                [state_dict.pop(f"{prefix}{e}.down_proj.weight") for e in range(self.num)])


class SparseMoeBlock(nn.Module):
    """Router + routed experts + gated shared expert; one call per layer and step.

    ``last_max_load`` is the number of rows the busiest expert received in the last
    call (a 0-d tensor or an int; read by :meth:`Qwen3_5ForServing.expert_load`).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_experts = c.num_experts
        self.top_k = c.num_experts_per_tok
        self.gate = Projection(c.hidden_size, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        si = c.shared_expert_intermediate_size
        self.shared_expert = MLP(c.hidden_size, si) if si else None
        self.shared_expert_gate = Projection(c.hidden_size, 1, bias=False) if si else None
        self.last_max_load: torch.Tensor | int | None = None
        # The shared expert's weights in the native block's panel layout (bfloat16 CPU):
        # (key of the weights they were made from, gate_up, down); see _packed_shared.
        self._shared_panels: tuple | None = None
        # The bfloat16 native path's checked, packed and viewed weights (_bf16_plan).
        self._plan: tuple | None = None

    SHARED_NATIVE_MAX_ROWS = Projection.NATIVE_MAX_ROWS

    def _native_ok(self, x: torch.Tensor) -> bool:
        if not (x.dim() == 2 and x.is_contiguous() and native.usable(x, self.gate.weight, self.experts.gate_up_proj)):
            return False
        weights = [self.gate.weight]
        if self.shared_expert is not None:
            weights += [self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight]
        # The kernel reads the projections transposed (the CPU layout, see
        # Qwen3_5ForServing.store_cpu_layout).
        return all(w.stride(0) == 1 for w in weights)

    # bfloat16 on the CPU: the routed experts are packed into the native block's panel
    # layout at the first call (Experts.pack_bf16), and then the native block runs every
    # token count: routed experts only, moe-bench layer, one thread, thread CPU ms,
    # packed / HF's layout / torch grouped GEMMs: 256 tokens 3.3 / 4.2 / 10.4, 768
    # 9.1 / 12.4 / 19.2, 2,048 24.6 / 33.8 / 36.9 (RESULTS.md, "Issue 18: the bfloat16
    # MoE block, second round"). With PACK_BF16 off (the experts in HF's layout) the
    # native block runs up to NATIVE_MAX_TOKENS_BF16 tokens and the grouped GEMMs past
    # it (HF's layout: native / grouped 768 tokens 23.8 / 26.1, 1,024 33.4 / 30.0, with
    # the shared expert; "Issue 18: the bfloat16 MoE block").
    PACK_BF16 = True
    NATIVE_MAX_TOKENS_BF16 = 768
    # On HF's layout (PACK_BF16 off), the shared expert (all T rows, a dense MLP) joins
    # the native call up to this many rows; past it the MLP module runs it (oneDNN past
    # 16 rows). moe-bench layer, one thread, thread CPU ms, fused / oneDNN: 24 tokens
    # 1.87 / 2.20, 32 2.40 / 2.63, 64 3.70 / 3.88, 96-192 within the noise, 256 8.43 /
    # 7.65, 768 22.2 / 20.4 (load 2.1).
    SHARED_NATIVE_MAX_ROWS_BF16 = 128

    def _bf16_weights(self) -> list[torch.Tensor]:
        w = [self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj]
        if self.shared_expert is not None:
            w += [self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight,
                  self.shared_expert_gate.weight]
        return w

    def _bf16_plan(self) -> tuple | None:
        """What the bfloat16 native path needs from the weights, made once per layer:
        (key, weights, packed, prepared arrays with the shared expert, without it), or
        None where the native kernels cannot run on them. Checking, packing and viewing
        the weights cost about 60 µs of Python per call (RESULTS.md, "... second
        round"), more than the kernel itself at one token in cache; the plan is rebuilt
        when a weight moves (its data pointer), is written in place (its version
        counter: a load, the shared copy's source) or the experts were unpacked."""
        plan = self._plan
        if plan is not None:
            ws = plan[1]
            key = (self.experts.packed_bf16, tuple(w.data_ptr() for w in ws), tuple(w._version for w in ws))
            if key == plan[0]:
                return plan
        ws = self._bf16_weights()
        # Every weight bfloat16 on the CPU as the checkpoint stores it ([N, K] row-major).
        if not (native.usable_bf16(*ws) and all(w.is_contiguous() for w in ws)):
            self._plan = None
            return None
        ex = self.experts
        packed = self.PACK_BF16 and ex.pack_bf16()
        args = (ws[0], ex.gate_up_proj, ex.down_proj)
        with_shared = None
        if self.shared_expert is not None:
            shared = (*self._packed_shared(), ws[5]) if packed else (ws[3], ws[4], ws[5])
            with_shared = native.moe_bf16_weights(*args, shared, packed=packed, shared_packed=packed)
        alone = native.moe_bf16_weights(*args, None, packed=packed)
        key = (ex.packed_bf16, tuple(w.data_ptr() for w in ws), tuple(w._version for w in ws))
        self._plan = (key, ws, packed, with_shared, alone)
        return self._plan

    def _apply(self, fn, recurse=True):
        self._plan = None
        return super()._apply(fn, recurse)

    def _packed_shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert's gate_up / down in the native block's panel layout: a
        packed copy, made once and remade when the weights change (another tensor or an
        in-place write: torch's version counter). A copy, not the MLP's own tensors,
        which oneDNN reads past SHARED_NATIVE_MAX_ROWS_BF16 rows: one expert's worth
        (0.4 % of a 35B-A3B layer's expert weights, 4 % of moe-bench's)."""
        gu, dn = self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight
        key = (gu.data_ptr(), gu._version, dn.data_ptr(), dn._version)
        if self._shared_panels is None or self._shared_panels[0] != key:
            pgu, pdn = gu.detach().clone()[None], dn.detach().clone()[None]
            native.pack_experts_bf16(pgu, pdn)
            self._shared_panels = (key, pgu[0], pdn[0])
        return self._shared_panels[1], self._shared_panels[2]

    def _forward_bf16(self, x: torch.Tensor, plan: tuple) -> torch.Tensor:
        """The bfloat16 CPU block, HF's bfloat16 rounding points either way."""
        _, ws, packed, with_shared, alone = plan
        ex = self.experts
        t = x.shape[0]
        if packed or t <= self.NATIVE_MAX_TOKENS_BF16:
            # Packed, the shared expert joins the call at every row count (moe-bench
            # layer, thread CPU ms, in the call / on oneDNN: 768 tokens 13.8 / 14.8,
            # 2,048 37.7 / 38.5; RESULTS.md, "... second round").
            fused = self.shared_expert is not None and (packed or t <= self.SHARED_NATIVE_MAX_ROWS_BF16)
            shared = None
            if fused:
                shared = (*self._shared_panels[1:], ws[5]) if packed else (ws[3], ws[4], ws[5])
            out, _, self.last_max_load = native.moe_block_bf16(
                x, ws[0], ex.gate_up_proj, ex.down_proj, self.top_k, shared, packed=packed,
                shared_packed=packed, prepared=with_shared if fused else alone)
            if self.shared_expert is not None and not fused:
                # HF's ops in bfloat16: the gate's sigmoid, times the shared output, plus.
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out
        weights, ids = route_ref(self.gate(x), self.top_k)
        out, counts = grouped_experts(x, ex.gate_up_proj, ex.down_proj, weights, ids)
        self.last_max_load = counts.max()
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.experts, "quantized", False) or any(
                getattr(m, "qweight", None) is not None for m in (self.gate, self.shared_expert_gate,
                                                                   *(self.shared_expert.modules()
                                                                     if self.shared_expert is not None else ()))):
            return self._forward_quantized(x)
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu":
            plan = self._bf16_plan()
            if plan is not None:
                return self._forward_bf16(x, plan)
        if self._native_ok(x):
            # Few rows: the shared expert is one more group of the native call (its
            # GEMMs share the parallel regions of the routed ones). Many rows: it is a
            # dense MLP of T rows, which BLAS runs faster than the few-row kernel (as
            # for every projection past Projection.NATIVE_MAX_ROWS); the gated add is
            # one pass.
            fused = self.shared_expert is not None and x.shape[0] <= self.SHARED_NATIVE_MAX_ROWS
            shared = None
            if fused:
                shared = (self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight,
                          self.shared_expert_gate.weight)
            out, _, self.last_max_load = native.moe_block(
                x, self.gate.weight, self.experts.w13, self.experts.w2, self.top_k, shared)
            if self.shared_expert is not None and not fused:
                out.addcmul_(torch.sigmoid(self.shared_expert_gate(x)), self.shared_expert(x))
            return out
        weights, ids = route_ref(F.linear(x, self.gate.weight), self.top_k)
        out = ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        self.last_max_load = expert_counts(ids, self.num_experts).max() if ids.numel() else 0
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


    def _forward_quantized(self, x: torch.Tensor) -> torch.Tensor:
        """A block with quantized weights (a GGUF's): experts kept in their blocks
        (:class:`hybridserve.quant.gguf.weights.QuantizedExperts`) and/or a quantized
        router or shared expert. HF's routing, each expert's rows through its own
        products; the router and the shared expert run as Projections."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route_ref(self.gate(x), self.top_k)
        if getattr(self.experts, "quantized", False):
            out = self.experts(x, weights, ids)
        else:
            out = ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        self.last_max_load = expert_counts(ids, self.num_experts).max() if ids.numel() else 0
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts as HF's default (``grouped_mm``) experts path runs them:
    (token, slot) pairs sorted by expert, one grouped GEMM for every expert's gate+up
    and one for its down projection (torch's ``grouped_mm``: no Python loop over
    experts), ``silu(gate) * up``, each row times its routing weight, and the k rows of
    a token summed (in float32 by torch, rounded once). ``gate_up`` ``[E, 2I, H]`` and
    ``down`` ``[E, H, I]`` as HF holds them. Returns (output ``[T, H]``, rows per
    expert)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, gate_up.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.grouped_mm(x[order // k], gate_up.transpose(-2, -1), offs=offs)
    inter = down.shape[-1]
    act = native.silu_mul(h, inter) if native.usable_bf16(h) else F.silu(h[:, :inter]) * h[:, inter:]
    y = F.grouped_mm(act, down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order, None]
    rows = torch.empty_like(y)
    rows[order] = y
    return rows.view(t, k, -1).sum(dim=1), counts
