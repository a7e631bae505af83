"""The driver's model runner: broadcast the plan, then run the step like every rank."""

from __future__ import annotations

import time
from typing import Any

from hybridserve.runner.model_runner import ModelRunner, StepLogits


class TensorParallelRunner(ModelRunner):
    """:class:`ModelRunner` on rank 0: each step's plan goes to the workers first (one
    header + one payload broadcast), then the same :meth:`ModelRunner.execute` runs
    here; the LM head gathers the logits on this rank only, where sampling happens.
    Speculative decoding's model work after the step (the DeltaNet commit, the drafter's
    passes) goes the same way: a small message, then the same call on every rank."""

    def __init__(self, *args: Any, tp: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def _broadcast_then(self, send: Any, run: Any) -> Any:
        """``send`` the operation to the workers, then ``run`` it here, as one watched
        step under the communication lock (the heartbeat never interleaves with it);
        any failure is the ranks' failure (:meth:`TensorParallel.fault`)."""
        tp = self.tp
        with tp.comm_lock:
            tp.check_healthy()
            tp.in_step = True
            try:
                with tp.watched_step():
                    send()
                    out = run()
            except Exception as e:
                raise tp.fault(e) from e
            tp.in_step = False
            tp.last_message = time.monotonic()
        return out

    def execute(self, plan: Any, all_positions: Any = ()) -> StepLogits | None:
        from hybridserve.parallel import plan_message

        return self._broadcast_then(
            lambda: plan_message.send_step(self.tp.group, plan, all_positions, self.want_hidden),
            lambda: super(TensorParallelRunner, self).execute(plan, all_positions))

    def commit_speculative(self, accepted: Any) -> None:
        from hybridserve.parallel import plan_message

        self._broadcast_then(lambda: plan_message.send_commit(self.tp.group, accepted),
                             lambda: super(TensorParallelRunner, self).commit_speculative(accepted))

    def propose(self, proposer: Any, hidden: Any, **kw: Any) -> list:
        from hybridserve.parallel import plan_message

        # The draft ids of each chained pass go to the workers from inside it.
        proposer.group = self.tp.group
        return self._broadcast_then(
            lambda: plan_message.send_propose(self.tp.group, kw["committed"], kw["next_tokens"],
                                              kw["num_drafts"]),
            lambda: super(TensorParallelRunner, self).propose(proposer, hidden, **kw))
