"""The driver's model runner: broadcast the plan, then run the step like every rank."""

from __future__ import annotations

import time
from typing import Any

from hybridserve.runner.model_runner import ModelRunner, StepLogits


class TensorParallelRunner(ModelRunner):
    """:class:`ModelRunner` on rank 0: each step's plan goes to the workers first (one
    header + one payload broadcast), then the same :meth:`ModelRunner.execute` runs
    here; the LM head gathers the logits on this rank only, where sampling happens."""

    def __init__(self, *args: Any, tp: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def execute(self, plan: Any, all_positions: Any = ()) -> StepLogits | None:
        from hybridserve.parallel import plan_message

        tp = self.tp
        # The heartbeat thread's broadcasts and a step's never interleave.
        with tp.comm_lock:
            tp.check_healthy()
            tp.in_step = True
            try:
                with tp.watched_step():
                    plan_message.send_step(tp.group, plan, all_positions)
                    out = super().execute(plan, all_positions)
            except Exception as e:
                raise tp.fault(e) from e
            tp.in_step = False
            tp.last_message = time.monotonic()
        return out
