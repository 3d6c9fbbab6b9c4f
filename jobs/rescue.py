"""The lease rescue: tasks whose agent stopped renewing their lease go back to the queue (or fail for good).

The builder's leader runs :func:`rescue_expired` every tick (duty ``rescue_expired_leases``). A
rescued attempt is decided and written exactly as an agent's report of a failure is
(:mod:`jobs.failure`), with one of two reasons:

* ``lease_expired``: the agent died or was cut off; a failed attempt, retried within its budget;
* ``outage``: the lease ended while PostgreSQL itself was down (before its last start): the work
  was stopped by the outage, not by the task, so it is queued again at once and the attempt does
  not use up the retry budget.

After a PostgreSQL restart no lease is rescued before one lease length has passed since the
restart (``pg_postmaster_start_time()``), so agents that were cut off by the outage reconnect and
renew first. The lease length is the one its holder was granted: every claim and renewal writes
``heartbeat_at`` and ``lease_expires_at`` together.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.clock import db_now
from accs_site.conf import accs
from events.timeline import BUILDER
from jobs.failure.apply import record_failures
from jobs.finalize import finalize_jobs
from jobs.locks import lock_jobs_of_tasks
from jobs.outcomes import INTERRUPTED_BY_OUTAGE, LEASE_EXPIRED, Outcome, ReportResult

# The lease its holder was granted; the site's default for a row written before heartbeat_at was.
LEASE_LENGTH = "coalesce(lease_expires_at - heartbeat_at, make_interval(secs => %(default_lease)s))"

CANDIDATES_SQL = f"""
-- Served by task_lease_idx (held tasks by lease end). Skipped while the server started less than
-- one lease length ago: its holder may still be reconnecting to renew it.
SELECT id FROM accs_task
 WHERE status IN ('starting', 'running') AND lease_expires_at < %(now)s
   AND %(now)s - pg_postmaster_start_time() >= {LEASE_LENGTH}
 ORDER BY lease_expires_at LIMIT %(limit)s
"""

LOCK_EXPIRED_SQL = f"""
SELECT id, attempt, lease_expires_at < pg_postmaster_start_time() FROM accs_task
 WHERE id = ANY(%(ids)s) AND status IN ('starting', 'running') AND lease_expires_at < %(now)s
   AND %(now)s - pg_postmaster_start_time() >= {LEASE_LENGTH}
 ORDER BY id FOR UPDATE SKIP LOCKED
"""


def rescue_expired(*, limit: int = 500, now: datetime | None = None) -> ReportResult:
    """Requeue (or fail for good) up to ``limit`` tasks whose lease expired; return what changed."""
    result = ReportResult()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        now = now or db_now(cur)
        params: dict[str, Any] = {"now": now, "limit": limit, "default_lease": float(accs.heartbeat_ttl_sec)}
        cur.execute(CANDIDATES_SQL, params)
        candidates = [r[0] for r in cur.fetchall()]
        if not candidates:
            return result
        lock_jobs_of_tasks(cur, candidates)
        cur.execute(LOCK_EXPIRED_SQL, {**params, "ids": candidates})
        expired = [_rescued(task_id, attempt, in_outage=in_outage) for task_id, attempt, in_outage in cur.fetchall()]
        if expired:
            touched = record_failures(cur, expired, result, now=now, source=BUILDER)
            finalize_jobs(cur, sorted(touched, key=str), now=now, source=BUILDER)
    return result


def _rescued(task_id: UUID, attempt: int, *, in_outage: bool) -> Outcome:
    """The outcome the rescue records for an expired lease."""
    if in_outage:
        return Outcome(task_id=task_id, attempt=attempt, status="interrupted", error_code=INTERRUPTED_BY_OUTAGE,
                       error="outage: the lease ended while PostgreSQL was down; queued again without using the"
                             " retry budget")
    return Outcome(task_id=task_id, attempt=attempt, status="failed", error=f"{LEASE_EXPIRED}: no heartbeat",
                   error_code=LEASE_EXPIRED)
