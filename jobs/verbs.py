"""Operators' verbs on jobs and tasks: cancel, retry, approve, reject.

Each verb is one transaction that takes its locks in the engine's one order (:mod:`jobs.locks`:
advisory locks, then the job, then its tasks sorted by id), reads PostgreSQL's clock, changes
what still applies and writes an event per change. A verb that no longer applies changes
nothing and says why in its :class:`ActionResult`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from events.timeline import EventRow, write_events
from jobs.admission import readmit, tenant_lock_key, workflow_lock_key
from jobs.finalize import finalize_jobs, reset_step_flags, skip_unstarted
from jobs.locks import advisory_locks, lock_jobs, lock_tasks_of_jobs
from jobs.models import ApprovalState, JobStatus
from jobs.notify import builder_channel, notify, service_channel
from accs_site.clock import db_now
from jobs.states import JOB_ACTIVE, JOB_ADMITTED, JOB_RETRYABLE, TASK_RETRYABLE, TASK_UNSTARTED, sql_in


@dataclass
class ActionResult:
    """Outcome of an operator action: ``changed`` False means it no longer applied (and why)."""

    changed: bool
    message: str


def _source(by: str) -> str:
    return f"user:{by}" if by else "api"


def _job_event(cur, job_id, message: str, *, by: str, level: str = "info", data: dict | None = None) -> None:
    write_events([EventRow(type="status", message=message, job_id=job_id, source=_source(by), level=level,
                           data=data or {})], cursor=cur)


def _admission_locks_for_job(cur, job_id: UUID) -> None:
    """Take the advisory locks the job's admission counts under (before any row lock)."""
    cur.execute("SELECT j.tenant_id, j.workflow_id, tn.max_in_flight, coalesce(w.max_active_jobs, 0) FROM accs_job j"
                " JOIN accs_tenant tn ON tn.id = j.tenant_id LEFT JOIN accs_workflow w ON w.id = j.workflow_id"
                " WHERE j.id = %s", [job_id])
    row = cur.fetchone()
    if row:
        tenant_id, workflow_id, tenant_cap, wf_cap = row
        advisory_locks(cur, ([tenant_lock_key(tenant_id)] if tenant_cap else [])
                       + ([workflow_lock_key(workflow_id)] if workflow_id and wf_cap else []))


def cancel_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Cancel a queued, waiting or running job: unstarted tasks are canceled, running ones told to stop."""
    source = _source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        lock_tasks_of_jobs(cur, [job_id])
        now = now or db_now(cur)
        cur.execute(f"SELECT status FROM accs_job WHERE id = %s AND status IN {sql_in(JOB_ACTIVE)}", [job_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "job is not queued, waiting or running; nothing to cancel")
        cur.execute("UPDATE accs_job SET status = 'canceled', finished_at = %s, updated_at = %s,"
                    " error_code = 'canceled', error_message = %s WHERE id = %s",
                    [now, now, f"canceled by {by or 'api'}", job_id])
        _job_event(cur, job_id, f"job {row[0]} → canceled", by=by, level="warn", data={"from": row[0], "to": "canceled"})
        write_events(skip_unstarted(cur, [job_id], now=now, source=source, reason="job canceled", to="canceled"),
                     cursor=cur)
        cur.execute("UPDATE accs_task SET cancel_requested_at = %s WHERE job_id = %s AND status IN ('starting', 'running')"
                    " AND cancel_requested_at IS NULL RETURNING id, attempt", [now, job_id])
        held = cur.fetchall()
        write_events([EventRow(type="cancel", message="cancel requested; the agent stops the task at its next heartbeat",
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
    source = _source(by)
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
        cur.execute("UPDATE accs_task SET cancel_requested_at = %s WHERE id = %s AND status IN ('starting', 'running')"
                    " RETURNING attempt", [now, task_id])
        row = cur.fetchone()
        if row:
            write_events([EventRow(type="cancel", message="cancel requested", job_id=job_id, task_id=task_id,
                                   attempt=row[0], source=source, level="warn")], cursor=cur)
            return ActionResult(True, "cancel requested; the agent stops the task at its next heartbeat")
    return ActionResult(False, "task is already finished; nothing to cancel")


def _reset_tasks(cur, job_id: UUID, *, only: UUID | None = None, statuses: Iterable[str] = TASK_RETRYABLE,
                 now: datetime, source: str) -> list[tuple]:
    """Put failed/skipped/canceled/blocked tasks of a (locked) job back: queued, or waiting if it has deps.

    The retry budget is renewed: ``max_attempts`` becomes the attempts used so far plus the
    service's budget. Attempt numbers never go back, so each Attempt row keeps its number and a
    late report from an earlier attempt stays fenced. Return (task id, new status, service id).
    """
    cur.execute(
        "WITH o AS (SELECT id, status FROM accs_task WHERE job_id = %s AND (%s::uuid IS NULL OR id = %s)"
        f"           AND status IN {sql_in(statuses)})"
        " UPDATE accs_task t SET status = CASE WHEN cardinality(t.depends_on) = 0 THEN 'queued' ELSE 'waiting' END,"
        "  max_attempts = t.attempt + s.max_attempts,"
        "  next_attempt_at = %s, updated_at = %s, finished_at = NULL, error_code = '', error_message = '',"
        "  results = NULL, progress = NULL, claimed_by = '', lease_expires_at = NULL, cancel_requested_at = NULL"
        "  FROM o, accs_service s WHERE t.id = o.id AND s.id = t.service_id"
        " RETURNING t.id, t.status, t.service_id, o.status",
        [job_id, only, only, now, now],
    )
    rows = cur.fetchall()
    write_events([EventRow(type="status", message=f"task {frm} → {st} (retry, attempts reset)", job_id=job_id,
                           task_id=t, source=source, data={"from": frm, "to": st, "retry": True})
                  for t, st, _, frm in rows], cursor=cur)
    return rows


def _notify_services(cur, service_ids: Iterable[int]) -> None:
    ids = sorted(set(service_ids))
    if ids:
        cur.execute("SELECT key FROM accs_service WHERE id = ANY(%s)", [ids])
        notify(cur, [service_channel(r[0]) for r in cur.fetchall()])


def _back_to_work(cur, job_id: UUID, job: tuple, *, by: str, now: datetime, what: str) -> str:
    """Move a finished job back to waiting (or queued, through admission); return the new status."""
    status, _approval, instantiated, tenant_id, workflow_id = job
    source = _source(by)
    if instantiated:
        new_status = readmit(cur, job_id, tenant_id=tenant_id, workflow_id=workflow_id, now=now, source=source)
    else:
        new_status = "queued"
        notify(cur, [builder_channel()])
    cur.execute("UPDATE accs_job SET status = %s, finished_at = NULL, error_code = '', error_message = '',"
                " updated_at = %s WHERE id = %s", [new_status, now, job_id])
    _job_event(cur, job_id, f"job {status} → {new_status} ({what})", by=by, data={"from": status, "to": new_status})
    return new_status


def _locked_job(cur, job_id: UUID) -> tuple[Any, ...] | None:
    _admission_locks_for_job(cur, job_id)
    if not lock_jobs(cur, [job_id]):
        return None
    lock_tasks_of_jobs(cur, [job_id])
    cur.execute("SELECT status, approval_state, started_at IS NOT NULL, tenant_id, workflow_id FROM accs_job"
                " WHERE id = %s", [job_id])
    return cur.fetchone()


def retry_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put a failed, partial or canceled job back to work: its unsuccessful tasks are reset.

    It goes back through admission: under a workflow or tenant cap it waits, queued, for its turn.
    A job canceled while it waited for approval goes back to waiting for approval.
    """
    source = _source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        job = _locked_job(cur, job_id)
        if job is None:
            return ActionResult(False, "no such job")
        now = now or db_now(cur)
        status, approval, instantiated = job[:3]
        if approval == ApprovalState.REJECTED:
            return ActionResult(False, "job was rejected; start a new job instead")
        if status not in JOB_RETRYABLE:
            return ActionResult(False, f"job is {status}; only failed, partial or canceled jobs can be retried")
        if approval == ApprovalState.PENDING and instantiated:  # pragma: no cover - approval gates instantiation
            return ActionResult(False, "job approval is pending; approve it before it can run")
        rows = _reset_tasks(cur, job_id, now=now, source=source)
        reset_step_flags(cur, [job_id])
        new_status = _back_to_work(cur, job_id, job, by=by, now=now, what="retry")
        if new_status in JOB_ADMITTED:
            _notify_services(cur, [r[2] for r in rows if r[1] == "queued"])
            finalize_jobs(cur, [job_id], now=now, source=source)
    waits = " (waiting for approval)" if approval == ApprovalState.PENDING else (
        " (waiting for admission)" if new_status == "queued" and instantiated else "")
    return ActionResult(True, f"job back to {new_status}{waits}; {len(rows)} task(s) reset")


def retry_task(task_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put one failed (dead-letter), skipped, canceled or blocked task back to queued, attempts reset."""
    source = _source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        job_id = _job_of_task(cur, task_id)
        if job_id is None:
            return ActionResult(False, "no such task")
        job = _locked_job(cur, job_id)
        now = now or db_now(cur)
        status, approval = job[:2]
        if approval in (ApprovalState.PENDING, ApprovalState.REJECTED):
            return ActionResult(False, f"job approval is {approval}; approve it before it can run")
        rows = _reset_tasks(cur, job_id, only=task_id, now=now, source=source)
        if not rows:
            return ActionResult(False, "task is not failed, skipped, canceled or blocked")
        new_status = status
        if status != JobStatus.QUEUED:
            # Dependents skipped because this task failed get another chance too, also while the
            # job still runs (a "continue" step failed); finalize skips again those whose other
            # dependencies still did not succeed.
            rows += _reset_tasks(cur, job_id, statuses=["skipped"], now=now, source=source)
        if status not in JOB_ACTIVE:
            new_status = _back_to_work(cur, job_id, job, by=by, now=now, what="task retried")
        reset_step_flags(cur, [job_id])
        if new_status in JOB_ADMITTED:
            _notify_services(cur, [r[2] for r in rows if r[1] == "queued"])
            finalize_jobs(cur, [job_id], now=now, source=source)
    return ActionResult(True, "task queued again" + (" (the job waits for admission)" if new_status == "queued" else ""))


def approve(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Approve a job waiting for approval; the builder then starts it."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        now = now or db_now(cur)
        cur.execute("SELECT status, approval_state FROM accs_job WHERE id = %s", [job_id])
        status, approval = cur.fetchone()
        if approval != ApprovalState.PENDING:
            return ActionResult(False, f"job is not waiting for approval (approval is {approval})")
        if status != JobStatus.QUEUED:
            return ActionResult(False, f"job is {status}; retry it first, then approve it")
        cur.execute("UPDATE accs_job SET approval_state = 'approved', approved_by = %s, approved_at = %s, updated_at = %s"
                    " WHERE id = %s", [by, now, now, job_id])
        write_events([EventRow(type="approval", message=f"job approved by {by or 'api'}", job_id=job_id,
                               source=_source(by), data={"from": "pending", "to": "approved"})], cursor=cur)
        notify(cur, [builder_channel()])
    return ActionResult(True, "job approved")


def reject(job_id: UUID, *, by: str = "", reason: str = "", now: datetime | None = None) -> ActionResult:
    """Reject a job waiting for approval: the job and its unstarted tasks are canceled."""
    source = _source(by)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if not lock_jobs(cur, [job_id]):
            return ActionResult(False, "no such job")
        lock_tasks_of_jobs(cur, [job_id])
        now = now or db_now(cur)
        cur.execute("SELECT status, approval_state FROM accs_job WHERE id = %s", [job_id])
        status, approval = cur.fetchone()
        if approval != ApprovalState.PENDING:
            return ActionResult(False, "job is not waiting for approval")
        to = "canceled" if status in JOB_ACTIVE else status
        cur.execute("UPDATE accs_job SET approval_state = 'rejected', approved_by = %s, approved_at = %s,"
                    " status = %s, finished_at = coalesce(finished_at, %s), updated_at = %s, error_code = 'rejected',"
                    " error_message = %s WHERE id = %s",
                    [by, now, to, now, now, reason or f"rejected by {by or 'api'}", job_id])
        write_events([EventRow(type="approval", message=f"job rejected by {by or 'api'}", job_id=job_id,
                               source=source, level="warn", data={"from": "pending", "to": "rejected", "reason": reason})],
                     cursor=cur)
        if to != status:
            _job_event(cur, job_id, f"job {status} → {to} (rejected)", by=by, level="warn", data={"from": status, "to": to})
        write_events(skip_unstarted(cur, [job_id], now=now, source=source, reason="job rejected", to="canceled"),
                     cursor=cur)
    return ActionResult(True, "job rejected and canceled")
