"""The service and tenant an attempt carries (its task's, copied when it is written), and the filling of
attempts written before the copy existed.

The database's trigger ``accs_attempt_copy_task_refs`` (migration jobs.0038) copies them on every insert,
whoever inserts. Attempts older than it are filled by :func:`fill_missing`, in small batches each in its
own transaction (``manage.py accs_attempt_refs``), never one long UPDATE holding the rows' locks against
the running daemons. Until none is missing, :func:`refs_complete` says so and the readers count through
the task, as they did before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connection

#: Attempts filled per transaction: short enough that a daemon finishing one of them waits milliseconds.
FILL_BATCH = 5_000

MISSING_SQL = "SELECT EXISTS (SELECT FROM accs_attempt WHERE service_id IS NULL)"  # attempt_refs_missing_idx

FILL_SQL = """
-- The oldest attempts still missing their task's service and tenant (attempt_refs_missing_idx), filled.
-- The batch is picked once (MATERIALIZED): as a subquery in the WHERE, a plan that scans it again for
-- each row would skip the rows this statement already updated and take the next ones, past the limit.
WITH picked AS MATERIALIZED (
    SELECT m.id FROM accs_attempt m WHERE m.service_id IS NULL ORDER BY m.id LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
UPDATE accs_attempt a SET service_id = t.service_id, tenant_id = t.tenant_id
  FROM picked p, accs_task t
 WHERE a.id = p.id AND t.id = a.task_id
"""


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


__all__ = ["FILL_BATCH", "fill_missing", "refs_complete"]
