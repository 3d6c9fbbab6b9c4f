"""Fixtures the engine's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accs_site.conf import reload


@pytest.fixture
def retention_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The global retention defaults, stated: 30 days for finished jobs, 90 for dead letters, no export."""
    monkeypatch.setenv("ACC_RETENTION_DAYS", "30")
    monkeypatch.setenv("ACC_RETENTION_DEAD_DAYS", "90")
    monkeypatch.delenv("ACC_RETENTION_EXPORT", raising=False)
    reload()
    yield
    monkeypatch.undo()
    reload()


@pytest.fixture
def two_refunds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """At most two interrupted attempts of a task are refunded (``ACC_MAX_REFUNDED_ATTEMPTS=2``)."""
    monkeypatch.setenv("ACC_MAX_REFUNDED_ATTEMPTS", "2")
    reload()
    yield
    monkeypatch.undo()
    reload()
