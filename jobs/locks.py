"""The one lock order of the engine, in one place.

Every verb that changes rows takes its locks in this order, so no two transactions can wait
for each other in a cycle:

1. advisory locks (admission of a tenant or workflow, a node's or a service's claim room),
   sorted by key;
2. job rows, sorted by id (``FOR NO KEY UPDATE``: inserting tasks that reference a locked job
   is still allowed);
3. task rows, sorted by id.

A verb that needs no job lock (heartbeats, marking a task running) still takes its task locks
sorted by id. Claims never wait on a row (``SKIP LOCKED``). Behind a pooler the claim function
waits for its node's lock only, then merely tries each capped service's
(``pg_try_advisory_xact_lock``): a try never waits, so it cannot close a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from uuid import UUID

# Transaction-scoped advisory locks on the keys of the text array {keys}, taken in the order of the
# lock's identity (the key's hash), so two keys whose hashes collide cannot invert the order between
# two transactions. The claim function (jobs.claim) takes its locks with the same text.
ADVISORY_LOCKS_SQL = ("pg_advisory_xact_lock(k.h) FROM (SELECT DISTINCT hashtext(x.key) AS h"
                      " FROM unnest({keys}) AS x(key) ORDER BY 1) k")
# The same lock on the text key {key}, only tried: true if taken, false at once if another
# transaction holds it. A try never waits, so it needs no place in the order.
TRY_ADVISORY_LOCK_SQL = "pg_try_advisory_xact_lock(hashtext({key}))"


def advisory_locks(cur, keys: Iterable[str]) -> None:
    """Take transaction-scoped advisory locks on ``keys`` in sorted order."""
    ordered = sorted(set(keys))
    if ordered:
        cur.execute("SELECT " + ADVISORY_LOCKS_SQL.format(keys="%s::text[]"), [ordered])


def lock_jobs(cur, job_ids: Iterable[UUID | str]) -> list[UUID]:
    """Lock job rows sorted by id; return the ids that exist."""
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return []
    cur.execute("SELECT id FROM accs_job WHERE id = ANY(%s::uuid[]) ORDER BY id FOR NO KEY UPDATE", [ids])
    return [r[0] for r in cur.fetchall()]


def lock_jobs_of_tasks(cur, task_ids: Iterable[UUID]) -> list[UUID]:
    """Lock the jobs of the given tasks, sorted by id (reading task rows takes no lock)."""
    ids = sorted({str(t) for t in task_ids})
    if not ids:
        return []
    cur.execute("SELECT id FROM accs_job WHERE id IN (SELECT job_id FROM accs_task WHERE id = ANY(%s::uuid[]))"
                " ORDER BY id FOR NO KEY UPDATE", [ids])
    return [r[0] for r in cur.fetchall()]


def lock_tasks(cur, task_ids: Iterable[UUID], *, skip_locked: bool = False) -> list[UUID]:
    """Lock task rows sorted by id; return the ids locked."""
    ids = sorted({str(t) for t in task_ids})
    if not ids:
        return []
    cur.execute("SELECT id FROM accs_task WHERE id = ANY(%s::uuid[]) ORDER BY id FOR UPDATE"
                + (" SKIP LOCKED" if skip_locked else ""), [ids])
    return [r[0] for r in cur.fetchall()]


def lock_tasks_of_jobs(cur, job_ids: Sequence[UUID], *, where: str = "TRUE", params: Sequence = ()) -> list[UUID]:
    """Lock the tasks of locked jobs (optionally filtered by ``where`` on ``t``) sorted by id."""
    if not job_ids:
        return []
    cur.execute(f"SELECT t.id FROM accs_task t WHERE t.job_id = ANY(%s::uuid[]) AND {where} ORDER BY t.id FOR UPDATE",
                [[str(j) for j in job_ids], *params])
    return [r[0] for r in cur.fetchall()]
