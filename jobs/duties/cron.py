"""Start the jobs of schedule triggers that are due."""

from __future__ import annotations

from jobs.duties.base import Duty
from jobs.triggers import fire_due_schedules


def fire(limit: int) -> int:
    return fire_due_schedules(limit=limit)


def duty() -> Duty:
    return Duty("fire_cron_triggers", every=1.0, limit=100, run=fire, max_batches=2)
