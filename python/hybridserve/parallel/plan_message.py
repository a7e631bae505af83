"""One step's plan as the workers receive it: two host-tensor broadcasts.

The driver's Rust scheduler makes the plan; the workers need only its arrays (token
ids, positions, slot mapping, block-table and state-page-table updates, page copies,
sequence lengths, checkpoint requests, which rows sample). They travel as

1. a fixed-size int64 header: the operation (a step, or shut down), a flags word
   and each array's length;
2. one int64 payload: the arrays concatenated.

Speculative decoding (:mod:`hybridserve.spec`) adds two operations after a step, each
as small: the DeltaNet commit of the verify rows (:data:`OP_COMMIT`, the accepted row
count per entry) and the MTP drafter's passes (:data:`OP_PROPOSE`, per entry the rows
committed, the token after them and the drafts wanted; the chained passes' draft ids
follow as one broadcast per pass inside it, see :class:`~hybridserve.spec.proposer.MTPProposer`).
Everything else the workers need for them is the step's own plan, which they keep.

No Python objects are pickled and nothing is per request; a worker rebuilds a plan
object with the same attribute names (:class:`ReceivedPlan`) and runs the same
:meth:`ModelRunner.execute` on it, so every rank applies the same table updates and
copies to its own arena and takes part in the same collectives.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from hybridserve.parallel.group import TPGroup

# Every plan attribute ModelRunner.execute reads (flattened int64), then the extra
# "all_positions" (batch indices that want prompt logits).
PLAN_FIELDS = (
    "block_table_update_rows", "block_table_update_cols", "block_table_update_values",
    "state_table_update_rows", "state_table_update_cols", "state_table_update_values",
    "block_copies", "state_copies", "input_ids", "positions", "slot_mapping", "query_start_loc",
    "seq_lens", "block_table_rows", "num_computed_tokens", "num_samples",
    "checkpoint_positions", "checkpoint_pages", "num_draft_tokens",
)
FIELDS = PLAN_FIELDS + ("all_positions",)
OP_STEP, OP_SHUTDOWN, OP_IDLE, OP_COMMIT, OP_PROPOSE = 1, 2, 3, 4, 5
# The flags word of a step: the runner returns the trunk's hidden states (a drafting step).
FLAG_WANT_HIDDEN = 1
# op, flags, then one length per array (a step has the most arrays).
HEADER_LEN = 2 + len(FIELDS)
PROPOSE_FIELDS = ("committed", "next_tokens", "num_drafts")


class ReceivedPlan(SimpleNamespace):
    """A worker's copy of the driver's plan: the arrays ModelRunner reads, by name."""


def _field(plan, name: str) -> np.ndarray:
    if name == "num_draft_tokens":
        # Absent (a scheduler without speculation) or all zero: sent empty, which the
        # runner reads as "no drafts".
        nd = getattr(plan, name, None)
        nd = np.asarray(nd if nd is not None else (), dtype=np.int64).reshape(-1)
        return nd if nd.any() else nd[:0]
    return np.asarray(getattr(plan, name), dtype=np.int64).reshape(-1)


def _pack(op: int, flags: int, arrays: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [len(a) for a in arrays]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: 2 + len(lengths)] = torch.tensor([op, flags] + lengths, dtype=torch.int64)
    payload = torch.from_numpy(np.concatenate(arrays)) if arrays else torch.zeros(0, dtype=torch.int64)
    return header, payload


def encode(plan, all_positions, want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step."""
    arrays = [_field(plan, f) for f in PLAN_FIELDS]
    arrays.append(np.asarray(list(all_positions), dtype=np.int64))
    return _pack(OP_STEP, FLAG_WANT_HIDDEN if want_hidden else 0, arrays)


def _send(group: TPGroup, header: torch.Tensor, payload: torch.Tensor) -> None:
    group.broadcast_host(header, kind="plan")
    if payload.numel():
        group.broadcast_host(payload, kind="plan")


def send_step(group: TPGroup, plan, all_positions, want_hidden: bool = False) -> None:
    _send(group, *encode(plan, all_positions, want_hidden))


def send_commit(group: TPGroup, accepted: np.ndarray) -> None:
    """The step's DeltaNet commit: ``accepted[b]`` rows of each speculative entry."""
    _send(group, *_pack(OP_COMMIT, 0, [np.asarray(accepted, dtype=np.int64).reshape(-1)]))


def send_propose(group: TPGroup, committed, next_tokens, num_drafts) -> None:
    """The drafter's passes over the step just run (see ``MTPProposer.propose``)."""
    arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (committed, next_tokens, num_drafts)]
    _send(group, *_pack(OP_PROPOSE, 0, arrays))


def share_ids(group: TPGroup, ids: np.ndarray | None, n: int) -> np.ndarray:
    """Inside a propose: the driver's draft ids of one pass (``n`` int64), sent by the
    driver (``ids``) and returned on every rank (workers pass None)."""
    if group.is_driver:
        t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        group.broadcast_host(t, kind="drafts")
        return ids
    t = torch.empty(n, dtype=torch.int64)
    group.broadcast_host(t, kind="drafts")
    return t.numpy()


def _send_op(group: TPGroup, op: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = op
    group.broadcast_host(header, kind="plan")


def send_shutdown(group: TPGroup) -> None:
    """The orderly end: the workers leave their step loop, and every rank waits for
    the others before tearing its process group down (see `TPGroup.leave`)."""
    _send_op(group, OP_SHUTDOWN)
    group.leave()


def send_idle(group: TPGroup) -> None:
    """A heartbeat while no step runs: collectives time out, so a worker waiting for the
    next step must hear from the driver within the timeout (and the driver learns of a
    worker that died or hung while the engine was idle)."""
    _send_op(group, OP_IDLE)


class Message(SimpleNamespace):
    """A worker's next operation: ``op``, and for a step ``plan``, ``all_positions`` and
    ``want_hidden``; for a commit ``accepted``; for a propose the arrays of
    :data:`PROPOSE_FIELDS`."""


def receive(group: TPGroup) -> Message | None:
    """The driver's next operation; None when the driver shuts down."""
    header = group.broadcast_host(torch.empty(HEADER_LEN, dtype=torch.int64))
    while int(header[0]) == OP_IDLE:
        header = group.broadcast_host(header)
    op, flags = int(header[0]), int(header[1])
    if op == OP_SHUTDOWN:
        group.leave()
        return None
    names = {OP_STEP: FIELDS, OP_COMMIT: ("accepted",), OP_PROPOSE: PROPOSE_FIELDS}.get(op)
    if names is None:
        raise RuntimeError(f"unknown tensor-parallel operation {op} from the driver")
    lengths = header[2: 2 + len(names)].tolist()
    payload = torch.empty(sum(lengths), dtype=torch.int64)
    if payload.numel():
        group.broadcast_host(payload)
    fields = dict(zip(names, np.split(payload.numpy(), np.cumsum(lengths)[:-1])))
    if op != OP_STEP:
        return Message(op=op, **fields)
    all_positions = fields.pop("all_positions").tolist()
    return Message(op=op, plan=ReceivedPlan(**fields), all_positions=all_positions,
                   want_hidden=bool(flags & FLAG_WANT_HIDDEN))
