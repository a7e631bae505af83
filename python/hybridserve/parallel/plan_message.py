"""One step's plan as the workers receive it: two host-tensor broadcasts.

The driver's Rust scheduler makes the plan; the workers need only its arrays (token
ids, positions, slot mapping, block-table and state-page-table updates, page copies,
sequence lengths, checkpoint requests, which rows sample). They travel as

1. a fixed-size int64 header: the operation (a step, or shut down) and each array's
   length;
2. one int64 payload: the arrays concatenated.

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
    "checkpoint_positions", "checkpoint_pages",
)
FIELDS = PLAN_FIELDS + ("all_positions",)
OP_STEP, OP_SHUTDOWN, OP_IDLE = 1, 2, 3
HEADER_LEN = 1 + len(FIELDS)


class ReceivedPlan(SimpleNamespace):
    """A worker's copy of the driver's plan: the arrays ModelRunner reads, by name."""


def encode(plan, all_positions) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step."""
    arrays = [np.asarray(getattr(plan, f), dtype=np.int64).reshape(-1) for f in PLAN_FIELDS]
    arrays.append(np.asarray(list(all_positions), dtype=np.int64))
    header = torch.tensor([OP_STEP] + [len(a) for a in arrays], dtype=torch.int64)
    payload = torch.from_numpy(np.concatenate(arrays)) if arrays else torch.zeros(0, dtype=torch.int64)
    return header, payload


def send_step(group: TPGroup, plan, all_positions) -> None:
    header, payload = encode(plan, all_positions)
    group.broadcast_host(header, kind="plan")
    if payload.numel():
        group.broadcast_host(payload, kind="plan")


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


def receive(group: TPGroup) -> tuple[ReceivedPlan, list[int]] | None:
    """The next step's plan and prompt-logit rows; None when the driver shuts down."""
    header = group.broadcast_host(torch.empty(HEADER_LEN, dtype=torch.int64))
    while int(header[0]) == OP_IDLE:
        header = group.broadcast_host(header)
    if int(header[0]) == OP_SHUTDOWN:
        group.leave()
        return None
    if int(header[0]) != OP_STEP:
        raise RuntimeError(f"unknown tensor-parallel operation {int(header[0])} from the driver")
    lengths = header[1:].tolist()
    payload = torch.empty(sum(lengths), dtype=torch.int64)
    if payload.numel():
        group.broadcast_host(payload)
    parts = np.split(payload.numpy(), np.cumsum(lengths)[:-1])
    fields = dict(zip(FIELDS, parts))
    all_positions = fields.pop("all_positions").tolist()
    return ReceivedPlan(**fields), all_positions
