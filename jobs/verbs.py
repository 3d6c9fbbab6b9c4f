"""Operators' verbs on jobs and tasks: cancel, retry, approve, reject.

Each verb is one transaction that takes its locks in the engine's one order (:mod:`jobs.locks`:
advisory locks, then the job, then its tasks sorted by id), reads PostgreSQL's clock, changes
what still applies and writes an event per change. A verb that no longer applies changes
nothing and says why in its :class:`ActionResult`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.admin_kit import ActionResult
from accs_site.clock import db_now
from accs_site.conf import accs
from events.timeline import EventRow, operator_source, write_events
from jobs.admission import readmit, tenant_lock_key, workflow_lock_key
from jobs.finalize import JOB_FAILED_REASON, finalize_jobs, reset_step_flags, rewait_always, skip_unstarted
from jobs.locks import advisory_locks, lock_jobs, lock_tasks_of_jobs
from jobs.models import ApprovalState, JobStatus
from jobs.notify import builder_channel, notify, service_channel
from jobs.states import (
    JOB_ACTIVE,
    JOB_ADMITTED,
    JOB_RETRYABLE,
    JOB_VERBS,
    TASK_HELD,
    TASK_RETRYABLE,
    TASK_UNSTARTED,
    TASK_VERBS,
    sql_in,
)
from tenants.accounts import user_id_named


@dataclass(frozen=True)
class Note:
    """Why tasks and jobs are retried: words for their status events' messages, and data the events carry."""

    task: str = "retry"
    job: str = "retry"
    data: dict[str, Any] = field(default_factory=dict)


TASK_RETRY = Note(job="task retried")


def _job_event(cur, job_id, message: str, *, by: str, level: str = "info", data: dict | None = None) -> None:
    write_events([EventRow(type="status", message=message, job_id=job_id, source=operator_source(by), level=level,
                           data=data or {})], cursor=cur)


def _admission_locks_for_jobs(cur, job_ids: Sequence[str]) -> None:
    """Take the advisory locks the jobs' admission counts under (before any row lock)."""
    cur.execute("SELECT j.tenant_id, j.workflow_id, tn.max_in_flight, coalesce(w.max_active_jobs, 0) FROM accs_job j"
                " JOIN accs_tenant tn ON tn.id = j.tenant_id LEFT JOIN accs_workflow w ON w.id = j.workflow_id"
                " WHERE j.id = ANY(%s::uuid[])", [list(job_ids)])
    keys = []
    for tenant_id, workflow_id, tenant_cap, wf_cap in cur.fetchall():
        keys += ([tenant_lock_key(tenant_id)] if tenant_cap else []) + (
            [workflow_lock_key(workflow_id)] if workflow_id and wf_cap else [])
    advisory_locks(cur, keys)


def cancel_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Cancel a queued, waiting or running job: unstarted tasks are canceled, running ones told to stop."""
    source = operator_source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        lock_tasks_of_jobs(cur, [job_id])
        now = now or db_now(cur)
        cur.execute(f"SELECT status FROM accs_job WHERE id = %s AND status IN {sql_in(JOB_VERBS['cancel'].statuses)}",
                    [job_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "job is not queued, waiting or running; nothing to cancel")
        cur.execute("UPDATE accs_job SET status = 'canceled', finished_at = %s, updated_at = %s,"
                    " error_code = 'canceled', error_message = %s WHERE id = %s",
                    [now, now, f"canceled by {by or 'api'}", job_id])
        _job_event(cur, job_id, f"job {row[0]} → canceled", by=by, level="warn",
                   data={"from": row[0], "to": "canceled"})
        write_events(skip_unstarted(cur, [job_id], now=now, source=source, reason="job canceled", to="canceled"),
                     cursor=cur)
        cur.execute("UPDATE accs_task SET cancel_requested_at = %s"
                    " WHERE job_id = %s AND status IN ('starting', 'running')"
                    " AND cancel_requested_at IS NULL RETURNING id, attempt", [now, job_id])
        held = sorted(cur.fetchall())  # the tasks' order of creation, as skip_unstarted's events
        write_events([EventRow(type="cancel",
                               message="cancel requested; the agent stops the task at its next heartbeat",
                               job_id=job_id, task_id=t, attempt=a, source=source, level="warn")
                      for t, a in held], cursor=cur)
        finalize_jobs(cur, [job_id], now=now, source=source)
    return ActionResult(True, f"job canceled ({len(held)} running task(s) told to stop)")


def _job_of_task(cur, task_id: UUID) -> UUID | None:
    cur.execute("SELECT job_id FROM accs_task WHERE id = %s", [task_id])
    row = cur.fetchone()
    return row[0] if row else None


def cancel_task(task_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Cancel one task: waiting/queued/scheduled → canceled; starting/running → the agent is told to stop."""
    source = operator_source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        job_id = _job_of_task(cur, task_id)
        if job_id is None:
            return ActionResult(False, "no such task")
        lock_jobs(cur, [job_id])
        lock_tasks_of_jobs(cur, [job_id], where="t.id = %s", params=[task_id])
        now = now or db_now(cur)
        cur.execute(f"WITH o AS (SELECT id, status FROM accs_task WHERE id = %s AND status IN {sql_in(TASK_UNSTARTED)})"
                    " UPDATE accs_task t SET status = 'canceled', finished_at = %s, updated_at = %s,"
                    " error_code = 'canceled' FROM o WHERE t.id = o.id RETURNING o.status", [task_id, now, now])
        row = cur.fetchone()
        if row:
            write_events([EventRow(type="status", message=f"task {row[0]} → canceled", job_id=job_id, task_id=task_id,
                                   source=source, level="warn", data={"from": row[0], "to": "canceled"})], cursor=cur)
            finalize_jobs(cur, [job_id], now=now, source=source)
            return ActionResult(True, "task canceled")
        # A held task is told to stop once (TASK_VERBS): asking again would change nothing.
        cur.execute(f"UPDATE accs_task SET cancel_requested_at = %s WHERE id = %s AND status IN {sql_in(TASK_HELD)}"
                    " AND cancel_requested_at IS NULL RETURNING attempt", [now, task_id])
        row = cur.fetchone()
        if row:
            write_events([EventRow(type="cancel", message="cancel requested", job_id=job_id, task_id=task_id,
                                   attempt=row[0], source=source, level="warn")], cursor=cur)
            return ActionResult(True, "cancel requested; the agent stops the task at its next heartbeat")
        cur.execute(f"SELECT 1 FROM accs_task WHERE id = %s AND status IN {sql_in(TASK_HELD)}", [task_id])
        if cur.fetchone():
            return ActionResult(False, "cancel already requested; the agent stops the task at its next heartbeat")
    return ActionResult(False, "task is already finished; nothing to cancel")


# Whether the task's service is blocked on its host (accs_host_block, placed by an operator).
HOST_BLOCKED_SQL = ("EXISTS (SELECT 1 FROM accs_host_block b WHERE b.host_id = {t}.host_id"
                    " AND b.service_id = {t}.service_id)")


def _reset_tasks(cur, job_ids: Sequence[UUID], *, only: Sequence[UUID] | None = None,
                 seen: Mapping[UUID, datetime] | None = None, statuses: Iterable[str] = TASK_RETRYABLE,
                 now: datetime, source: str, why: Note) -> list[tuple]:
    """Put failed/skipped/canceled/blocked tasks of (locked) jobs back: queued, or waiting if it has deps.

    ``only`` limits the reset to those tasks; ``seen`` to tasks still finished at the time the
    caller saw (a task retried and finished again meanwhile is another failure, left alone).
    The retry budget is renewed: ``max_attempts`` becomes the attempts used so far plus the
    service's budget. Attempt numbers never go back, so each Attempt row keeps its number and a
    late report from an earlier attempt stays fenced. A task whose service is blocked on its host
    (a block placed while it was failed, say) becomes ``blocked``, as it would be created now, and
    a blocked task whose block is still there is left as it is. Return (task id, new status,
    service id, job id).
    """
    if not job_ids:
        return []
    ids = [str(t) for t in only] if only is not None else None
    seen_ids = [str(t) for t in seen] if seen is not None else None
    cur.execute(
        "WITH o AS (SELECT t.id, t.status, " + HOST_BLOCKED_SQL.format(t="t") + " AS host_blocked"
        "           FROM accs_task t WHERE t.job_id = ANY(%s::uuid[])"
        "           AND (%s::uuid[] IS NULL OR t.id = ANY(%s::uuid[]))"
        f"           AND t.status IN {sql_in(statuses)}"
        # The finished_at the caller saw identifies the failure it means to retry.
        "           AND (%s::uuid[] IS NULL OR (t.id, t.finished_at) IN"
        "                (SELECT * FROM unnest(%s::uuid[], %s::timestamptz[]))))"
        " UPDATE accs_task t SET status = CASE WHEN o.host_blocked THEN 'blocked'"
        "                                      WHEN cardinality(t.depends_on) = 0 THEN 'queued' ELSE 'waiting' END,"
        "  max_attempts = t.attempt + s.max_attempts,"
        "  next_attempt_at = %s, updated_at = %s, finished_at = CASE WHEN o.host_blocked THEN %s END,"
        "  error_code = CASE WHEN o.host_blocked THEN 'host_blocked' ELSE '' END,"
        "  error_message = CASE WHEN o.host_blocked THEN s.key || ' is blocked on '"
        "                       || (SELECT h.name FROM accs_host h WHERE h.id = t.host_id) ELSE '' END,"
        "  results = NULL, progress = NULL, claimed_by = '', lease_expires_at = NULL, cancel_requested_at = NULL"
        "  FROM o, accs_service s WHERE t.id = o.id AND s.id = t.service_id"
        "   AND NOT (o.status = 'blocked' AND o.host_blocked)"
        " RETURNING t.id, t.status, t.service_id, t.job_id, o.status, t.error_message",
        [[str(j) for j in job_ids], ids, ids, seen_ids, seen_ids, list(seen.values()) if seen is not None else None,
         now, now, now],
    )
    # RETURNING comes in the rows' physical order, which moves from run to run: the timeline lists
    # the tasks' moves (one transaction, one time) in the order of their ids, as they were created.
    rows = sorted(cur.fetchall(), key=lambda row: row[0])
    write_events([EventRow(type="status", job_id=job, task_id=t, source=source,
                           level="warn" if st == "blocked" else "info",
                           message=(f"task {frm} → blocked ({why.task}: {msg})" if st == "blocked"
                                    else f"task {frm} → {st} ({why.task}, attempts reset)"),
                           data={"from": frm, "to": st, "retry": True, **why.data})
                  for t, st, _, job, frm, msg in rows], cursor=cur)
    return [r[:4] for r in rows]


def _notify_services(cur, service_ids: Iterable[int]) -> None:
    ids = sorted(set(service_ids))
    if ids:
        cur.execute("SELECT key FROM accs_service WHERE id = ANY(%s)", [ids])
        notify(cur, [service_channel(r[0]) for r in cur.fetchall()])


def _back_to_work(cur, job_id: UUID, job: tuple, *, by: str, now: datetime, why: Note) -> str:
    """Move a finished job back to waiting (or queued, through admission); return the new status."""
    status, _approval, instantiated, tenant_id, workflow_id = job[:5]
    source = operator_source(by)
    if instantiated:
        new_status = readmit(cur, job_id, tenant_id=tenant_id, workflow_id=workflow_id, now=now, source=source)
    else:
        new_status = "queued"
        notify(cur, [builder_channel()])
    cur.execute("UPDATE accs_job SET status = %s, finished_at = NULL, error_code = '', error_message = '',"
                " updated_at = %s WHERE id = %s", [new_status, now, job_id])
    _job_event(cur, job_id, f"job {status} → {new_status} ({why.job})", by=by,
               data={"from": status, "to": new_status, **why.data})
    return new_status


def _locked_jobs(cur, job_ids: Iterable[UUID | str]) -> dict[UUID, tuple[Any, ...]]:
    """Lock jobs and all their tasks in the engine's order; return each existing job's state.

    The state is (status, approval, instantiated, tenant id, workflow id, finished_at).
    """
    ids = sorted({str(j) for j in job_ids})
    _admission_locks_for_jobs(cur, ids)
    locked = lock_jobs(cur, ids)
    if not locked:
        return {}
    lock_tasks_of_jobs(cur, locked)
    cur.execute("SELECT id, status, approval_state, started_at IS NOT NULL, tenant_id, workflow_id, finished_at"
                " FROM accs_job WHERE id = ANY(%s::uuid[])", [[str(j) for j in locked]])
    return {r[0]: r[1:] for r in cur.fetchall()}


def _settle(cur, rows: list[tuple], back: dict[UUID, str], *, now: datetime, source: str) -> None:
    """Forget the retried jobs' step flags, wake the services of queued tasks, finalize admitted jobs.

    A queued ``always`` task whose dependency was just re-queued goes back to waiting first.
    """
    if back:
        reset_step_flags(cur, list(back))
        write_events(rewait_always(cur, list(back), now=now, source=source), cursor=cur)
    admitted = sorted(j for j, st in back.items() if st in JOB_ADMITTED)
    if admitted:
        _notify_services(cur, [r[2] for r in rows if r[1] == "queued" and r[3] in admitted])
        finalize_jobs(cur, admitted, now=now, source=source)


def _ids(ids: Iterable[UUID] | Mapping[UUID, datetime]) -> tuple[list[UUID], dict[UUID, datetime] | None]:
    """Return the ids as UUIDs in the caller's order, and the ``finished_at`` seen per id if given."""
    if isinstance(ids, Mapping):
        seen = {UUID(str(k)): v for k, v in ids.items()}
        return list(seen), seen
    return [UUID(str(i)) for i in ids], None


def _stopping(cur, job_ids: Iterable[UUID]) -> dict[UUID, int]:
    """Return, per job, how many of its tasks were told to stop (a cancel) and still run."""
    cur.execute("SELECT job_id, count(*) FROM accs_task WHERE job_id = ANY(%s::uuid[])"
                f" AND status IN {sql_in(TASK_HELD)} AND cancel_requested_at IS NOT NULL GROUP BY job_id",
                [[str(j) for j in job_ids]])
    return dict(cur.fetchall())


def _still_stopping(count: int) -> ActionResult:
    # Retried now, the job would be ended again by those tasks' canceled reports: refuse, and say when.
    return ActionResult(False, f"job is still stopping: {count} task(s) told to stop by its cancel are still "
                               "running; retry it once they have stopped")


def retry_jobs(job_ids: Iterable[UUID] | Mapping[UUID, datetime], *, by: str = "", now: datetime | None = None,
               statuses: Iterable[str] = JOB_RETRYABLE, why: Note = Note()) -> dict[UUID, ActionResult]:
    """Put failed, partial or canceled jobs back to work in one transaction: their unsuccessful tasks are reset.

    Each goes back through admission: under a workflow or tenant cap it waits, queued, for its
    turn. A job canceled while it waited for approval goes back to waiting for approval. Given a
    mapping of job id → the ``finished_at`` the caller saw, a job that has finished again since
    (someone else retried it) is left alone. ``statuses`` narrows which final states are retried.
    A job with tasks that were told to stop (a cancel) and still run is refused with that reason:
    it can be retried once they have stopped.
    """
    ids, seen = _ids(job_ids)
    rule = JOB_VERBS["retry"]
    allowed = frozenset(statuses) & rule.statuses
    source = operator_source(by)
    out: dict[UUID, ActionResult] = {}
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        jobs = _locked_jobs(cur, ids)
        now = now or db_now(cur)
        stopping = _stopping(cur, jobs)
        for job_id in ids:
            job = jobs.get(job_id)
            if job is None:
                out[job_id] = ActionResult(False, "no such job")
            elif job[1] not in rule.approvals:
                out[job_id] = ActionResult(False, "job was rejected; start a new job instead")
            elif job[0] not in allowed:
                out[job_id] = ActionResult(False, f"job is {job[0]}; only {_listed(allowed)} jobs can be retried")
            elif seen is not None and job[5] != seen[job_id]:
                out[job_id] = ActionResult(False, "job was retried and finished again since; left alone")
            elif stopping.get(job_id) and not rule.while_stopping:
                out[job_id] = _still_stopping(stopping[job_id])
        todo = sorted((j for j in ids if j not in out), key=str)
        rows = _reset_tasks(cur, todo, now=now, source=source, why=why)
        back = {j: _back_to_work(cur, j, jobs[j], by=by, now=now, why=why) for j in todo}
        _settle(cur, rows, back, now=now, source=source)
    for job_id, new_status in back.items():
        approval, instantiated = jobs[job_id][1:3]
        waits = " (waiting for approval)" if approval == ApprovalState.PENDING else (
            " (waiting for admission)" if new_status == "queued" and instantiated else "")
        reset = sum(1 for r in rows if r[3] == job_id)
        out[job_id] = ActionResult(True, f"job back to {new_status}{waits}; {reset} task(s) reset")
    return out


def _listed(statuses: Iterable[str]) -> str:
    """Name job states for people: ``failed, partial or canceled``."""
    names = [{"error": "failed"}.get(s, s) for s in ("error", "partial", "canceled") if s in statuses]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def retry_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put a failed, partial or canceled job back to work: its unsuccessful tasks are reset."""
    return retry_jobs([job_id], by=by, now=now)[UUID(str(job_id))]


def retry_tasks(task_ids: Iterable[UUID] | Mapping[UUID, datetime], *, by: str = "", now: datetime | None = None,
                statuses: Iterable[str] = TASK_RETRYABLE, why: Note = TASK_RETRY) -> dict[UUID, ActionResult]:
    """Put failed (dead-letter), skipped, canceled or blocked tasks back to queued in one transaction.

    Attempts are reset. A finished job whose task is retried goes back to work, and the tasks
    skipped because this one failed get another chance too: its dependents (transitively), and
    the tasks its job's failure skipped once no other ``fail_job`` failure keeps the job failed.
    Tasks skipped because of another failure stay skipped. Given a mapping of task id → the
    ``finished_at`` the caller saw, a task that has finished again since is left alone. A
    finished job with tasks told to stop (a cancel) that still run is refused, as by
    :func:`retry_jobs`; a task whose service is blocked on its host becomes ``blocked``.
    """
    ids, seen = _ids(task_ids)
    source = operator_source(by)
    out: dict[UUID, ActionResult] = {}
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("SELECT id, job_id FROM accs_task WHERE id = ANY(%s::uuid[])", [[str(t) for t in ids]])
        job_of = dict(cur.fetchall())
        jobs = _locked_jobs(cur, job_of.values())
        now = now or db_now(cur)
        stopping = _stopping(cur, jobs)
        for task_id in ids:
            job = jobs.get(job_of[task_id]) if task_id in job_of else None
            if job is None:
                out[task_id] = ActionResult(False, "no such task")
            elif job[1] not in TASK_VERBS["retry"].approvals:
                out[task_id] = ActionResult(False, f"job approval is {job[1]}; approve it before it can run")
            elif job[0] not in JOB_ACTIVE and stopping.get(job_of[task_id]) and not TASK_VERBS["retry"].while_stopping:
                out[task_id] = _still_stopping(stopping[job_of[task_id]])
        todo = [t for t in ids if t not in out]
        blocked = _host_blocked(cur, todo)
        rows = _reset_tasks(cur, sorted({job_of[t] for t in todo}, key=str), only=todo, statuses=statuses,
                            seen={t: seen[t] for t in todo} if seen is not None else None,
                            now=now, source=source, why=why)
        touched = sorted({r[3] for r in rows}, key=str)
        finished = [j for j in touched if jobs[j][0] not in JOB_ACTIVE]
        # Tasks skipped because these failed get another chance too, also while the job still runs
        # (a "continue" step failed); finalize skips again those whose other dependencies still did
        # not succeed.
        readmit_jobs = [j for j in touched if jobs[j][0] != JobStatus.QUEUED]
        rows += _reset_tasks(cur, readmit_jobs, only=_skipped_by(cur, [r[0] for r in rows if r[1] != "blocked"],
                                                                  readmit_jobs),
                             statuses=["skipped"], now=now, source=source, why=why)
        back = {j: _back_to_work(cur, j, jobs[j], by=by, now=now, why=why) if j in finished else jobs[j][0]
                for j in touched}
        _settle(cur, rows, back, now=now, source=source)
    retried = {r[0]: r[1] for r in rows}
    for task_id in todo:
        if retried.get(task_id) == "blocked" or task_id in blocked:
            out[task_id] = ActionResult(retried.get(task_id) == "blocked",
                                        f"task blocked: {blocked[task_id]}; remove the block to run it")
        elif task_id in retried:
            waits = " (the job waits for admission)" if back[job_of[task_id]] == "queued" else ""
            out[task_id] = ActionResult(True, "task queued again" + waits)
        else:
            out[task_id] = ActionResult(False, "task is not failed, skipped, canceled or blocked" if seen is None
                                        else "task was retried and finished again since; left alone")
    return out


def _host_blocked(cur, task_ids: Sequence[UUID]) -> dict[UUID, str]:
    """Return the tasks whose service is blocked on their host, with words saying so."""
    cur.execute("SELECT t.id, s.key || ' is blocked on ' || h.name FROM accs_task t"
                " JOIN accs_host_block b ON b.host_id = t.host_id AND b.service_id = t.service_id"
                " JOIN accs_service s ON s.id = t.service_id JOIN accs_host h ON h.id = t.host_id"
                " WHERE t.id = ANY(%s::uuid[])", [[str(t) for t in task_ids]])
    return dict(cur.fetchall())


SKIPPED_BY_SQL = """
-- The skipped tasks a retry of these tasks re-admits: the tasks of every step that depends on
-- theirs, transitively (including the other tasks of their own steps), and the tasks skipped when
-- the job failed once no task of a fail_job step is failed any more. A task skipped because
-- another failure did not succeed stays skipped.
WITH RECURSIVE dep(job_id, step_key) AS (
    SELECT job_id, step_key FROM accs_task WHERE id = ANY(%(ids)s::uuid[])
    UNION
    SELECT t.job_id, t.step_key FROM dep JOIN accs_task t ON t.job_id = dep.job_id AND dep.step_key = ANY(t.depends_on)
)
SELECT t.id FROM accs_task t
 WHERE t.job_id = ANY(%(jobs)s::uuid[]) AND t.status = 'skipped'
   AND ((t.job_id, t.step_key) IN (SELECT job_id, step_key FROM dep)
        OR (t.error_message = %(job_failed)s
            AND NOT EXISTS (SELECT 1 FROM accs_job_step s WHERE s.job_id = t.job_id AND s.on_failure = 'fail_job'
                               AND s.error > 0)))
"""


def _skipped_by(cur, task_ids: Sequence[UUID], job_ids: Sequence[UUID]) -> list[UUID]:
    """Return the skipped tasks of (locked) jobs that a retry of ``task_ids`` gives another chance (SKIPPED_BY_SQL)."""
    if not task_ids or not job_ids:
        return []
    cur.execute(SKIPPED_BY_SQL, {"ids": [str(t) for t in task_ids], "jobs": [str(j) for j in job_ids],
                                 "job_failed": JOB_FAILED_REASON})
    return [r[0] for r in cur.fetchall()]


def retry_task(task_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put one failed (dead-letter), skipped, canceled or blocked task back to queued, attempts reset."""
    return retry_tasks([task_id], by=by, now=now)[UUID(str(task_id))]


def _self_approval(by: str, creator_id: int | None, barred: Sequence[int] | None) -> str | None:
    """Return why ``by`` may not approve the job (None when they may, or the site lets creators approve).

    Four eyes: whoever caused an approval-gated job is not the one who lets it run: the user who
    started it (``created_by``: the caller, or the sender of the event that fired a trigger), and
    for a trigger's job the trigger's creator and last editor (``approval_barred``), who chose what
    it runs. Every path (Python API, HTTP API, admin) names its operator in ``by``, so the check is
    made once, here.
    """
    others = {uid for uid in barred or () if uid is not None}
    if not by or (creator_id is None and not others) or accs.allow_self_approval:
        return None
    uid = user_id_named(by)
    if uid is not None and uid == creator_id:
        return "started this job"
    if uid is not None and uid in others:
        return "created or last changed the trigger that started this job"
    return None


def self_approval_reason(job: Any, *, by: str) -> str | None:
    """Return why ``by`` may not approve ``job`` (four eyes), None when they may: for pages to say before a click."""
    return _self_approval(by, job.created_by_id, job.approval_barred)


def approve(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Approve a job waiting for approval; the builder then starts it."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        now = now or db_now(cur)
        cur.execute("SELECT status, approval_state, created_by_id, approval_barred FROM accs_job WHERE id = %s",
                    [job_id])
        status, approval, creator_id, barred = cur.fetchone()
        if reason := _self_approval(by, creator_id, barred):
            return ActionResult(False, f"{by} {reason} and may not approve it: another approver must "
                                       "(ACC_ALLOW_SELF_APPROVAL allows it)", forbidden=True)
        if approval not in JOB_VERBS["approve"].approvals:
            return ActionResult(False, f"job is not waiting for approval (approval is {approval})")
        if status not in JOB_VERBS["approve"].statuses:
            return ActionResult(False, f"job is {status}; retry it first, then approve it")
        cur.execute("UPDATE accs_job SET approval_state = 'approved', approved_by = %s, approved_at = %s,"
                    " updated_at = %s WHERE id = %s", [by, now, now, job_id])
        write_events([EventRow(type="approval", message=f"job approved by {by or 'api'}", job_id=job_id,
                               source=operator_source(by), data={"from": "pending", "to": "approved"})], cursor=cur)
        notify(cur, [builder_channel()])
    return ActionResult(True, "job approved")


def reject(job_id: UUID, *, by: str = "", reason: str = "", now: datetime | None = None) -> ActionResult:
    """Reject a job waiting for approval: the job and its unstarted tasks are canceled."""
    source = operator_source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        lock_tasks_of_jobs(cur, [job_id])
        now = now or db_now(cur)
        cur.execute("SELECT status, approval_state FROM accs_job WHERE id = %s", [job_id])
        status, approval = cur.fetchone()
        if approval not in JOB_VERBS["reject"].approvals or status not in JOB_VERBS["reject"].statuses:
            return ActionResult(False, "job is not waiting for approval")
        to = "canceled" if status in JOB_ACTIVE else status
        cur.execute("UPDATE accs_job SET approval_state = 'rejected', approved_by = %s, approved_at = %s,"
                    " status = %s, finished_at = coalesce(finished_at, %s), updated_at = %s, error_code = 'rejected',"
                    " error_message = %s WHERE id = %s",
                    [by, now, to, now, now, reason or f"rejected by {by or 'api'}", job_id])
        write_events([EventRow(type="approval", message=f"job rejected by {by or 'api'}", job_id=job_id,
                               source=source, level="warn",
                               data={"from": "pending", "to": "rejected", "reason": reason})],
                     cursor=cur)
        if to != status:
            _job_event(cur, job_id, f"job {status} → {to} (rejected)", by=by, level="warn",
                       data={"from": status, "to": to})
        write_events(skip_unstarted(cur, [job_id], now=now, source=source, reason="job rejected", to="canceled"),
                     cursor=cur)
    return ActionResult(True, "job rejected and canceled")
