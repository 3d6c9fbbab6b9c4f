"""Clear governor conditions whose expiry time has passed."""

from __future__ import annotations

from jobs.duties.base import Duty
from workflows.governor import expire_conditions


def expire(limit: int) -> int:
    return len(expire_conditions(limit=limit))


def duty() -> Duty:
    return Duty("expire_governor_conditions", every=5.0, limit=100, run=expire)
