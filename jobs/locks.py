"""The one lock order of the engine, in one place.

Every verb that changes rows takes its locks in this order, so no two transactions can wait
for each other in a cycle:

1. advisory locks (admission of a tenant or workflow, a node's or a service's claim room),
   sorted by key;
2. job rows, sorted by id (``FOR NO KEY UPDATE``: inserting tasks that reference a locked job
   is still allowed);
3. task rows, sorted by id;
4. the per-key held counts of keyed tasks (``accs_limit_key_held``), sorted by service and key.

A verb that needs no job lock (heartbeats, marking a task running) still takes its task locks
sorted by id. Claims never wait on a row (``SKIP LOCKED``). Behind a pooler the claim function
waits for its node's lock only, then merely tries each capped service's
(``pg_try_advisory_xact_lock``): a try never waits, so it cannot close a cycle.

An agent bounds its waits (:func:`bound_lock_waits`, ``SET LOCAL lock_timeout``): a claim waits
for a lock at most ``ACC_CLAIM_LOCK_WAIT_SEC``, a lease renewal a fraction of the lease, and a
wait that runs out rolls the transaction back (:func:`is_lock_timeout`) instead of queueing on.

The held counts are kept by the database's triggers (jobs.limit_keys): each statement that moves
held tasks takes its keys' count rows in that order. A transaction that moves held tasks in more
than one statement (a report that ends some tasks and fails others) first takes them all in one
statement (:func:`lock_key_counts`), so no later statement of it adds a row out of order.

After a task row, the database's own triggers (jobs.limit_keys) take two more, as a foreign key
check does: a task that becomes queued reads its service row ``FOR SHARE`` and a key row of the
keyed claim ``FOR KEY SHARE`` (shared: queueing tasks never wait for each other). Only two writers
conflict with them: a change of a service's key path (an operator's edit: it waits for the tasks
being queued, then locks the service's queued tasks in id order) and the keyed claim, which locks
key rows with ``SKIP LOCKED`` and so never waits. A transaction that holds a queued task of a
service and then queues another of the same service, while an operator changes that service's key
path, is the one cycle left; PostgreSQL detects it and fails one of the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from uuid import UUID

import psycopg

from jobs.narrow import WIDEN_IDS_SQL

# The held-count rows of the keys of the held tasks among the uuid array {ids}, locked in (service, key)
# order: the order the count triggers (jobs.limit_keys) take them in. The report function takes the
# same text.
KEY_COUNTS_LOCK_SQL = ("1 FROM accs_limit_key_held k WHERE (k.service_id, k.key) IN ("
                       "SELECT t.service_id, t.limit_key FROM accs_task t WHERE t.id = ANY({ids})"
                       " AND t.limit_key IS NOT NULL AND t.status IN ('starting', 'running'))"
                       " ORDER BY k.service_id, k.key FOR UPDATE")

# Transaction-scoped advisory locks on the keys of the text array {keys}, taken in the order of the
# lock's identity (the key's hash), so two keys whose hashes collide cannot invert the order between
# two transactions. The claim function (jobs.claim) takes its locks with the same text.
ADVISORY_LOCKS_SQL = ("pg_advisory_xact_lock(k.h) FROM (SELECT DISTINCT hashtext(x.key) AS h"
                      " FROM unnest({keys}) AS x(key) ORDER BY 1) k")
# The same lock on the text key {key}, only tried: true if taken, false at once if another
# transaction holds it. A try never waits, so it needs no place in the order.
TRY_ADVISORY_LOCK_SQL = "pg_try_advisory_xact_lock(hashtext({key}))"


# The rest of the current transaction waits for any lock at most {ms} (a text such as '1500ms'):
# SET LOCAL lock_timeout, as an expression, so it can go first in the statement that needs it.
# Transaction-scoped: nothing outlives the transaction, behind a transaction-mode pooler too.
LOCK_WAIT_SQL = "set_config('lock_timeout', {ms}, true)"
# PostgreSQL's largest lock_timeout (an int of milliseconds, about 24.8 days).
LOCK_WAIT_MAX_MS = 2_147_483_647


def lock_wait_ms(seconds: float) -> str:
    """Return ``seconds`` as a ``lock_timeout`` value: whole milliseconds, at least 1 (0 would mean no bound)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a lock wait must be a positive number of seconds, got {seconds!r}")
    return f"{max(1, min(LOCK_WAIT_MAX_MS, math.ceil(seconds * 1000)))}ms"



def bound_lock_waits(cur, *, seconds: float) -> None:
    """Make every lock wait of the rest of the current transaction end after ``seconds`` at most."""
    cur.execute("SELECT " + LOCK_WAIT_SQL.format(ms="%s"), [lock_wait_ms(seconds)])


def is_lock_timeout(exc: BaseException) -> bool:
    """Return whether ``exc`` (psycopg's, or Django's wrapping it) is a lock wait that ran out."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.errors.LockNotAvailable):
            return True
        seen = seen.__cause__
    return False


def advisory_locks(cur, keys: Iterable[str]) -> None:
    """Take transaction-scoped advisory locks on ``keys`` in sorted order."""
    ordered = sorted(set(keys))
    if ordered:
        cur.execute("SELECT " + ADVISORY_LOCKS_SQL.format(keys="%s::text[]"), [ordered])


def lock_jobs(cur, job_ids: Iterable[UUID | str]) -> list[UUID]:
    """Lock job rows sorted by id; return the ids that exist.

    A narrow start among the ids (jobs.narrow) becomes its job first, so a verb acts on a job just
    started as on any queued job.
    """
    ids = sorted({str(j) for j in job_ids})
    if not ids:
        return []
    cur.execute(WIDEN_IDS_SQL, {"ids": ids})
    cur.execute("SELECT id FROM accs_job WHERE id = ANY(%s::uuid[]) ORDER BY id FOR NO KEY UPDATE", [ids])
    return [r[0] for r in cur.fetchall()]


def lock_jobs_of_tasks(cur, task_ids: Iterable[UUID], *, skip_locked: bool = False) -> list[UUID]:
    """Lock the jobs of the given tasks, sorted by id (reading task rows takes no lock); return the ids
    locked (with ``skip_locked``, those another transaction holds are left out, not waited for)."""
    ids = sorted({str(t) for t in task_ids})
    if not ids:
        return []
    cur.execute("SELECT id FROM accs_job WHERE id IN (SELECT job_id FROM accs_task WHERE id = ANY(%s::uuid[]))"
                " ORDER BY id FOR NO KEY UPDATE" + (" SKIP LOCKED" if skip_locked else ""), [ids])
    return [r[0] for r in cur.fetchall()]


def lock_tasks(cur, task_ids: Iterable[UUID], *, skip_locked: bool = False) -> list[UUID]:
    """Lock task rows sorted by id; return the ids locked."""
    ids = sorted({str(t) for t in task_ids})
    if not ids:
        return []
    cur.execute("SELECT id FROM accs_task WHERE id = ANY(%s::uuid[]) ORDER BY id FOR UPDATE"
                + (" SKIP LOCKED" if skip_locked else ""), [ids])
    return [r[0] for r in cur.fetchall()]


def lock_key_counts(cur, task_ids: Iterable[UUID]) -> None:
    """Lock the held counts of the keys of those (locked) tasks that are held, in (service, key) order.

    For a transaction that moves held tasks out in more than one statement: each statement's
    trigger takes its own keys in order, but two statements could still take them out of order
    between them.
    """
    ids = sorted({str(t) for t in task_ids})
    if ids:
        cur.execute("SELECT " + KEY_COUNTS_LOCK_SQL.format(ids="%s::uuid[]"), [ids])


def lock_tasks_of_jobs(cur, job_ids: Sequence[UUID], *, where: str = "TRUE", params: Sequence = ()) -> list[UUID]:
    """Lock the tasks of locked jobs (optionally filtered by ``where`` on ``t``) sorted by id."""
    if not job_ids:
        return []
    cur.execute(f"SELECT t.id FROM accs_task t WHERE t.job_id = ANY(%s::uuid[]) AND {where} ORDER BY t.id FOR UPDATE",
                [[str(j) for j in job_ids], *params])
    return [r[0] for r in cur.fetchall()]
