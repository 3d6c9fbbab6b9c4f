"""Retention: delete finished jobs (with their tasks, attempts, step counts and artifacts) when old.

A finished job (done, partial, canceled) is kept for its tenant's ``retention_days``, a job that
ended in error (a dead letter) for ``retention_dead_days``; an empty field means the global
``ACC_RETENTION_DAYS`` / ``ACC_RETENTION_DEAD_DAYS``, and 0 keeps jobs for ever. Ages are measured
on PostgreSQL's clock.

:func:`prune_finished_jobs` does one bounded batch in one transaction:

1. pick the oldest due jobs, each tenant and class from its own partial index;
2. lock them (``FOR UPDATE SKIP LOCKED``, sorted by id, rechecking that they are still due),
   then their tasks (sorted by id, ``SKIP LOCKED``); a job any of whose tasks is locked by
   someone else waits for a later batch. Nothing here ever waits on live work;
3. with ``ACC_RETENTION_EXPORT``, write the batch to object storage as one JSONL object
   (``retention/YYYY/MM/DD/<batch>.jsonl``, one line per job with its tasks and their attempts,
   step counts and artifact rows) and read it back; a failure raises and deletes nothing. The
   locks taken above keep the exported rows exactly the rows deleted: no task, attempt or
   artifact row can be added to a locked job meanwhile;
4. delete attempts, artifact rows, step counts, tasks and jobs, record the artifacts' objects
   as to be deleted (``accs_object_deletion``), write one ``retention`` event and update the
   retention mark (what the dashboard shows as the last prune), then commit;
5. after the commit — of the outermost transaction: under the builder, the leader's fenced one,
   after its final fence check — delete the objects, then their to-do rows. A transaction that
   rolls back deletes no object; a crash after the commit leaves the to-do rows, and the
   ``delete_pruned_objects`` duty deletes those objects on its next pass. No row ever names a
   missing object, and nothing is repeated but the deletion of an absent object.

The timeline is not touched: events outlive their jobs and leave with their monthly partition.
A job is due only once every task of it is final and the last of them finished before the
retention age too: a job can end while tasks of it still run (a ``fail_job`` failure ends it
``error`` while siblings run on; a cancel ends it before its running tasks have stopped), and
their reports, logs and artifacts must still find their rows.

A job that a row of another table still references through a foreign key (an embedding site's
model, say) is kept, not an error: the references are read from PostgreSQL's catalog, so a table
added later is honoured without a change here.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.clock import db_now
from accs_site.conf import accs
from events.artifacts import JSONL_CONTENT_TYPE, schedule_object_deletions
from events.storage import get_storage, is_configured, save_verified
from events.timeline import EventRow, write_events
from jobs.states import TASK_FINAL, sql_in

log = logging.getLogger("accs.retention")

SOURCE = "jobs.retention"
EVENT_TYPE = "retention"
EXPORT_PREFIX = "retention"
# The tables pruned here; a foreign key from any other table keeps the job it points at.
OWNED_TABLES = ("accs_task", "accs_job_step", "accs_attempt", "accs_artifact")


# The dashboard's "last pruned" (jobs.models.RetentionMark): one row, updated by every batch that
# deleted something, in its transaction, so it never names a prune that rolled back.
MARK_NAME = "finished_jobs"
MARK_SQL = """
INSERT INTO accs_retention_mark AS m (name, last_pruned_at, jobs, tasks, artifacts, export_key, total_jobs,
                                      total_tasks, since)
VALUES (%(name)s, now(), %(jobs)s, %(tasks)s, %(artifacts)s, %(export_key)s, %(jobs)s, %(tasks)s, now())
ON CONFLICT (name) DO UPDATE
   SET last_pruned_at = EXCLUDED.last_pruned_at, jobs = EXCLUDED.jobs, tasks = EXCLUDED.tasks,
       artifacts = EXCLUDED.artifacts, export_key = EXCLUDED.export_key,
       total_jobs = m.total_jobs + EXCLUDED.jobs, total_tasks = m.total_tasks + EXCLUDED.tasks
"""


class ExportFailed(Exception):
    """Writing a batch to object storage failed; nothing of the batch was deleted."""


@dataclass
class PruneResult:
    """What one batch deleted (and, with export on, where it went)."""

    jobs: int = 0
    tasks: int = 0
    attempts: int = 0
    steps: int = 0
    artifacts: int = 0
    objects_deleted: int = 0
    export_key: str | None = None
    job_ids: list[UUID] = field(default_factory=list)


# The due condition per job, shared by the candidate scan and the locking recheck.
AGE_SQL = """
CASE WHEN j.status = 'error' THEN coalesce(t.retention_dead_days, %(dead_days)s)
     ELSE coalesce(t.retention_days, %(days)s) END
"""

# A job whose tasks are not all final, or whose last task finished after the cutoff, is not due
# yet (its job row may have ended long before: a fail_job failure or a cancel while tasks ran).
# One probe of the job's tasks (task_job_key_unique), per job the scan looks at.
SETTLED_SQL = f"""
AND NOT EXISTS (SELECT 1 FROM accs_task x WHERE x.job_id = j.id
                   AND (x.status NOT IN {sql_in(TASK_FINAL)} OR x.finished_at >= {{cutoff}}))
"""


def _settled(cutoff: str) -> str:
    """Return SQL (``AND NOT EXISTS ...`` on ``j``): every task of the job final before ``cutoff``."""
    return SETTLED_SQL.format(cutoff=cutoff)


_DONE_CUTOFF = "%(now)s - make_interval(days => coalesce(t.retention_days, %(days)s))"
_DEAD_CUTOFF = "%(now)s - make_interval(days => coalesce(t.retention_dead_days, %(dead_days)s))"

# Oldest due jobs first. Each tenant and class (dead letters apart) walks its own partial index
# (job_prune_idx / job_prune_dead_idx on tenant_id, finished_at) from the oldest end and stops
# after a batch, so a pass costs the batch, not the table; a class kept for ever (0 days) is not
# scanned at all. {kept} excludes jobs that other rows reference, so they cannot clog the batch.
CANDIDATES_SQL = """
-- retention: due finished jobs
SELECT c.id FROM accs_tenant t
CROSS JOIN LATERAL (
    (SELECT j.id, j.finished_at FROM accs_job j
      WHERE coalesce(t.retention_days, %(days)s) > 0
        AND j.tenant_id = t.id AND j.status IN ('done', 'partial', 'canceled')
        AND j.finished_at < %(now)s - make_interval(days => coalesce(t.retention_days, %(days)s)) {kept}
        {settled_done}
      ORDER BY j.finished_at LIMIT %(limit)s)
    UNION ALL
    (SELECT j.id, j.finished_at FROM accs_job j
      WHERE coalesce(t.retention_dead_days, %(dead_days)s) > 0
        AND j.tenant_id = t.id AND j.status = 'error'
        AND j.finished_at < %(now)s - make_interval(days => coalesce(t.retention_dead_days, %(dead_days)s)) {kept}
        {settled_dead}
      ORDER BY j.finished_at LIMIT %(limit)s)
) c
ORDER BY c.finished_at LIMIT %(limit)s
"""

# Lock order: job rows sorted by id, never waiting (a job someone holds is left for later). The
# recheck runs on the locked row version, so a job retried since the scan is not deleted.
LOCK_JOBS_SQL = """
-- retention: lock due jobs
SELECT j.id, %(now)s - make_interval(days => {age}) FROM accs_job j JOIN accs_tenant t ON t.id = j.tenant_id
 WHERE j.id = ANY(%(ids)s::uuid[]) AND j.status IN ('done', 'partial', 'error', 'canceled')
   AND ({age}) > 0 AND j.finished_at < %(now)s - make_interval(days => {age}) {kept}
 ORDER BY j.id FOR UPDATE OF j SKIP LOCKED
"""

LOCK_TASKS_SQL = f"""
-- retention: lock the jobs' tasks; a job with a task held elsewhere is left for a later batch.
-- MATERIALIZED: the locks are taken once, in id order, not per job by the correlated count.
-- The locked rows are the newest versions: a task a report finished since the scan is seen
-- here with its new finish, and keeps its job until that finish is old enough too.
WITH locked AS MATERIALIZED (
    SELECT id, job_id, status, finished_at FROM accs_task WHERE job_id = ANY(%(ids)s::uuid[])
     ORDER BY id FOR UPDATE SKIP LOCKED
)
SELECT j.id FROM unnest(%(ids)s::uuid[], %(cutoffs)s::timestamptz[]) AS j(id, cutoff)
 WHERE (SELECT count(*) FROM accs_task t WHERE t.job_id = j.id)
     = (SELECT count(*) FROM locked l WHERE l.job_id = j.id AND l.status IN {sql_in(TASK_FINAL)}
                                          AND l.finished_at < j.cutoff)
"""

# One JSON document per job; row_to_json keeps every column, so a new column is exported too.
EXPORT_SQL = """
-- retention: export a batch
SELECT json_build_object(
    'job', row_to_json(j),
    'tasks', coalesce((SELECT json_agg(to_jsonb(t) || jsonb_build_object('attempts', coalesce(
                 (SELECT json_agg(row_to_json(a) ORDER BY a.attempt_no) FROM accs_attempt a WHERE a.task_id = t.id),
                 '[]'::json)) ORDER BY t.id) FROM accs_task t WHERE t.job_id = j.id), '[]'::json),
    'steps', coalesce((SELECT json_agg(row_to_json(s) ORDER BY s.position, s.step_key)
                         FROM accs_job_step s WHERE s.job_id = j.id), '[]'::json),
    'artifacts', coalesce((SELECT json_agg(row_to_json(r) ORDER BY r.id)
                             FROM accs_artifact r WHERE r.job_id = j.id), '[]'::json)
)::text
  FROM accs_job j WHERE j.id = ANY(%(ids)s::uuid[]) ORDER BY j.id
"""

DELETE_SQL = (
    ("attempts", "DELETE FROM accs_attempt"
                 " WHERE task_id IN (SELECT id FROM accs_task WHERE job_id = ANY(%(ids)s::uuid[]))"),
    ("artifacts", "DELETE FROM accs_artifact WHERE job_id = ANY(%(ids)s::uuid[])"
                  " OR task_id IN (SELECT id FROM accs_task WHERE job_id = ANY(%(ids)s::uuid[]))"
                  " RETURNING bucket, key"),
    ("steps", "DELETE FROM accs_job_step WHERE job_id = ANY(%(ids)s::uuid[])"),
    ("tasks", "DELETE FROM accs_task WHERE job_id = ANY(%(ids)s::uuid[])"),
    ("jobs", "DELETE FROM accs_job WHERE id = ANY(%(ids)s::uuid[])"),
)

# Foreign keys into jobs or tasks from tables this module does not prune.
REFERENCES_SQL = """
SELECT c.conrelid::regclass::text, a.attname, c.confrelid::regclass::text
  FROM pg_constraint c
  JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
 WHERE c.contype = 'f' AND cardinality(c.conkey) = 1
   AND c.confrelid IN ('accs_job'::regclass, 'accs_task'::regclass)
   AND c.conrelid <> ALL(%s::regclass[])
 ORDER BY 1, 2
"""


def prune_finished_jobs(*, limit: int, now: datetime | None = None, export: bool | None = None) -> PruneResult:
    """Delete up to ``limit`` finished jobs past their retention, in one transaction; return the counts.

    ``now`` defaults to PostgreSQL's clock; ``export`` to ``ACC_RETENTION_EXPORT``. With export
    on, raise :class:`ExportFailed` (nothing deleted) when the batch cannot be stored; without
    storage, prune nothing. Artifact objects are deleted once the outermost transaction has
    committed: ``objects_deleted`` counts them when this call's own transaction was the outermost.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    export = accs.retention_export if export is None else export
    if export and not is_configured():
        log.warning("ACC_RETENTION_EXPORT is on but artifact storage is not configured; pruning nothing")
        return PruneResult()
    result = PruneResult()
    with transaction.atomic(), connection.cursor() as cur:
        now = now or db_now(cur)
        params: dict[str, Any] = {"now": now, "days": accs.retention_days, "dead_days": accs.retention_dead_days,
                                  "limit": limit}
        kept = _kept_clause(cur)
        cur.execute(CANDIDATES_SQL.format(kept=kept, settled_done=_settled(_DONE_CUTOFF),
                                          settled_dead=_settled(_DEAD_CUTOFF)), params)
        ids = [row[0] for row in cur.fetchall()]
        cutoffs: list[datetime] = []
        if ids:
            cur.execute(LOCK_JOBS_SQL.format(age=AGE_SQL, kept=kept), {**params, "ids": ids})
            locked = cur.fetchall()
            ids, cutoffs = [row[0] for row in locked], [row[1] for row in locked]
        if ids:
            cur.execute(LOCK_TASKS_SQL, {"ids": ids, "cutoffs": cutoffs})
            ids = sorted(row[0] for row in cur.fetchall())
        if not ids:
            return result
        if export:
            result.export_key = _export(cur, ids, now=now)
        objects = _delete(cur, ids, result)
        schedule_object_deletions(cur, objects, on_commit=lambda n: setattr(result, "objects_deleted", n))
        result.job_ids = ids
        write_events([EventRow(
            type=EVENT_TYPE, source=SOURCE,
            message=f"pruned {result.jobs} finished job(s) with {result.tasks} task(s)"
                    + (f", exported to {result.export_key}" if result.export_key else ""),
            data={"jobs": result.jobs, "tasks": result.tasks, "attempts": result.attempts, "steps": result.steps,
                  "artifacts": result.artifacts, "export_key": result.export_key},
        )], cursor=cur)
        cur.execute(MARK_SQL, {"name": MARK_NAME, "jobs": result.jobs, "tasks": result.tasks,
                               "artifacts": result.artifacts, "export_key": result.export_key or ""})
    log.info("pruned %d job(s), %d task(s), %d attempt(s), %d artifact(s)",
             result.jobs, result.tasks, result.attempts, result.artifacts)
    return result


def _kept_clause(cur) -> str:
    """Return SQL (``AND NOT EXISTS ...`` on ``j``) excluding jobs that rows of other tables reference."""
    cur.execute(REFERENCES_SQL, [list(OWNED_TABLES)])
    clauses = []
    for table, column, target in cur.fetchall():
        ref = f"{connection.ops.quote_name(table)} r"
        col = f"r.{connection.ops.quote_name(column)}"
        if target == "accs_job":
            clauses.append(f"AND NOT EXISTS (SELECT 1 FROM {ref} WHERE {col} = j.id)")
        else:
            clauses.append(f"AND NOT EXISTS (SELECT 1 FROM {ref} JOIN accs_task rt ON rt.id = {col}"
                           f" WHERE rt.job_id = j.id)")
    if not is_configured():
        # Their objects could not be deleted: keep such jobs until storage is configured.
        clauses.append("AND NOT EXISTS (SELECT 1 FROM accs_artifact ra WHERE ra.job_id = j.id)")
    return " ".join(clauses)


def _export(cur, ids: list[UUID], *, now: datetime) -> str:
    """Store the batch as one JSONL object, read it back, and return its key; raise ExportFailed."""
    cur.execute("SET LOCAL TimeZone = 'UTC'")  # row_to_json writes times in the session's zone
    cur.execute(EXPORT_SQL, {"ids": ids})
    body = "".join(row[0] + "\n" for row in cur.fetchall()).encode()
    key = f"{EXPORT_PREFIX}/{now:%Y/%m/%d}/{now:%H%M%S}-{uuid.uuid4().hex[:12]}.jsonl"
    try:
        save_verified(get_storage(action=f"export pruned jobs to {key}"), key, body, content_type=JSONL_CONTENT_TYPE)
    except Exception as exc:  # noqa: BLE001 - any failure keeps every row of the batch
        raise ExportFailed(f"exporting {len(ids)} pruned job(s) to {key} failed: {type(exc).__name__}: {exc}; "
                           "nothing was deleted") from exc
    return key


def _delete(cur, ids: list[UUID], result: PruneResult) -> list[tuple[str, str]]:
    """Delete the locked jobs' rows, children first; return the artifacts' (bucket, key)."""
    objects: list[tuple[str, str]] = []
    for what, sql in DELETE_SQL:
        cur.execute(sql, {"ids": ids})
        if what == "artifacts":
            objects = list(cur.fetchall())
        setattr(result, what, cur.rowcount if what != "artifacts" else len(objects))
    return objects
