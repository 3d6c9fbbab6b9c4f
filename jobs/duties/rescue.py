"""Requeue (or fail for good) tasks whose lease expired: their agent died or was cut off (see jobs.rescue)."""

from __future__ import annotations

from jobs.duties.base import Duty
from jobs.rescue import rescue_expired


def rescue(limit: int) -> int:
    result = rescue_expired(limit=limit)
    return len(result.retried) + len(result.failed)


def duty(*, batch: int) -> Duty:
    # Every tick, up to a few batches: a fleet-wide outage can expire many leases at once.
    return Duty("rescue_expired_leases", every=1.0, limit=batch, run=rescue, max_batches=4)
