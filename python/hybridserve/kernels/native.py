"""The CPU path's native kernels (Rust, ``hybridserve._core.kernels``), on torch tensors.

For float32 CPU tensors the step's non-GEMM work runs here instead of as many small
torch ops: the gated delta rule with its gates and output norm fused
(:func:`gated_delta_rule`), the varlen causal conv1d over state slots
(:func:`causal_conv1d`) and decode attention over the paged pool
(:func:`paged_attention_decode`). Each works on the tensors' memory through numpy views
(no copies); inputs may be column ranges of a wider ``[T, X]`` buffer.

They compute the same contracts as the plain-PyTorch references beside them
(``*_ref``), which stay the oracles: ``tests/kernels/test_native_kernels.py`` checks
each kernel against its reference on random mixed batches. bfloat16 CPU tensors
have the few-row GEMM (:func:`linear_bf16`: bfloat16 weight and activations,
``vdpbf16ps`` where the CPU has AVX-512 BF16) and bfloat16 versions of the other
kernels (the DeltaNet mixer reads bfloat16 inputs over its float32 state); other dtypes and devices take the PyTorch (or
Triton) path; ``HYBRIDSERVE_NO_NATIVE=1`` forces the PyTorch path
on the CPU as well (debugging, side-by-side benchmarks).
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    from hybridserve._core import kernels as _k
except ImportError:  # an extension built before the kernels existed
    _k = None

_DISABLED = os.environ.get("HYBRIDSERVE_NO_NATIVE", "") in ("1", "true", "yes")


def _share_torchs_openmp_pool() -> bool:
    """Hand the kernels torch's libgomp workers (see ``rust/kernels/src/pool.rs``): two
    pools on the same cores fight, since libgomp's workers spin for milliseconds after
    each op. Linux with torch's bundled or system libgomp only; elsewhere, and with
    ``HYBRIDSERVE_KERNEL_POOL=rayon``, the kernels keep their own rayon pool."""
    if _k is None or os.environ.get("HYBRIDSERVE_KERNEL_POOL", "") == "rayon":
        return False
    try:
        import ctypes
        import re

        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*libgomp[^/\s]*\.so[^/\s]*)", f.read())))
        if len(paths) != 1:  # none, or two runtimes: do not guess which one torch uses
            return False
        lib = ctypes.CDLL(paths[0])
        par = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
        num = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value
        if not par or not num:
            return False
        _k._use_openmp(par, num)
        return True
    except (OSError, AttributeError):
        return False


_OPENMP = _share_torchs_openmp_pool()


_F32 = torch.float32
_BF16 = torch.bfloat16


def available() -> bool:
    return _k is not None and not _DISABLED


def usable(*tensors: torch.Tensor) -> bool:
    """True when the native kernels can run on these tensors (float32, on the CPU)."""
    if _k is None or _DISABLED:
        return False
    for t in tensors:  # a plain loop: this runs ~40 times per model step
        if t.dtype != _F32 or t.is_cuda or t.device.type != "cpu":
            return False
    return True


def usable_bf16(*tensors: torch.Tensor) -> bool:
    """True when the bfloat16 native kernels can run on these tensors (bfloat16, CPU)."""
    if _k is None or _DISABLED:
        return False
    for t in tensors:
        if t.dtype != _BF16 or t.is_cuda or t.device.type != "cpu":
            return False
    return True


def bf16_isa() -> str:
    """What the bfloat16 kernels run on here: ``"avx512_bf16"``, ``"avx2"`` or ``"scalar"``."""
    return _k.bf16_isa() if _k is not None else "none"


def set_threads(n: int) -> None:
    """Threads of the kernels' pool (the engine passes its ``cpu_threads``)."""
    if _k is not None:
        _k.set_kernel_threads(int(n))


def threads() -> int:
    return _k.kernel_threads() if _k is not None else 0


def pool() -> str:
    """Where the kernels' tasks run: ``"openmp"`` (torch's workers) or ``"rayon"``."""
    return "openmp" if _k is not None and _k.uses_openmp() else "rayon"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return start, start + extent * t.element_size()


def _check_disjoint(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor | None]) -> None:
    """A tensor the kernel writes must not overlap one it reads (the Rust side would
    hold a mutable and a shared slice of one memory). numpy's borrow tracking cannot
    see it: every ``.numpy()`` view has its own base."""
    for wn, w in written.items():
        ws = w.untyped_storage().data_ptr()
        for rn, r in read.items():
            # Different storages never overlap: the span arithmetic only for shared ones.
            if r is None or r.untyped_storage().data_ptr() != ws or r.numel() == 0 or w.numel() == 0:
                continue
            (a0, a1), (b0, b1) = _span(w), _span(r)
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{wn} overlaps {rn} in memory; the kernel writes {wn}, so pass separate tensors")


def _i64(x) -> np.ndarray:
    if torch.is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.int64)


def _bool(x) -> np.ndarray:
    if torch.is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=bool)


class Varlen:
    """A step's ``query_start_loc`` / ``has_initial_state``, state page table rows and
    checkpoint requests as the host arrays the kernels take (built once per step,
    shared by every layer)."""

    def __init__(self, query_start_loc, state_pages, has_initial_state, checkpoint_positions=None,
                 checkpoint_pages=None, read_only=None):
        self.qsl = _i64(query_start_loc)
        self.table = _i64(state_pages)
        self.init = _bool(has_initial_state)
        self.checkpoints = {}
        if checkpoint_positions is not None:
            pos = _i64(checkpoint_positions)
            if (pos >= 0).any():
                self.checkpoints = dict(checkpoint_positions=pos, checkpoint_pages=_i64(checkpoint_pages))
        # What the state kernels write besides each run's state: checkpoints, and which
        # runs write nothing back (speculative verify runs, ``read_only``).
        self.writes = dict(self.checkpoints)
        if read_only is not None:
            ro = _bool(read_only)
            if ro.any():
                self.writes["read_only"] = ro


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  varlen: Varlen, activation: str | None = "silu", *, item_base: int) -> torch.Tensor:
    """Same contract as :func:`hybridserve.kernels.causal_conv1d.causal_conv1d_ref`;
    ``x`` ``[T, C]`` may be a column range of a wider buffer; ``conv_state`` is the
    paged pool view ``[num_pages, per_page, C, W-1]``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}; use 'silu' or None")
    _check_disjoint({"conv_state": conv_state}, {"x": x, "weight": weight, "bias": bias})
    out = torch.empty(x.shape, dtype=torch.float32)
    _k.causal_conv1d(_np(x), _np(weight.contiguous()), None if bias is None else _np(bias), _np(conv_state),
                     varlen.qsl, varlen.table, varlen.init, _np(out), item_base=int(item_base),
                     silu=activation is not None, **varlen.writes)
    return out


def causal_conv1d_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       varlen: Varlen, activation: str | None = "silu", *, item_base: int) -> torch.Tensor:
    """:func:`causal_conv1d` for a bfloat16 model: ``x``, ``weight``, ``bias`` and the
    ``conv_state`` pool bfloat16; float32 sums, the output rounded once to bfloat16."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}; use 'silu' or None")
    _check_disjoint({"conv_state": conv_state}, {"x": x, "weight": weight, "bias": bias})
    out = torch.empty(x.shape, dtype=_BF16)
    _k.causal_conv1d_bf16(_bits(x), _bits(weight.contiguous()), None if bias is None else _bits(bias),
                          _bits(conv_state), varlen.qsl, varlen.table, varlen.init, _bits(out),
                          item_base=int(item_base), silu=activation is not None, **varlen.writes)
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, varlen: Varlen,
                     *, key_heads: int, value_heads: int, scale: float, item_base: int,
                     use_qk_l2norm: bool = True,
                     g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                     a: torch.Tensor | None = None, b: torch.Tensor | None = None,
                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                     z: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     norm_eps: float = 1e-6) -> torch.Tensor:
    """The gated delta rule in place on the paged pool ``state`` ``[num_pages, per_page,
    K, V]`` (value head ``h`` of sequence ``b`` at item ``item_base + h`` of its state
    page table row); returns ``[T, H * V]``.

    ``q``/``k`` ``[T, Hk * K]`` and ``v`` ``[T, H * V]`` (column ranges allowed). Gates
    either given (``g``, ``beta`` ``[T, H]``) or computed as Gated DeltaNet does from
    ``a``, ``b``, ``A_log``, ``dt_bias``. With ``z`` and ``norm_weight`` the output is
    ``norm_weight * rmsnorm(o) * silu(z)`` per head (DeltaNet's gated output norm).

    bfloat16 ``q`` (a bfloat16 model): every tensor but the float32 ``state`` is
    bfloat16 and read in place, the output bfloat16 (rounded where HF's bfloat16 run
    rounds); float32 otherwise."""
    t = q.shape[0]
    bf16 = q.dtype == _BF16
    out = torch.empty(t, v.shape[1], dtype=_BF16 if bf16 else torch.float32)
    given = dict(g=g, beta=beta, a=a, b=b, a_log=A_log, dt_bias=dt_bias, z=z, norm_weight=norm_weight)
    _check_disjoint({"state": state}, {"q": q, "k": k, "v": v, **given})
    view = _bits if bf16 else _np
    opt = {name: view(x) for name, x in given.items() if x is not None}
    rule = _k.gated_delta_rule_bf16 if bf16 else _k.gated_delta_rule
    rule(view(q), view(k), view(v), _np(state), varlen.qsl, varlen.table, varlen.init, view(out),
         item_base=int(item_base), key_heads=key_heads, value_heads=value_heads,
         scale=float(scale), l2norm=bool(use_qk_l2norm), norm_eps=float(norm_eps),
         **varlen.writes, **opt)
    return out


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: np.ndarray,
                           seq_lens: np.ndarray, block_tables: torch.Tensor, scale: float,
                           out: torch.Tensor) -> None:
    """Decode attention for the listed rows of ``q`` ``[T, Hq, D]`` into the same rows of
    ``out`` (float32 or bfloat16 like ``q``, contiguous); ``block_tables`` int32 ``[n, width]``, one row per
    listed sequence. The caches may be the arena's paged views (blocks a page apart).
    bfloat16 ``q``, caches and ``out`` take the bfloat16 kernel (float32 softmax and
    sums, the output rounded once)."""
    if q.dtype == _BF16:
        _k.paged_attention_decode_bf16(_bits(q.reshape(q.shape[0], -1)), _bits(k_cache), _bits(v_cache), rows,
                                       seq_lens, _np(block_tables.to(torch.int32).contiguous()), float(scale),
                                       _bits(out))
        return
    _k.paged_attention_decode(_np(q.reshape(q.shape[0], -1)), _np(k_cache), _np(v_cache), rows, seq_lens,
                              _np(block_tables.to(torch.int32).contiguous()), float(scale), _np(out))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             centered: bool = True) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, D]`` (contiguous); with ``residual``, ``residual += x`` first
    (in place) and the sum is normalised. ``centered``: scale by ``1 + weight``."""
    if residual is not None:
        _check_disjoint({"residual": residual}, {"x": x, "weight": weight})
    out = torch.empty_like(x)
    _k.rms_norm(_np(x), _np(weight), float(eps), _np(out), None if residual is None else _np(residual),
                bool(centered))
    return out


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                  centered: bool = True) -> torch.Tensor:
    """:func:`rms_norm` for a bfloat16 model (all contiguous bfloat16): ``residual += x``
    rounded to bfloat16 (HF's bfloat16 add), the norm in float32, rounded once."""
    if residual is not None:
        _check_disjoint({"residual": residual}, {"x": x, "weight": weight})
    out = torch.empty_like(x)
    _k.rms_norm_bf16(_bits(x), _bits(weight), float(eps), _bits(out), None if residual is None else _bits(residual),
                     bool(centered))
    return out


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a ``weight`` stored transposed (strides ``(1, out)``, see
    :meth:`Qwen3_5ForServing.store_cpu_layout`: the float32 MoE blocks); ``x`` ``[M, K]`` with
    unit column stride. For decode-sized ``M``, where BLAS repacks the weight per call."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _k.matmul(_np(x), _weight_view(weight), _np(out))
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a float32 ``weight`` ``[out, in]`` stored as checkpoints have
    it (C-contiguous): dot products over contiguous weight rows, which stream from
    memory at full rate for one or two rows; ``x`` ``[M, K]`` with unit column stride.
    For decode-sized ``M``, where BLAS repacks the weight per call."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _k.matmul_rows(_np(x), _np(weight), _np(out))
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's memory as numpy uint16 (numpy has no bfloat16), no copy."""
    return t.detach().view(torch.uint16).numpy()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = _BF16) -> torch.Tensor:
    """``x @ weight.T`` for bfloat16 ``x`` ``[M, K]`` (unit column stride) and a bfloat16
    ``weight`` ``[N, K]`` stored as checkpoints have it (C-contiguous); float32 sums,
    returned as ``out_dtype`` (bfloat16, rounded once like torch's bfloat16 GEMM, or
    float32). For decode-sized ``M``."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    _k.matmul_bf16(_bits(x), _bits(weight), _bits(out) if out_dtype == _BF16 else _np(out))
    return out


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gu`` ``[T, 2 * inter]`` = ``[gate | up]``
    (contiguous, float32 or bfloat16), in one pass, in place in the gate half, which is
    returned (a ``[T, inter]`` view of ``gu``). bfloat16 rounds the activation and the
    product as torch's ``silu_`` then ``mul_`` do."""
    _k.silu_mul(_bits(gu) if gu.dtype == _BF16 else _np(gu), int(inter))
    return gu[:, :inter]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """Constrained decoding's mask, in place: ``logits[r, t] = -inf`` for every row ``r``
    in ``rows`` and token ``t < vocab`` whose bit is clear in ``bitmask[r]`` (int32
    ``[R, ceil(V / 32)]``, xgrammar's layout). ``logits`` C-contiguous float32; zero words
    are filled 32 at a time, all-ones words skipped, rows spread over the pool."""
    _k.apply_token_bitmask(_np(logits), bitmask.numpy(), list(rows), int(vocab))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as :func:`hybridserve.kernels.cache_write.write_kv_ref` for
    ``key``/``value`` ``[T, Hkv, D]`` of the caches' dtype (float32 or bfloat16; rows
    may be strided, e.g. ``v`` inside the fused qkv output) and the caches the arena's
    paged views: one row copy per token on the calling thread."""
    t = key.shape[0]
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [T, Hkv, D]")
    view = _bits if key.dtype == _BF16 else _np
    _k.write_kv(view(key.reshape(t, -1)), view(value.reshape(t, -1)), _i64(slot_mapping), view(k_cache),
                view(v_cache))


def _weight_view(weight: torch.Tensor) -> np.ndarray:
    """``weight.T`` as numpy, cached on the parameter (its storage never moves: loading
    copies into it), rebuilt if the tensor's memory or shape changed."""
    key = (weight.data_ptr(), tuple(weight.shape))
    cached = getattr(weight, "_hybridserve_wt", None)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().t().numpy())
        weight._hybridserve_wt = cached
    return cached[1]


def qk_norm_rope(x: torch.Tensor, heads: int, head_stride: int, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen3.5 attention's per-head q/k preparation: zero-centred RMSNorm of each head
    then rotary embedding on the first ``cos.shape[1]`` channels (half-split). ``x``
    rows hold ``heads`` heads ``head_stride`` apart (the query's gate may sit between
    them); returns ``[T, heads, head_dim]`` contiguous."""
    d = weight.shape[0]
    if x.dtype == _BF16:  # a bfloat16 model: float32 arithmetic, the output rounded once
        out = torch.empty(x.shape[0], heads, d, dtype=_BF16)
        _k.qk_norm_rope_bf16(_bits(x), heads, head_stride, _bits(weight), float(eps), _bits(cos), _bits(sin),
                             _bits(out))
        return out
    out = torch.empty(x.shape[0], heads, d, dtype=torch.float32)
    _k.qk_norm_rope(_np(x), heads, head_stride, _np(weight), float(eps), _np(cos), _np(sin), _np(out))
    return out


def moe_block(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A whole sparse MoE block in one native call; same contract as
    :func:`hybridserve.kernels.moe.moe_block_ref`. ``router_weight`` ``[E, H]`` and the
    shared expert's ``(gate_up [2Is, H], down [H, Is], gate [1, H])`` stored transposed
    (the CPU layout), ``w13`` ``[E, H, 2I]`` and ``w2`` ``[E, I, H]`` contiguous.
    Returns (output ``[T, H]``, expert ids ``[T, k]``, rows of the busiest expert)."""
    t = x.shape[0]
    out = torch.empty(t, x.shape[1], dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    opt = {}
    if shared is not None:
        s13, s2, sg = shared
        opt = dict(shared_w13=_weight_view(s13), shared_w2=_weight_view(s2), shared_gate=_np(sg.reshape(-1)))
    busiest = _k.moe_block(_np(x), _weight_view(router_weight), _np(w13), _np(w2), int(top_k), _np(out),
                           ids.numpy(), _np(weights), **opt)
    return out, ids, busiest


def _weight_bits(weight: torch.Tensor) -> np.ndarray:
    """A bfloat16 weight's bits as numpy uint16, cached on the parameter as
    :func:`_weight_view` caches its transpose (a decode step passes each MoE weight
    once per layer: the view costs more than the lookup)."""
    key = (weight.data_ptr(), tuple(weight.shape))
    cached = getattr(weight, "_hybridserve_bits", None)
    if cached is None or cached[0] != key:
        cached = (key, _bits(weight))
        weight._hybridserve_bits = cached
    return cached[1]


def moe_block_bf16(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   top_k: int, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   packed: bool = False, shared_packed: bool = False, prepared: tuple | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A whole bfloat16 sparse MoE block in one native call, HF's bfloat16 block's
    rounding points (see ``rust/kernels/src/moe_bf16.rs``). Every weight as the
    checkpoint stores it, C-contiguous: ``router_weight`` ``[E, H]``, ``gate_up``
    ``[E, 2I, H]``, ``down`` ``[E, H, I]`` (HF's ``experts.gate_up_proj`` /
    ``down_proj``), the shared expert's ``(gate_up [2Is, H], down [H, Is], gate [1, H])``.
    Returns (output ``[T, H]`` bfloat16, expert ids ``[T, k]``, rows of the busiest
    expert). ``packed``: ``gate_up`` and ``down`` hold the panel layout
    :func:`pack_experts_bf16` makes (same shapes); ``shared_packed``: the shared
    expert's ``gate_up`` / ``down`` too (packed as one expert: ``[1, 2Is, H]`` /
    ``[1, H, Is]`` through :func:`pack_experts_bf16`, passed as ``[2Is, H]`` / ``[H, Is]``).
    ``prepared``: these weight arguments as :func:`moe_bf16_weights` made them (the
    tensors are then not read again)."""
    if prepared is None:
        prepared = moe_bf16_weights(router_weight, gate_up, down, shared, packed=packed, shared_packed=shared_packed)
    arrays, opt = prepared
    t = x.shape[0]
    out = torch.empty(t, x.shape[1], dtype=_BF16)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    busiest = _k.moe_block_bf16(_bits(x), *arrays, int(top_k), _bits(out), ids.numpy(), _np(weights), **opt)
    return out, ids, busiest


def moe_bf16_weights(router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     packed: bool = False, shared_packed: bool = False) -> tuple[tuple, dict]:
    """:func:`moe_block_bf16`'s weight arguments as the extension takes them (numpy
    views, no copy), for a caller to make once and pass as ``prepared``: valid while
    the tensors keep their memory and layout."""
    opt = dict(packed=bool(packed), shared_packed=bool(shared_packed))
    if shared is not None:
        s13, s2, sg = shared
        opt.update(shared_gate_up=_weight_bits(s13), shared_down=_weight_bits(s2), shared_gate=_weight_bits(sg))
    return (_weight_bits(router_weight), _weight_bits(gate_up), _weight_bits(down)), opt


def pack_experts_bf16(gate_up: torch.Tensor, down: torch.Tensor, unpack: bool = False) -> None:
    """Rearrange bfloat16 expert tensors (HF's ``gate_up`` ``[E, 2I, H]`` and ``down``
    ``[E, H, I]``, C-contiguous, CPU) in place into the panel layout that
    ``moe_block_bf16(..., packed=True)`` reads (``rust/kernels/src/moe_bf16/panels.rs``:
    each expert's gate, up and down matrix as column panels of key pairs), or back to
    HF's (``unpack``). Same shapes and bytes; one expert matrix of scratch."""
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("pack_experts_bf16: gate_up and down must be C-contiguous")
    _k.pack_experts_bf16(_bits(gate_up), _bits(down), unpack=bool(unpack))
