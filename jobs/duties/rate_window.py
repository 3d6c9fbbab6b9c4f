"""Forget task starts that have left their service's rate window (they no longer count)."""

from __future__ import annotations

from jobs.claim import forget_old_starts
from jobs.duties.base import Duty


def duty() -> Duty:
    return Duty("forget_old_rate_starts", every=10.0, limit=5000,
                run=lambda limit: forget_old_starts(limit=limit), max_batches=4)
