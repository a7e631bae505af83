"""Capacity of the one arena: how many pages a budget holds and how many sessions fit.

The engine keeps one pool of equal pages (:mod:`hybridserve.memory.layout`) for KV
blocks, running sequences' DeltaNet state, state checkpoints and cached prefix blocks,
with one free count. :func:`size_arena` is what the engine calls at start-up to turn
its one byte budget into pages; :func:`format_arena_log` is what it logs, and
``hybridserve plan`` prints the same lines for the same budget.

A sequence of ``L`` tokens holds ``state_pages + ceil(L / block_size)`` pages, so the
sessions that fit are ``num_pages // that`` (capped by ``max_num_seqs`` when given):
no split decides anything. With CUDA graphs the decode graphs' padding rows need one
sequence's state that no sequence owns: ``state_pages`` pages set aside at start-up,
counted here (they are not handed to the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError
from hybridserve.memory.layout import ArenaLayout, arena_layout
from hybridserve.planner.sizes import DEFAULT_BLOCK_SIZE
from hybridserve.planner.units import ceil_div, format_bytes, format_mib, positive_int

#: Context lengths the start-up log and ``hybridserve plan`` tabulate (those up to the
#: model's limit, plus the limit itself).
DEFAULT_CONTEXT_LENS = (1_024, 4_096, 16_384, 32_768, 65_536, 131_072, 262_144)


@dataclass(frozen=True)
class SessionFit:
    """How many sequences of ``context_len`` tokens run at once, and what stops more."""

    context_len: int
    pages_per_session: int
    sessions: int
    #: ``"pages"`` (the arena is full) or ``"max_num_seqs"`` (the engine's cap).
    limited_by: str

    def to_dict(self) -> dict[str, Any]:
        return {"context_len": self.context_len, "pages_per_session": self.pages_per_session,
                "sessions": self.sessions, "limited_by": self.limited_by}


@dataclass(frozen=True)
class ArenaPlan:
    """The arena the engine allocates: ``total_pages`` pages of ``layout.page_bytes``.

    Page ids ``0..num_pages`` go to the scheduler (KV blocks, state pages, checkpoints,
    cached blocks: one free count); ids ``num_pages..total_pages`` are the CUDA-graph
    scratch state (``scratch_pages``, 0 without graphs).
    """

    layout: ArenaLayout
    num_pages: int
    scratch_pages: int
    #: The longest sequence the engine admits (the reserve-max policy reserves it).
    max_model_len: int
    #: The byte budget the arena was cut from; None when sized in pages exactly.
    budget_bytes: int | None = None
    max_num_seqs: int | None = None
    #: Speculative decoding's k (0: off). Every page then also holds the MTP layer's KV
    #: block (``layout.extra_attention_layers``); k only matters to sequences still
    #: decoding, see :meth:`sessions_while_decoding`.
    speculative_tokens: int = 0

    @property
    def total_pages(self) -> int:
        """Pages the cache allocates (``HybridCache(config, layout, total_pages, ...)``)."""
        return self.num_pages + self.scratch_pages

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def state_pages(self) -> int:
        return self.layout.state_pages

    @property
    def arena_bytes(self) -> int:
        return self.total_pages * self.layout.page_bytes

    @property
    def unused_bytes(self) -> int:
        """Budget bytes too few to make another page (less than one page)."""
        return 0 if self.budget_bytes is None else self.budget_bytes - self.arena_bytes

    @property
    def scratch_page_ids(self) -> range:
        return range(self.num_pages, self.total_pages)

    def pages_for_sequence(self, num_tokens: int) -> int:
        return self.layout.pages_for_sequence(num_tokens)

    @property
    def reserved_pages_per_sequence(self) -> int:
        """Pages one sequence takes under the reserve-max baseline
        (``--admission-policy reserve_max``): its state + ``max_model_len`` in blocks."""
        return self.layout.state_pages + ceil_div(self.max_model_len, self.layout.block_size)

    def _fit(self, context_len: int, per_session: int) -> SessionFit:
        n = self.num_pages // per_session
        limited_by = "pages"
        if self.max_num_seqs is not None and self.max_num_seqs < n:
            n, limited_by = self.max_num_seqs, "max_num_seqs"
        return SessionFit(context_len, per_session, n, limited_by)

    def sessions(self, context_len: int) -> SessionFit:
        """Sequences of ``context_len`` tokens running at once, paged. O(1)."""
        positive_int("context length", context_len)
        if context_len > self.max_model_len:
            raise ConfigError(
                f"context length {context_len:,} exceeds max_model_len {self.max_model_len:,}; "
                "ask for less"
            )
        return self._fit(context_len, self.pages_for_sequence(context_len))

    def pages_while_decoding(self, context_len: int) -> int:
        """Pages a sequence holding ``context_len`` tokens takes during a step when it
        goes on decoding past them with speculation on: the scheduler feeds its last
        token plus up to k drafts and reserves k lookahead slots past them for the
        drafter, so its table covers up to ``context_len + 2k`` positions (never past
        max_model_len). Without speculation, :meth:`pages_for_sequence`.

        A sequence that ends at ``context_len`` (prompt + max_tokens) never holds more
        than :meth:`pages_for_sequence`: the scheduler reserves no slot at or past
        ``prompt + max_tokens``, so :meth:`sessions` is exact for it."""
        span = min(context_len + 2 * self.speculative_tokens, self.max_model_len)
        return self.layout.pages_for_sequence(max(span, context_len))

    def sessions_while_decoding(self, context_len: int) -> SessionFit:
        """Sequences holding ``context_len`` tokens each and still decoding, all in one
        speculative step (see :meth:`pages_while_decoding`); equals :meth:`sessions`
        without speculation. O(1)."""
        self.sessions(context_len)  # the same checks
        return self._fit(context_len, self.pages_while_decoding(context_len))

    def sessions_reserved_max(self) -> SessionFit:
        """Sequences running at once when each reserves ``max_model_len`` at admission
        (the baseline policy), whatever their actual lengths. O(1)."""
        return self._fit(self.max_model_len, self.reserved_pages_per_sequence)

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "scratch_pages": self.scratch_pages, "total_pages": self.total_pages,
            "arena_bytes": self.arena_bytes, "budget_bytes": self.budget_bytes,
            "unused_bytes": self.unused_bytes, "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs, "reserved_pages_per_sequence":
            self.reserved_pages_per_sequence, "speculative_tokens": self.speculative_tokens,
            "layout": self.layout.to_dict(),
        }


def size_arena(
    config: ModelConfig,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_dtype: str | None = None,
    budget_bytes: int | None = None,
    num_pages: int | None = None,
    cuda_graphs: bool = False,
    max_num_seqs: int | None = None,
    extra_attention_layers: int = 0,
    speculative_tokens: int = 0,
) -> ArenaPlan:
    """The arena for ``config`` from ONE byte budget, or exactly ``num_pages`` pages.

    ``budget_bytes`` (``kv_cache_memory``, or on CUDA what ``gpu_memory_utilization``
    leaves, see :func:`~hybridserve.planner.budget.pool_from_device`) is cut into
    ``budget // page_bytes`` pages; with ``cuda_graphs`` the first ``state_pages`` of
    them are the graphs' scratch state and the rest go to the scheduler. ``num_pages``
    (exact sizing for tests) is the scheduler's pages; scratch comes on top.
    ``config.max_position_embeddings`` is taken as max_model_len (the engine passes its
    serving config). ``max_num_seqs`` only caps the session counts reported.
    ``extra_attention_layers``: attention layers beyond the trunk's in every KV page (1:
    the MTP layer's KV when speculative decoding is on; see
    :func:`~hybridserve.memory.layout.arena_layout`). ``speculative_tokens``: k of
    speculative decoding (0: off); > 0 implies the MTP layer's KV (at least one extra
    attention layer) and adds the lookahead to :meth:`ArenaPlan.sessions_while_decoding`.

    Raises :class:`ConfigError` saying what to change when the arena cannot hold one
    sequence's state plus one KV block, or when neither / both sizes are given.
    """
    if (budget_bytes is None) == (num_pages is None):
        raise ConfigError(
            "size the arena with exactly one of a byte budget (kv_cache_memory / "
            "gpu_memory_utilization) or an exact page count (num_pages)"
        )
    if max_num_seqs is not None:
        positive_int("max_num_seqs", max_num_seqs)
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ConfigError(f"speculative_tokens must be a non-negative integer, got {speculative_tokens!r}")
    if speculative_tokens:
        # The drafter's own KV lives in every page beside the trunk's.
        extra_attention_layers = max(extra_attention_layers, 1)
    layout = arena_layout(config, block_size, kv_dtype, extra_attention_layers)
    scratch = layout.state_pages if cuda_graphs else 0
    need = layout.pages_for_sequence(1)  # one sequence: its state + one KV block
    if num_pages is not None:
        positive_int("num_pages", num_pages)
        pages = num_pages
    else:
        positive_int("arena budget in bytes", budget_bytes)
        pages = layout.num_pages(budget_bytes) - scratch
    if pages < need:
        least = (need + scratch) * layout.page_bytes
        got = f"{max(pages, 0):,} pages of {format_bytes(layout.page_bytes)} for sequences" + (
            f" (from a {format_mib(budget_bytes)} budget)" if budget_bytes is not None else "")
        raise ConfigError(
            f"the arena is too small to run one sequence: it has {got}, and one needs "
            f"{layout.state_pages:,} DeltaNet state pages + 1 KV block"
            + (f" (with {scratch:,} more for the CUDA-graph scratch state)" if scratch else "")
            + f"; give the cache at least {format_mib(least)} (raise kv_cache_memory or "
            "gpu_memory_utilization)"
        )
    return ArenaPlan(
        layout=layout, num_pages=pages, scratch_pages=scratch,
        max_model_len=config.max_position_embeddings, budget_bytes=budget_bytes,
        max_num_seqs=max_num_seqs, speculative_tokens=speculative_tokens,
    )


def context_lens_for(plan: ArenaPlan, extra: Iterable[int] = ()) -> list[int]:
    """The tabulated context lengths: :data:`DEFAULT_CONTEXT_LENS` up to max_model_len,
    max_model_len itself and ``extra``, sorted, without repeats."""
    lens = {n for n in DEFAULT_CONTEXT_LENS if n <= plan.max_model_len}
    lens.add(plan.max_model_len)
    lens.update(n for n in extra if 0 < n <= plan.max_model_len)
    return sorted(lens)


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _layout_line(plan: ArenaPlan) -> str:
    lay = plan.layout
    line = (
        f"page layout ({lay.kv_dtype} cache): a page is one {lay.block_size}-token KV block of "
        f"{_count(lay.num_attention_layers, 'attention layer')}"
        + (f" (incl. {lay.extra_attention_layers} MTP)" if lay.extra_attention_layers else "")
        + f" ({format_bytes(lay.kv_block_bytes)}, padding "
        f"{format_bytes(lay.kv_padding_bytes)})"
    )
    if lay.num_linear_layers:
        line += (
            f"; a sequence's DeltaNet state is {lay.state_pages:,} pages ({lay.recurrent_pages:,} "
            f"recurrent, {_count(lay.recurrent_per_page, 'head')} of {format_bytes(lay.recurrent_item_bytes)} "
            f"each + {lay.conv_pages:,} conv, {_count(lay.conv_per_page, 'layer')} of "
            f"{format_bytes(lay.conv_item_bytes)} each): {format_bytes(lay.state_bytes)} of state, "
            f"padding {format_bytes(lay.state_padding_bytes)}"
        )
    return line


def _fit_text(fit: SessionFit) -> str:
    cap = " (max_num_seqs)" if fit.limited_by == "max_num_seqs" else ""
    return f"{fit.sessions:,}{cap}"


def format_arena_log(plan: ArenaPlan, context_len: int | None = None) -> list[str]:
    """The engine's start-up log lines for ``plan`` (``hybridserve plan`` prints the
    same): the arena, the page layout and its padding, sessions that fit at
    ``context_len`` (default max_model_len) paged vs reserving max_model_len, and
    sessions by context length."""
    L = plan.max_model_len if context_len is None else context_len
    first = (
        f"arena: {plan.total_pages:,} pages x {format_bytes(plan.page_bytes)} = "
        f"{format_mib(plan.arena_bytes)}"
        + (f" of a {format_mib(plan.budget_bytes)} budget" if plan.budget_bytes is not None else "")
        + f"; {plan.num_pages:,} pages for KV blocks, DeltaNet state and checkpoints (one free count)"
        + (f", {plan.scratch_pages:,} for the CUDA-graph scratch state" if plan.scratch_pages else "")
    )
    here, rmax = plan.sessions(L), plan.sessions_reserved_max()
    fits = (
        f"sessions that fit at {L:,} tokens: {_fit_text(here)} paged ({here.pages_per_session:,} "
        f"pages each), {_fit_text(rmax)} reserving max_model_len {plan.max_model_len:,} "
        f"({rmax.pages_per_session:,} pages each)"
    )
    table = "sessions that fit by context length (paged): " + " | ".join(
        f"{n:,}: {_fit_text(plan.sessions(n))}" for n in context_lens_for(plan, [L])
    )
    lines = [first, _layout_line(plan), fits, table]
    lay = plan.layout
    if lay.extra_attention_layers:
        k = plan.speculative_tokens
        spec = (
            "speculative decoding: every page also holds the MTP layer's KV block "
            f"({format_bytes(lay.kv_layer_block_bytes * lay.extra_attention_layers)} of "
            f"{format_bytes(lay.kv_block_bytes)}), counted in the sessions above, which end at "
            "their context (no slot is reserved past prompt + max_tokens)"
        )
        if k:
            dec = plan.sessions_while_decoding(L)
            spec += (
                f"; with k={k} a sequence still decoding at {L:,} tokens also holds up to {k} drafts "
                f"+ {k} lookahead slots: {_fit_text(dec)} such sessions ({dec.pages_per_session:,} pages each)"
            )
        lines.append(spec)
    return lines
