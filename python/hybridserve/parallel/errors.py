"""The error a tensor-parallel engine raises when a rank fails."""

from __future__ import annotations

from hybridserve.errors import HybridServeError


class TensorParallelError(HybridServeError):
    """A rank of a tensor-parallel engine died, hung past the collective timeout, or
    could not start. The engine cannot continue (the other ranks' state is out of
    step with it): restart it. ``ranks`` are the failed ranks when known."""

    http_status = 503

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks
