"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest


@pytest.fixture
def plan_sizes(monkeypatch):
    """The row count of every sampler plan made while the test runs (``RowTables.plan``
    spied on): a steady batch that reuses its plan adds nothing here."""
    import hybridserve.sampler.rows as rows_mod

    sizes: list[int] = []
    real = rows_mod.RowTables.plan

    def spy(self, rows, vocab, device):
        sizes.append(len(rows))
        return real(self, rows, vocab, device)

    monkeypatch.setattr(rows_mod.RowTables, "plan", spy)
    return sizes


@pytest.fixture(scope="session", autouse=True)
def _fake_available_memory():
    """An engine's CPU arena defaults to a fraction of the host memory available
    (issue 32); tests see a fixed 1 GiB (a 512 MiB arena, the old fixed default) so that
    no test takes gigabytes of a shared machine, nor depends on what it has free. It is
    an environment variable, so that subprocesses (serve, tensor-parallel workers) see it."""
    from hybridserve.engine.device import AVAILABLE_MEMORY_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(AVAILABLE_MEMORY_ENV, "1GiB")
        yield
