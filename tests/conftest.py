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
