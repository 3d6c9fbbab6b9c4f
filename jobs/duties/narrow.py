"""Widen narrow starts that no claim has taken within ``ACC_NARROW_WIDEN_AFTER_SEC`` (jobs.narrow).

A claim widens the head of its services' queues; a start whose service no agent serves right now,
or whose agents are busy, becomes its job here, so every list, count and page shows it as the
queued job it is within a second or so. The wake-up its start sent is the agents'; a start widened
here is claimed like any queued task.
"""

from __future__ import annotations

from accs_site.conf import accs
from jobs.duties.base import Duty
from jobs.narrow import widen_aged


def duty(*, batch: int) -> Duty:
    return Duty("widen_aged_starts", every=1.0, limit=batch, max_batches=8,
                run=lambda limit: widen_aged(after_seconds=accs.narrow_widen_after_sec, limit=limit))
