"""Make retries whose backoff is over claimable again (scheduled → queued) and wake their agents.

Agents also promote their own services' due retries when they claim; this duty keeps the queue
true for services no agent is serving right now, and wakes idle agents when a backoff ends.
"""

from __future__ import annotations

from jobs.duties.base import Duty
from jobs.reports import promote_scheduled


def duty(*, batch: int) -> Duty:
    return Duty("promote_scheduled_retries", every=1.0, limit=batch,
                run=lambda limit: promote_scheduled(limit=limit), max_batches=4)
