"""The service, the tenant and the claimable time an attempt carries (its task's, copied when it is
written), and the filling of attempts written before the copy existed.

The database's trigger ``accs_attempt_copy_task_refs`` (migrations jobs.0038 and jobs.0040) copies them
on every insert, whoever inserts: the task's service and tenant, and its ``next_attempt_at`` (when it
became claimable for this attempt; the claim leaves it as it was). Attempts older than it are filled by
:func:`fill_missing`, in small batches each in its own transaction (``manage.py accs_attempt_refs``),
never one long UPDATE holding the rows' locks against the running daemons. Until none is missing,
:func:`refs_complete` says so and the readers count through the task, as they did before.

An older attempt's claimable time is known only while it is its task's last attempt (a retry moves the
task's ``next_attempt_at``); the others keep none, as the charts read through the task never had one.
Attempts that got their service and tenant before jobs.0040 (the trigger or the fill of jobs.0038) get
their claimable time from :func:`fill_claimable` (``accs_attempt_refs --claimable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connection

#: Attempts filled per transaction: short enough that a daemon finishing one of them waits milliseconds.
FILL_BATCH = 5_000

MISSING_SQL = "SELECT EXISTS (SELECT FROM accs_attempt WHERE service_id IS NULL)"  # attempt_refs_missing_idx

#: When the task still holds an older attempt's claimable time: the attempt is its last and started after
#: it (a failed last attempt whose retry is not yet claimed has moved ``next_attempt_at`` past its start).
KNOWN_CLAIMABLE = "a.attempt_no = t.attempt AND t.next_attempt_at <= a.started_at"

FILL_SQL = """
-- The oldest attempts still missing their task's service and tenant (attempt_refs_missing_idx), filled.
-- The batch is picked once (MATERIALIZED): as a subquery in the WHERE, a plan that scans it again for
-- each row would skip the rows this statement already updated and take the next ones, past the limit.
WITH picked AS MATERIALIZED (
    SELECT m.id FROM accs_attempt m WHERE m.service_id IS NULL ORDER BY m.id LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
UPDATE accs_attempt a SET service_id = t.service_id, tenant_id = t.tenant_id,
       claimable_at = CASE WHEN {known} THEN t.next_attempt_at END
  FROM picked p, accs_task t
 WHERE a.id = p.id AND t.id = a.task_id
""".format(known=KNOWN_CLAIMABLE)

CLAIMABLE_SQL = """
-- The next attempts by primary key after %(after)s (a walk, so an attempt whose time is unknown is read
-- once per run), and of those the ones lacking a claimable time their task still holds, filled.
WITH picked AS MATERIALIZED (
    SELECT m.id FROM accs_attempt m WHERE m.id > %(after)s ORDER BY m.id LIMIT %(batch)s
), filled AS (
    UPDATE accs_attempt a SET claimable_at = t.next_attempt_at
      FROM picked p, accs_task t
     WHERE a.id = p.id AND t.id = a.task_id AND a.claimable_at IS NULL AND {known}
    RETURNING a.id
)
SELECT (SELECT max(id) FROM picked), (SELECT count(*) FROM picked), (SELECT count(*) FROM filled)
""".format(known=KNOWN_CLAIMABLE)


def refs_complete(cur: Any) -> bool:
    """True when every attempt carries its task's service and tenant (one probe of a partial index)."""
    cur.execute(MISSING_SQL)
    return not cur.fetchone()[0]


def fill_missing(*, batch: int = FILL_BATCH, progress: Callable[[int], None] | None = None) -> int:
    """Copy the task's service and tenant onto every attempt missing them, ``batch`` attempts per
    transaction; return how many were filled. Attempts another transaction holds are left for a later run."""
    if batch < 1:
        raise ValueError(f"a batch is at least one attempt, got {batch}")
    filled = 0
    while True:
        with connection.cursor() as cur:  # autocommit: each UPDATE is its own transaction
            cur.execute(FILL_SQL, {"batch": batch})
            done = cur.rowcount
        filled += done
        if progress and done:
            progress(filled)
        if done == 0:
            return filled


def fill_claimable(*, batch: int = FILL_BATCH, progress: Callable[[int, int], None] | None = None) -> int:
    """Copy the claimable time the task still holds onto each attempt lacking it, walking every attempt by
    primary key, ``batch`` per transaction; return how many were filled. ``progress(walked, filled)``."""
    if batch < 1:
        raise ValueError(f"a batch is at least one attempt, got {batch}")
    after, walked, filled = 0, 0, 0
    while True:
        with connection.cursor() as cur:  # autocommit: each UPDATE is its own transaction
            cur.execute(CLAIMABLE_SQL, {"after": after, "batch": batch})
            last, read, done = cur.fetchone()
        if last is None:
            return filled
        after, walked, filled = last, walked + read, filled + done
        if progress:
            progress(walked, filled)


__all__ = ["FILL_BATCH", "KNOWN_CLAIMABLE", "fill_claimable", "fill_missing", "refs_complete"]
