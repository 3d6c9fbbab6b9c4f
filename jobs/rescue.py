"""The lease rescue: tasks whose agent stopped renewing their lease go back to the queue (or fail for good).

The builder's leader runs :func:`rescue_expired` every tick (duty ``rescue_expired_leases``). A
rescued attempt is decided and written exactly as an agent's report of a failure is
(:mod:`jobs.failure`), with one of two reasons:

* ``lease_expired``: the agent died or was cut off; a failed attempt, retried within its budget;
* ``outage``: the lease ended during an outage the cluster's pulse recorded (:mod:`jobs.pulse`:
  no builder reached PostgreSQL for a while, or it restarted, crash restarts included): the work
  was stopped by the outage, not by the task, so it is queued again at once without using the
  retry budget (within the site's bound of refunds, see :mod:`jobs.failure.decide`).

A lease that was still live when an outage began is not rescued before one lease length has
passed since the outage ended, so agents that were cut off by it reconnect and renew first. The
lease length is the one its holder was granted: every claim and renewal writes ``heartbeat_at``
and ``lease_expires_at`` together. The leader stamps the pulse at the start of each tick, before
its duties, so the outage is on record before the rescue looks.
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
from jobs.locks import lock_jobs_of_tasks, lock_key_counts
from jobs.outcomes import INTERRUPTED_BY_OUTAGE, LEASE_EXPIRED, Outcome, ReportResult

# The lease its holder was granted; the site's default for a row written before heartbeat_at was.
LEASE_LENGTH = "coalesce(lease_expires_at - heartbeat_at, make_interval(secs => %(default_lease)s))"

# Not yet: a lease live when a recorded outage began, until one lease length after it ended.
IN_GRACE_SQL = f"""
EXISTS (SELECT 1 FROM accs_outage o WHERE o.ended_at > %(now)s - {LEASE_LENGTH}
           AND lease_expires_at >= o.began_at)
"""

# Ended during a recorded outage (outage_ended_idx: the outages that ended after the lease did).
IN_OUTAGE_SQL = """
EXISTS (SELECT 1 FROM accs_outage o WHERE o.ended_at >= lease_expires_at AND o.began_at <= lease_expires_at)
"""

CANDIDATES_SQL = f"""
-- Served by task_lease_idx (held tasks by lease end). A lease in an outage's grace is skipped: its
-- holder may still be reconnecting to renew it.
SELECT id FROM accs_task
 WHERE status IN ('starting', 'running') AND lease_expires_at < %(now)s
   AND NOT {IN_GRACE_SQL}
 ORDER BY lease_expires_at LIMIT %(limit)s
"""

LOCK_EXPIRED_SQL = f"""
SELECT id, attempt, {IN_OUTAGE_SQL} FROM accs_task
 WHERE id = ANY(%(ids)s) AND job_id = ANY(%(jobs)s) AND status IN ('starting', 'running') AND lease_expires_at < %(now)s
   AND NOT {IN_GRACE_SQL}
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
        # A job another transaction holds is skipped, not waited for: its lock may belong to an agent's
        # session cut off inside a transaction, which the server ends only at its idle-in-transaction
        # timeout, and every other expired lease would wait as long. Its tasks are rescued at a later
        # run, once the lock is free.
        jobs = lock_jobs_of_tasks(cur, candidates, skip_locked=True)
        if not jobs:
            return result
        cur.execute(LOCK_EXPIRED_SQL, {**params, "ids": candidates, "jobs": jobs})
        expired = [_rescued(task_id, attempt, in_outage=in_outage) for task_id, attempt, in_outage in cur.fetchall()]
        if expired:
            # Retries and dead letters are two statements: their keys' counts first, in one.
            lock_key_counts(cur, [o.task_id for o in expired])
            touched = record_failures(cur, expired, result, now=now, source=BUILDER)
            finalize_jobs(cur, sorted(touched, key=str), now=now, source=BUILDER)
    return result


def _rescued(task_id: UUID, attempt: int, *, in_outage: bool) -> Outcome:
    """The outcome the rescue records for an expired lease."""
    if in_outage:
        return Outcome(task_id=task_id, attempt=attempt, status="interrupted", error_code=INTERRUPTED_BY_OUTAGE,
                       error="outage: the lease ended while PostgreSQL was out of reach; queued again without"
                             " using the retry budget")
    return Outcome(task_id=task_id, attempt=attempt, status="failed", error=f"{LEASE_EXPIRED}: no heartbeat",
                   error_code=LEASE_EXPIRED)
