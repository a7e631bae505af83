"""How the kernels find a sequence's DeltaNet state in the arena: the state page table.

**Contract (every delta-rule and conv op: reference, CPU path, native, Triton).** The
state lives in a *pool* view of the arena ``[num_pages, per_page, *item]`` (a strided
view: the page stride is the arena's page size, see
:class:`hybridserve.model.cache.HybridCache`). Each sequence of the step has a row of
``state_pages`` int ``[B, P]`` (its state page table) and a layer passes its
``item_base``; the sequence's item ``h`` (value head ``h`` of the layer's recurrent
state, or ``h = 0``: the layer's conv state) is::

    i = item_base + h
    pool[state_pages[b, i // per_page], i % per_page]

``per_page`` is ``pool.shape[1]``. Checkpoints use the same arithmetic over their own
page rows (``checkpoint_pages``): ``checkpoint_positions[b] = k >= 1`` asks for the
state as it is after the sequence's first ``k`` scheduled tokens, written at the same
items of ``checkpoint_pages[b]``; ``-1`` (or ``None`` for the whole argument) asks for
none.

**Why the table row + item base** (and not per-(sequence, head) offsets prepared by the
caller): the table rows are gathered once per step and shared by every DeltaNet layer
unchanged; the layer adds one integer. A (sequence, head) task finds its item with one
division and one table load, which is nothing next to the ``K x V`` state it then
streams (measured: see benches/RESULTS.md, issue 17). Offsets prepared per layer would
cost a ``[B, H]`` host array per layer and per step; offsets prepared per step for all
layers a ``[layers, B, H]`` one, for no saving in the kernels.
"""

from __future__ import annotations

import torch


def item_coords(state_pages: torch.Tensor, item_base: int, n_items: int, per_page: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, within)`` int64 ``[B, n_items]``: ``pool[pages, within]`` is items
    ``item_base .. item_base + n_items - 1`` of every row, ``[B, n_items, *item]``."""
    items = torch.arange(item_base, item_base + n_items, device=state_pages.device)
    pages = state_pages.long().index_select(1, items // per_page)
    within = (items % per_page).expand(pages.shape[0], n_items)
    return pages, within


def as_list(x) -> list:
    if x is None:
        return []
    return x.tolist() if torch.is_tensor(x) else list(x)


def check_pool(pool: torch.Tensor, item_shape: tuple[int, ...], what: str) -> None:
    if pool.dim() != 2 + len(item_shape) or tuple(pool.shape[2:]) != tuple(item_shape):
        raise ValueError(
            f"the {what} pool must be [num_pages, per_page, {', '.join(map(str, item_shape))}] "
            f"(a HybridCache pool view), got {tuple(pool.shape)}")
