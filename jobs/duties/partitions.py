"""Create the event table's monthly partitions ahead of time."""

from __future__ import annotations

from events.partitions import ensure_partitions
from jobs.duties.base import Duty


def ensure(limit: int) -> int:
    return len(ensure_partitions())


def duty() -> Duty:
    return Duty("ensure_event_partitions", every=3600.0, limit=1, run=ensure)
