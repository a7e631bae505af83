"""What ``hybridserve plan`` reports: the arithmetic of the other modules gathered into
one :class:`CapacityReport` (its ``--json`` object) and rendered as a table.

No arithmetic of its own: every number comes from :mod:`.sizes`, :mod:`.weights`,
:mod:`.sessions`, :mod:`.arena`, :mod:`.sharing` or :mod:`.devices`. The arena lines are
:func:`~hybridserve.planner.arena.format_arena_log`'s, the very lines the engine logs at
start-up for the same budget.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from hybridserve.config import FULL_ATTENTION, ModelConfig, dtype_bytes
from hybridserve.errors import ConfigError
from hybridserve.planner.arena import ArenaPlan, SessionFit, context_lens_for, format_arena_log, size_arena
from hybridserve.planner.budget import describe_budget, usable_after_weights
from hybridserve.planner.devices import DevicePlan, DeviceShare, device_share, devices_needed
from hybridserve.planner.sessions import (
    paged_sequence_bytes,
    reserved_sequence_bytes,
    sessions_paged,
    sessions_reserved_max,
)
from hybridserve.planner.sharing import (
    ParallelSamplingPlan,
    SharingPlan,
    arena_parallel_sampling_plan,
    arena_sharing_plan,
    parallel_sampling_plan,
    sharing_plan,
)
from hybridserve.planner.sizes import (
    DEFAULT_BLOCK_SIZE,
    block_bytes,
    blocks_for_tokens,
    cache_dtype,
    check_context,
    conv_state_bytes,
    kv_bytes_per_token,
    matrix_state_bytes,
)
from hybridserve.planner.units import GiB, MiB, format_bytes, format_mib, positive_int
from hybridserve.planner.weights import (active_param_count, describe_quantization, mtp_param_count, param_count,
                                         weight_bytes)


@dataclass(frozen=True)
class CapacityReport:
    """Everything ``hybridserve plan`` reports; :meth:`to_dict` is its ``--json`` object.

    ``sessions_paged`` / ``sessions_reserved_max`` are the arena's page-exact counts
    (what the engine admits); ``seed_sessions_paged`` / ``seed_sessions_reserved_max``
    the seed's raw-byte arithmetic (no page padding, no scratch state), for comparison.
    """

    model_type: str
    num_layers: int
    num_full_attention_layers: int
    num_linear_attention_layers: int
    max_position_embeddings: int
    context_len: int
    block_size: int
    kv_dtype: str
    model_dtype: str
    kv_bytes_per_token: int
    block_bytes: int
    kv_bytes_per_sequence: int
    kv_bytes_at_native_max: int
    state_bytes_per_sequence: int
    conv_state_bytes_per_sequence: int
    conv_state_counted: bool
    num_experts: int
    num_experts_per_tok: int
    param_count: int
    active_param_count: int
    weight_bytes: int
    weight_source: str
    pool_bytes: int
    pool_source: str
    session_bytes_paged: int
    session_bytes_paged_without_conv: int
    session_bytes_reserved_max: int
    seed_sessions_paged: int
    seed_sessions_paged_without_conv: int
    seed_sessions_reserved_max: int
    #: The arena on one device for ``pool_bytes``; None when the weights leave no room.
    arena: ArenaPlan | None
    sessions_paged: int
    sessions_reserved_max: int
    session_table: tuple[SessionFit, ...]
    arena_log: tuple[str, ...]
    devices: DevicePlan | None = None
    #: Each device's share at the asked ``--tensor-parallel-size`` (None: not asked).
    tensor_parallel: DeviceShare | None = None
    tensor_parallel_budget_source: str = ""
    shared_prefix: SharingPlan | None = None
    parallel_sampling: ParallelSamplingPlan | None = None
    #: Speculative decoding's k (0: off): the weights include the MTP layer's
    #: (``mtp_weight_bytes`` of them) and every arena page its KV block.
    speculative_tokens: int = 0
    mtp_weight_bytes: int = 0
    #: Sessions of ``context_len`` tokens still decoding in one speculative step (each
    #: holding up to k drafts + k lookahead slots more); = ``sessions_paged`` when off.
    sessions_paged_while_decoding: int = 0

    @property
    def sessions_paged_without_conv(self) -> int:
        return self.seed_sessions_paged_without_conv

    def to_dict(self) -> dict[str, Any]:
        skip = {"shared_prefix", "parallel_sampling", "arena", "session_table", "devices", "arena_log",
                "tensor_parallel", "tensor_parallel_budget_source"}
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}
        d["sessions_paged_without_conv"] = self.sessions_paged_without_conv
        d["pool_mib"] = self.pool_bytes / MiB
        d["arena"] = None if self.arena is None else self.arena.to_dict()
        d["session_table"] = [s.to_dict() for s in self.session_table]
        d["arena_log"] = list(self.arena_log)
        d["devices"] = None if self.devices is None else self.devices.to_dict()
        d["tensor_parallel"] = None if self.tensor_parallel is None else {
            **self.tensor_parallel.to_dict(), "budget_source": self.tensor_parallel_budget_source}
        d["shared_prefix"] = self.shared_prefix.to_dict() if self.shared_prefix else None
        d["parallel_sampling"] = (
            self.parallel_sampling.to_dict() if self.parallel_sampling else None
        )
        return d


def capacity_report(
    config: ModelConfig,
    *,
    context_len: int,
    pool_bytes: int | None = None,
    device_memory: int | None = None,
    utilization: float = 0.9,
    reserve: int = 2 * GiB,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    include_conv: bool = True,
    cuda_graphs: bool = False,
    max_num_seqs: int | None = None,
    min_sessions: int = 1,
    shared_prefix_len: int | None = None,
    sessions: int | None = None,
    n: int = 1,
    prompt_len: int | None = None,
    tensor_parallel: int | None = None,
    speculative_tokens: int = 0,
) -> CapacityReport:
    """The full capacity picture at ``context_len``.

    The budget is ``pool_bytes`` if given, else derived from ``device_memory`` (see
    :func:`~hybridserve.planner.budget.pool_from_device`); then the device plan (how
    many such devices the model needs) is reported too, and a model whose weights do
    not fit one device gets ``arena=None`` and zero sessions rather than an error; the
    device count is for ``min_sessions`` sessions of ``context_len`` tokens.
    ``cuda_graphs`` sets the graphs' scratch state aside as the engine does on CUDA.
    ``include_conv`` only affects the seed's byte counts (the arena always holds the
    conv state). The shared-prefix scenario needs ``shared_prefix_len`` and
    ``sessions``; the sampling scenario runs when ``n > 1``; both count in the arena's
    pages (in raw bytes only when there is no arena on one device). ``tensor_parallel`` N
    adds what each of N devices holds and runs
    (:func:`~hybridserve.planner.devices.device_share`; with ``pool_bytes`` that is each
    device's arena budget); ConfigError naming the dimension when N does not shard the
    model. ``speculative_tokens`` k > 0 (``--speculative-config``) plans speculative
    decoding with the MTP layer as the engine runs it: the MTP weights count in the
    weights, the MTP layer's KV block in every page (so pages are larger and fewer), and
    sessions still decoding hold up to k drafts + k lookahead slots more
    (``sessions_paged_while_decoding``); with ``tensor_parallel`` each device holds its
    shard of the MTP layer and its share of the MTP KV.
    """
    kv_dtype = cache_dtype(config, kv_dtype)
    check_context(config, context_len)
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ConfigError(f"speculative_tokens must be a non-negative integer, got {speculative_tokens!r}")
    spec = speculative_tokens > 0
    params = param_count(config)
    weights = weight_bytes(config, checkpoint_dir, mtp=spec)
    mtp_weights = (weights - weight_bytes(config, checkpoint_dir)) if spec else 0
    # The byte arithmetic below counts the MTP layer's KV as one more attention layer,
    # as the arena's pages hold it.
    kv_config = with_mtp_layer(config) if spec else config
    if checkpoint_dir is not None:
        kind = "GGUF tensors (as stored)" if os.fspath(checkpoint_dir).endswith(".gguf") else "safetensors tensors"
        weight_source = f"{kind} in {os.fspath(checkpoint_dir)}" + (
            f", incl. the MTP layer's {format_bytes(mtp_weights)}" if spec else "")
    else:
        counted = f"({params:,} + {mtp_param_count(config):,} MTP) parameters" if spec else f"{params:,} parameters"
        form = describe_quantization(config)
        if form is not None:
            weight_source = f"{params:,} parameters as {form}" + (
                f", MTP layer {mtp_param_count(config):,} x {dtype_bytes(config.torch_dtype)} B" if spec else "")
        else:
            weight_source = f"{counted} x {dtype_bytes(config.torch_dtype)} B ({config.torch_dtype})"
    devices = None
    if pool_bytes is not None:
        positive_int("pool size in bytes", pool_bytes)
        pool, pool_source = pool_bytes, "given explicitly"
    else:
        if device_memory is None:
            raise ConfigError("give either the pool size or the device memory")
        pool = usable_after_weights(device_memory, weights, utilization=utilization, reserve=reserve)
        pool_source = describe_budget(device_memory, utilization, weights, reserve)
        devices = devices_needed(
            config, device_memory=device_memory, context_len=context_len, utilization=utilization,
            reserve=reserve, block_size=block_size, kv_dtype=kv_dtype, cuda_graphs=cuda_graphs,
            min_sessions=min_sessions, speculative_tokens=speculative_tokens,
        )
    tp_share, tp_source = None, ""
    if tensor_parallel is not None:
        tp_share = device_share(
            config, tensor_parallel, device_memory=device_memory, budget_bytes=pool_bytes,
            context_len=context_len, utilization=utilization, reserve=reserve, block_size=block_size,
            kv_dtype=kv_dtype, cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs,
            speculative_tokens=speculative_tokens,
        )
        tp_source = ("given explicitly, for each device" if pool_bytes is not None else
                     describe_budget(device_memory, utilization, tp_share.weight_bytes_per_device, reserve))
    arena = None
    if pool > 0:
        try:
            arena = size_arena(config, block_size=block_size, kv_dtype=kv_dtype, budget_bytes=pool,
                               cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs,
                               speculative_tokens=speculative_tokens)
        except ConfigError:
            if devices is None:
                raise  # an explicit pool too small for one sequence: say so
    sharing_pool = max(pool, 0)
    shared = None
    if shared_prefix_len is not None or sessions is not None:
        if shared_prefix_len is None or sessions is None:
            raise ConfigError("the shared-prefix scenario needs both a prefix length and a session count")
        shared = (
            arena_sharing_plan(arena, context_len, shared_prefix_len, sessions) if arena else
            sharing_plan(kv_config, sharing_pool, context_len, shared_prefix_len, sessions, block_size,
                         kv_dtype, include_conv)
        )
    sampling = None
    if n != 1:
        sampling = (
            arena_parallel_sampling_plan(arena, context_len, n, prompt_len) if arena else
            parallel_sampling_plan(kv_config, sharing_pool, context_len, n, prompt_len, block_size,
                                   kv_dtype, include_conv)
        )
    elif prompt_len is not None:
        raise ConfigError("a prompt length only matters with n > 1 samples per request")
    bb = block_bytes(kv_config, block_size, kv_dtype)
    fits = arena.sessions(context_len) if arena else None
    return CapacityReport(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_full_attention_layers=config.num_full_attention_layers,
        num_linear_attention_layers=config.num_linear_attention_layers,
        max_position_embeddings=config.max_position_embeddings,
        context_len=context_len,
        block_size=block_size,
        kv_dtype=kv_dtype,
        model_dtype=config.torch_dtype,
        kv_bytes_per_token=kv_bytes_per_token(kv_config, kv_dtype),
        block_bytes=bb,
        kv_bytes_per_sequence=blocks_for_tokens(context_len, block_size) * bb,
        kv_bytes_at_native_max=config.max_position_embeddings * kv_bytes_per_token(kv_config, kv_dtype),
        state_bytes_per_sequence=matrix_state_bytes(config),
        conv_state_bytes_per_sequence=conv_state_bytes(config, kv_dtype),
        conv_state_counted=include_conv,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        param_count=params,
        active_param_count=active_param_count(config),
        weight_bytes=weights,
        weight_source=weight_source,
        pool_bytes=pool,
        pool_source=pool_source,
        session_bytes_paged=paged_sequence_bytes(kv_config, context_len, block_size, kv_dtype, include_conv),
        session_bytes_paged_without_conv=paged_sequence_bytes(
            kv_config, context_len, block_size, kv_dtype, include_conv=False
        ),
        session_bytes_reserved_max=reserved_sequence_bytes(kv_config, block_size, kv_dtype, include_conv),
        seed_sessions_paged=sessions_paged(kv_config, sharing_pool, context_len, block_size, kv_dtype, include_conv),
        seed_sessions_paged_without_conv=sessions_paged(
            kv_config, sharing_pool, context_len, block_size, kv_dtype, include_conv=False
        ),
        seed_sessions_reserved_max=sessions_reserved_max(
            kv_config, sharing_pool, block_size, kv_dtype, include_conv
        ),
        arena=arena,
        sessions_paged=fits.sessions if fits else 0,
        sessions_reserved_max=arena.sessions_reserved_max().sessions if arena else 0,
        session_table=tuple(arena.sessions(L) for L in context_lens_for(arena, [context_len])) if arena else (),
        arena_log=tuple(format_arena_log(arena, context_len)) if arena else (),
        devices=devices,
        tensor_parallel=tp_share,
        tensor_parallel_budget_source=tp_source,
        shared_prefix=shared,
        parallel_sampling=sampling,
        speculative_tokens=speculative_tokens,
        mtp_weight_bytes=mtp_weights,
        sessions_paged_while_decoding=arena.sessions_while_decoding(context_len).sessions if arena else 0,
    )


def with_mtp_layer(config: ModelConfig) -> ModelConfig:
    """``config`` with the MTP layer's attention counted as one more full-attention
    layer: what a token's KV, a block and a session cost with speculative decoding
    (the MTP layer keeps its own paged KV beside the trunk's). For KV arithmetic only:
    its parameters are :func:`~hybridserve.planner.weights.mtp_param_count`'s."""
    return dataclasses.replace(config, layer_types=config.layer_types + (FULL_ATTENTION,),
                               num_hidden_layers=config.num_hidden_layers + 1)


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B"


def _tensor_parallel_rows(r: CapacityReport) -> list[tuple[str, str]]:
    """What each device holds at the asked ``--tensor-parallel-size``."""
    fb = format_bytes
    s = r.tensor_parallel
    assert s is not None
    n, L = s.tensor_parallel, r.context_len
    one_state = r.state_bytes_per_sequence + r.conv_state_bytes_per_sequence
    rows = [
        (f"tensor parallel over {n} device{'s' if n > 1 else ''}", "each device holds:"),
        ("  weights",
         f"{fb(s.weight_bytes_per_device)} = {s.weight_bytes_per_device / 1e9:,.2f} GB "
         f"({s.params_per_device:,} parameters, {s.replicated_params_per_device:,} of them whole on "
         "every device: norms" + (", router, shared_expert_gate" if r.num_experts else "") + ")"
         + (f", incl. its shard of the MTP layer, {fb(s.mtp_weight_bytes_per_device)}"
            if s.mtp_weight_bytes_per_device else "")),
        (f"  KV per token ({r.kv_dtype})",
         f"{s.kv_bytes_per_token_per_device:,} B of the model's {r.kv_bytes_per_token:,} B"
         + (f" (each KV head on {s.kv_head_replicas} devices)" if s.kv_head_replicas > 1 else "")),
        ("  DeltaNet state per sequence (matrix + conv)",
         f"{fb(s.state_bytes_per_sequence_per_device)} of the model's {fb(one_state)}"),
        ("  budget for its arena",
         f"{format_mib(s.budget_bytes_per_device)} ({r.tensor_parallel_budget_source})"
         if s.budget_bytes_per_device > 0 else
         f"none: {fb(s.budget_bytes_per_device)} ({r.tensor_parallel_budget_source})"),
    ]
    if s.arena is not None:
        a = s.arena
        rows.append((f"  sessions that fit at {L:,} tokens",
                     f"{s.sessions:,} ({a.pages_for_sequence(L):,} pages of {fb(a.page_bytes)} each, "
                     f"{a.num_pages:,} pages on each device; every session lives on all {n})"))
    else:
        rows.append((f"  sessions that fit at {L:,} tokens", "0 (the budget holds no sequence)"))
    return rows


def render_plan(report: CapacityReport, config_name: str = "") -> str:
    """The readable table of ``hybridserve plan``: the model, the seed's rows, the arena
    (the engine's start-up lines), the device count, then the scenarios."""
    fb = format_bytes
    r = report
    L = r.context_len
    conv_note = "counted" if r.conv_state_counted else "not counted (--omit-conv-state)"
    model = (f"{r.num_layers} = {r.num_full_attention_layers} full attention + "
             f"{r.num_linear_attention_layers} Gated DeltaNet")
    if r.num_experts:
        model += f"; MoE: {r.num_experts} experts, {r.num_experts_per_tok} routed per token"
    mtp = " incl. the MTP layer's" if r.speculative_tokens else ""
    if r.speculative_tokens:
        model += "; + 1 MTP layer (the drafter: its own KV, counted as an attention layer below)"
    rows: list[tuple[str, str]] = [
        ("layers", model),
        ("parameters", f"{r.param_count:,} ({_billions(r.param_count)}; "
                       f"{_billions(r.active_param_count)} active per token)"),
        (f"KV per token ({r.kv_dtype}{mtp})", f"{r.kv_bytes_per_token:,} B ({fb(r.kv_bytes_per_token)})"),
        (f"KV per sequence at the native {r.max_position_embeddings:,} tokens", fb(r.kv_bytes_at_native_max)),
        (f"one {r.block_size}-token block (all attention layers{' + MTP' if mtp else ''})", fb(r.block_bytes)),
        ("DeltaNet matrix state per sequence (float32)", fb(r.state_bytes_per_sequence)),
        (f"DeltaNet conv state per sequence ({r.kv_dtype}, the cache dtype; {conv_note})",
         fb(r.conv_state_bytes_per_sequence)),
        ("weights", f"{fb(r.weight_bytes)} = {r.weight_bytes / 1e9:,.2f} GB ({r.weight_source})"),
        ("budget for the arena (KV + state)",
         f"{format_mib(r.pool_bytes)} ({fb(r.pool_bytes)}; {r.pool_source})" if r.pool_bytes > 0
         else f"none: {fb(r.pool_bytes)} ({r.pool_source})"),
        (f"one {L:,}-token session in bytes",
         f"{fb(r.kv_bytes_per_sequence)} KV + {fb(r.state_bytes_per_sequence)} state"
         + (f" + {fb(r.conv_state_bytes_per_sequence)} conv" if r.conv_state_counted else "")
         + f" = {format_mib(r.session_bytes_paged)}"
         + (f" ({format_mib(r.session_bytes_paged_without_conv)} without conv)" if r.conv_state_counted else "")),
        ("one session reserving the native maximum", format_mib(r.session_bytes_reserved_max)),
        (f"sessions that fit at {L:,} tokens, paged", f"{r.sessions_paged:,}"),
    ]
    if r.speculative_tokens:
        k = r.speculative_tokens
        a = r.arena
        rows.append((f"speculative decoding (MTP, k={k})",
                     f"MTP weights {fb(r.mtp_weight_bytes)} counted in the weights"
                     + (f"; its KV ({fb(a.layout.kv_layer_block_bytes)} a block) in every "
                        f"{fb(a.page_bytes)} page" if a is not None else "")))
        rows.append((f"  sessions still decoding at {L:,} tokens (+{k} drafts, +{k} lookahead)",
                     f"{r.sessions_paged_while_decoding:,} (the count above is for sessions that end at "
                     f"{L:,} tokens: no slot is reserved past prompt + max_tokens)"))
    rows += [
        ("sessions that fit, reserving the native maximum", f"{r.sessions_reserved_max:,}"),
        ("(the seed's byte arithmetic: paged, reserved)",
         f"{r.seed_sessions_paged:,}, {r.seed_sessions_reserved_max:,} (no page padding, no scratch state)"),
    ]
    if r.devices is not None:
        dp = r.devices
        mem = f"{dp.device_memory / 1e9:,.0f} GB"
        if dp.devices_needed is None:
            top = dp.shares[-1]
            need = (f"none does: the largest that shards this model, {top.tensor_parallel} "
                    f"devices of {mem}, runs {top.sessions:,}; use larger devices, or fewer or shorter sessions")
        else:
            need = (f"{dp.devices_needed} device{'s' if dp.devices_needed > 1 else ''} of {mem} "
                    "(tensor parallel)")
        what = f"a {L:,}-token session" if dp.min_sessions == 1 else f"{dp.min_sessions:,} sessions of {L:,} tokens"
        rows.append((f"devices needed for {what}", need))
        for s in dp.shares:
            rows.append((
                f"  {s.tensor_parallel} device{'s' if s.tensor_parallel > 1 else ''}",
                f"each: weights {s.weight_bytes_per_device / 1e9:,.2f} GB, KV "
                f"{fb(s.kv_bytes_per_token_per_device)} a token, state "
                f"{fb(s.state_bytes_per_sequence_per_device)} a sequence, budget "
                + (format_mib(s.budget_bytes_per_device) if s.budget_bytes_per_device > 0 else "none")
                + f"; {s.sessions:,} sessions of {L:,} tokens"
                + (f" (each KV head on {s.kv_head_replicas} devices)" if s.kv_head_replicas > 1 else ""),
            ))
    if r.tensor_parallel is not None:
        rows += _tensor_parallel_rows(r)
    if r.shared_prefix is not None:
        s = r.shared_prefix
        rows += [
            (f"{s.count} sessions sharing a {s.shared_len:,}-token prefix",
             f"{s.shared_blocks:,} shared blocks + {s.count} x {s.private_blocks:,} own = "
             f"{s.total_blocks:,} blocks, {format_mib(s.total_bytes)} "
             f"(without sharing {format_mib(s.bytes_without_sharing)})"),
            ("sessions that fit with the shared prefix",
             f"{s.max_count:,} keeping {s.checkpoint_slots} DeltaNet checkpoint of "
             f"{format_mib(s.checkpoint_bytes)} (prefix compute skipped; "
             f"{s.max_count_evicting_checkpoint:,} if it is evicted; "
             f"without caching {s.max_count_without_sharing:,})"),
        ]
    if r.parallel_sampling is not None:
        p = r.parallel_sampling
        q = p.per_request
        rows += [
            (f"one request of n={p.n} samples, {q.shared_len:,}-token prompt",
             f"{q.shared_blocks:,} shared blocks + {p.n} x {q.private_blocks:,} own = "
             f"{q.total_blocks:,} blocks + {p.n} states = {format_mib(p.bytes_per_request)}"),
            (f"requests of n={p.n} that fit",
             f"{p.requests_that_fit:,} ({p.sequences_that_fit:,} sequences; without sharing "
             f"{p.requests_that_fit_without_sharing:,})"),
        ]
    width = max(len(k) for k, _ in rows)
    head = f"hybridserve plan: {config_name} ({r.model_type})" if config_name else "hybridserve plan"
    lines = [head, ""] + [f"{k:<{width}}  {v}" for k, v in rows]
    if r.arena_log:
        lines += ["", "the arena on one device (the engine logs these lines at start-up):"]
        lines += [f"  {line}" for line in r.arena_log]
    tp = r.tensor_parallel
    if tp is not None and tp.tensor_parallel > 1:
        shown = tp  # the asked size
    elif r.devices is not None and (r.devices.devices_needed or 0) > 1:
        shown = r.devices.shares[-1]  # the size the model needs
    else:
        shown = None
    if shown is not None and shown.arena is not None:
        n = shown.tensor_parallel
        lines += ["", f"the arena on each of {n} devices (a 1/{n} shard of every sequence's heads; "
                      "each rank logs these lines at start-up):"]
        lines += [f"  {line}" for line in format_arena_log(shown.arena, L)]
    return "\n".join(lines)
