"""The agents' side of a task's life: start, heartbeat, progress, outcome; and lease rescue.

Every function here is fenced by the attempt number: a report from an attempt that is no longer
current changes nothing and is recorded as a ``fenced`` event. Times come from PostgreSQL's
clock (:func:`accs_site.clock.db_now`), never from the agent's. Locks follow :mod:`jobs.locks`: the
jobs of the reported tasks, then the tasks, each sorted by id.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.conf import accs
from events.models import EventType
from events.timeline import EventRow, write_events
from jobs.backoff import backoff_delay
from jobs.finalize import finalize_jobs, finished, skip_unstarted
from jobs.locks import lock_jobs_of_tasks, lock_tasks
from jobs.notify import notify, service_channel
from jobs.states import JOB_ADMITTED, sql_in
from accs_site.clock import db_now
from workflows.models import StepFailurePolicy

log = logging.getLogger("accs.reports")

BUILDER = "builder"


@dataclass
class Outcome:
    """How one attempt ended, as reported by an agent.

    ``status``: succeeded | failed | timeout | canceled | interrupted (the agent shut down and
    stopped the attempt: it is retried at once and does not use up the retry budget).
    """

    task_id: UUID
    attempt: int
    status: str
    results: Any = None
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    error: str = ""
    error_code: str = ""
    retryable: bool = True


@dataclass
class ReportResult:
    """What a report changed.

    ``fenced`` lists reports rejected because the attempt is no longer current; ``repeated`` lists
    reports that were already recorded, word for word (a retry after a commit whose answer was lost).
    """

    done: list[UUID] = field(default_factory=list)
    retried: list[UUID] = field(default_factory=list)
    failed: list[UUID] = field(default_factory=list)
    canceled: list[UUID] = field(default_factory=list)
    fenced: list[UUID] = field(default_factory=list)
    repeated: list[UUID] = field(default_factory=list)


MARK_RUNNING_SQL = """
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(pids)s::int[]) AS v(id, attempt, pid)),
run AS (
    UPDATE accs_task t SET status = 'running', started_at = %(now)s, updated_at = %(now)s
      FROM v WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = 'starting' AND t.claimed_by = %(agent)s
    RETURNING t.id, t.job_id, t.attempt, v.pid
),
att AS (
    UPDATE accs_attempt a SET pid = run.pid FROM run WHERE a.task_id = run.id AND a.attempt_no = run.attempt
),
ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'status', 'task starting → running',
           jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid) FROM run
)
SELECT id FROM run
"""

JOBS_RUNNING_SQL = """
-- A job is running while a task of it is starting or running: the first start moves it from
-- waiting. Written just before the tasks' own start (same transaction, same fencing), so the
-- timeline reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS v(id, attempt)),
up AS (
    UPDATE accs_job SET status = 'running', updated_at = %(now)s
     WHERE status = 'waiting'
       AND id IN (SELECT t.job_id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
                   WHERE t.status = 'starting' AND t.claimed_by = %(agent)s)
    RETURNING id
)
INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
SELECT %(now)s, id, %(source)s, 'info', 'status', 'job waiting → running',
       '{"from": "waiting", "to": "running"}'::jsonb FROM up
"""


def mark_running(items: Sequence[tuple[UUID, int, int | None]], *, agent_id: str, source: str,
                 now: datetime | None = None) -> set[UUID]:
    """Move claimed tasks (and their waiting jobs) to running; ``items`` are (task_id, attempt, pid).

    Return the task ids moved.
    """
    if not items:
        return set()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        lock_jobs_of_tasks(cur, [i[0] for i in items])
        lock_tasks(cur, [i[0] for i in items])
        return _mark_running(cur, items, agent_id=agent_id, source=source, now=now or db_now(cur))


def _mark_running(cur, items, *, agent_id: str, source: str, now: datetime) -> set[UUID]:
    """Move tasks to running; the caller holds the locks of their jobs, then of the tasks."""
    _jobs_running(cur, items, agent_id=agent_id, now=now, source=source)
    cur.execute(MARK_RUNNING_SQL, {"ids": [i[0] for i in items], "attempts": [i[1] for i in items],
                                   "pids": [i[2] for i in items], "now": now, "agent": agent_id, "source": source})
    return {r[0] for r in cur.fetchall()}


def _jobs_running(cur, items, *, agent_id: str, now: datetime, source: str) -> None:
    """Move the waiting jobs of starting tasks (``items`` start with task_id, attempt) to running."""
    cur.execute(JOBS_RUNNING_SQL, {"ids": [i[0] for i in items], "attempts": [i[1] for i in items],
                                   "now": now, "agent": agent_id, "source": source})


COMPLETE_SQL = """
-- Fenced by attempt: a report from an attempt that is no longer current changes nothing.
-- %(from_status)s is 'running', or 'starting' when the agent reports an attempt's start and end
-- together: the task then goes starting → done in one UPDATE and BOTH transitions get their event
-- (the intermediate row version would be visible to no other transaction anyway). A task the
-- report finds already running (an earlier report of its start committed but its answer was lost)
-- goes running → done, with that one event. "was" is the row as the statement found it.
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(results)s::text[], %(codes)s::int[],
                                %(outs)s::text[], %(errs)s::text[], %(pids)s::int[])
                  AS v(id, attempt, results, code, out, err, pid)),
done AS (
    UPDATE accs_task t SET status = 'done', results = v.results::jsonb, progress = 1, finished_at = %(now)s,
           started_at = coalesce(t.started_at, %(now)s), updated_at = %(now)s
      FROM v JOIN accs_task was ON was.id = v.id
     WHERE t.id = v.id AND t.attempt = v.attempt AND t.status IN (%(from_status)s, 'running')
    RETURNING t.id, t.job_id, t.attempt, v.code, v.out, v.err, v.pid, was.status AS was
),
att AS (
    UPDATE accs_attempt a SET status = 'succeeded', finished_at = %(now)s, exit_code = done.code,
           stdout_tail = done.out, stderr_tail = done.err, pid = coalesce(done.pid, a.pid)
      FROM done WHERE a.task_id = done.id AND a.attempt_no = done.attempt
),
ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'status', 'task starting → running',
           jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid)
      FROM done WHERE was = 'starting'
    UNION ALL
    SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'status', 'task running → done',
           '{"from": "running", "to": "done"}'::jsonb FROM done
)
SELECT id, job_id FROM done
"""


def report(outcomes: Sequence[Outcome], *, source: str, started: Sequence[tuple[UUID, int, int | None]] = (),
           agent_id: str = "", now: datetime | None = None) -> ReportResult:
    """Record how attempts ended, in one transaction: done, retry with backoff, final error, canceled.

    ``started`` optionally moves tasks to running first (in the same transaction), so an agent
    reports a short task's start and end together.
    """
    result = ReportResult()
    started_pid = {(tid, att): pid for tid, att, pid in started}
    # Successes whose start is in this same report go starting → done in one statement.
    ok = [o for o in outcomes if o.status == "succeeded"]
    ok_with_start = [o for o in ok if (o.task_id, o.attempt) in started_pid]
    ok_running = [o for o in ok if (o.task_id, o.attempt) not in started_pid]
    combined = {(o.task_id, o.attempt) for o in ok_with_start}
    to_mark = [s for s in started if (s[0], s[1]) not in combined]
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        task_ids = [o.task_id for o in outcomes] + [s[0] for s in started]
        lock_jobs_of_tasks(cur, task_ids)
        lock_tasks(cur, task_ids)
        now = now or db_now(cur)
        if to_mark:
            _mark_running(cur, to_mark, agent_id=agent_id, source=source, now=now)
        if not outcomes:
            return result
        touched_jobs: set[UUID] = set()
        for group, from_status in ((ok_with_start, "starting"), (ok_running, "running")):
            if not group:
                continue
            if from_status == "starting":
                _jobs_running(cur, [(o.task_id, o.attempt) for o in group], agent_id=agent_id, now=now, source=source)
            cur.execute(COMPLETE_SQL, {
                "ids": [o.task_id for o in group], "attempts": [o.attempt for o in group],
                "results": [json.dumps(o.results if o.results is not None else {}, default=str) for o in group],
                "codes": [o.exit_code for o in group], "outs": [o.stdout_tail for o in group],
                "errs": [o.stderr_tail for o in group],
                "pids": [started_pid.get((o.task_id, o.attempt)) for o in group],
                "now": now, "source": source, "from_status": from_status,
            })
            for tid, jid in cur.fetchall():
                result.done.append(tid)
                touched_jobs.add(jid)
        bad = [o for o in outcomes if o.status != "succeeded"]
        if bad:
            touched_jobs |= _record_failures(cur, bad, result, now=now, source=source)
        accepted = set(result.done) | set(result.retried) | set(result.failed) | set(result.canceled)
        rejected = [o for o in outcomes if o.task_id not in accepted]
        if rejected:
            recorded = _already_recorded(cur, rejected)
            result.repeated = [o.task_id for o in rejected if o.task_id in recorded]
            fenced = [o for o in rejected if o.task_id not in recorded]
            if fenced:
                result.fenced = [o.task_id for o in fenced]
                _record_fenced(cur, fenced, source=source)
        finalize_jobs(cur, sorted(touched_jobs, key=str), now=now, source=source)
    return result


def _attempt_ending(o: Outcome) -> tuple[str, str]:
    """The status and error text a report writes on its attempt row."""
    if o.status == "succeeded":
        return "succeeded", ""
    known = ("failed", "timeout", "canceled", "interrupted")
    status = o.status if o.status in known else "failed"
    return status, o.error or {"timeout": "timeout", "interrupted": "interrupted: the agent shut down"}.get(status, "failed")


def _already_recorded(cur, outcomes: Sequence[Outcome]) -> set[UUID]:
    """Return the tasks whose attempt row already ends exactly as this report would end it.

    That is a repeat of a report that committed while its answer was lost on the way back: the
    agent could not know, so it sent it again. Nothing else writes the same ending: the lease
    rescue and an operator write their own error text, and only the running agent reports success.
    """
    cur.execute(
        "SELECT a.task_id, a.status, a.exit_code, a.error_text FROM accs_attempt a"
        "  JOIN unnest(%s::uuid[], %s::int[]) AS v(id, attempt) ON a.task_id = v.id AND a.attempt_no = v.attempt"
        " WHERE a.status <> 'running'",
        [[o.task_id for o in outcomes], [o.attempt for o in outcomes]],
    )
    ended = {tid: (status, code, text) for tid, status, code, text in cur.fetchall()}
    recorded = set()
    for o in outcomes:
        status, text = _attempt_ending(o)
        if o.task_id in ended and ended[o.task_id] == (status, o.exit_code, text):
            recorded.add(o.task_id)
    return recorded


def _record_fenced(cur, outcomes: Sequence[Outcome], *, source: str) -> None:
    cur.execute("SELECT id, job_id, attempt, status FROM accs_task WHERE id = ANY(%s)", [[o.task_id for o in outcomes]])
    current = {r[0]: r for r in cur.fetchall()}
    rows = []
    for o in outcomes:
        _tid, jid, attempt, status = current.get(o.task_id, (o.task_id, None, None, "missing"))
        rows.append(EventRow(
            type="fenced", level="warn", job_id=jid, task_id=o.task_id, attempt=o.attempt, source=source,
            message=f"late report from attempt {o.attempt} rejected (task is {status}, attempt {attempt})",
            data={"reported_status": o.status, "reported_attempt": o.attempt, "current_attempt": attempt,
                  "current_status": status},
        ))
        log.warning("fenced report", extra={"task_id": o.task_id, "attempt": o.attempt})
    write_events(rows, cursor=cur)


def _record_failures(cur, outcomes: Sequence[Outcome], result: ReportResult, *, now: datetime, source: str,
                     from_statuses: tuple[str, ...] = ("starting", "running")) -> set[UUID]:
    """Apply failed/timeout/canceled/interrupted outcomes: retry, or final error (dead letter).

    The caller holds the locks of the tasks' jobs and of the tasks.
    """
    by_id = {o.task_id: o for o in outcomes}
    cur.execute(
        "SELECT t.id, t.job_id, t.attempt, t.max_attempts, t.status, t.host_id, s.backoff_base_seconds,"
        "       s.backoff_cap_seconds, s.quarantine_host_on_final_failure, t.cancel_requested_at IS NOT NULL,"
        "       s.max_attempts, t.step_key, js.on_failure"
        "  FROM accs_task t JOIN accs_service s ON s.id = t.service_id"
        "  LEFT JOIN accs_job_step js ON js.job_id = t.job_id AND js.step_key = t.step_key"
        " WHERE t.id = ANY(%s) AND t.status = ANY(%s) ORDER BY t.id",
        [list(by_id), list(from_statuses)],
    )
    touched: set[UUID] = set()
    events: list[EventRow] = []
    for (tid, jid, attempt, max_attempts, status, host_id, base, cap, quarantine, cancel_requested,
         budget, step_key, on_failure) in cur.fetchall():
        o = by_id[tid]
        if o.attempt != attempt:
            continue  # fenced: reported below by the caller
        touched.add(jid)
        attempt_status, error = _attempt_ending(o)
        cur.execute(
            "UPDATE accs_attempt SET status = %s, finished_at = %s, exit_code = %s, stdout_tail = %s,"
            " stderr_tail = %s, error_text = %s WHERE task_id = %s AND attempt_no = %s AND status = 'running'",
            [attempt_status, now, o.exit_code, o.stdout_tail, o.stderr_tail, error, tid, attempt],
        )
        if attempt_status == "canceled" or cancel_requested:  # an operator's cancel stays a cancel
            cur.execute("UPDATE accs_task SET status = 'canceled', finished_at = %s, updated_at = %s,"
                        " error_code = 'canceled', error_message = %s WHERE id = %s AND status = %s",
                        [now, now, error, tid, status])
            result.canceled.append(tid)
            events.append(EventRow(type="status", message=f"task {status} → canceled", job_id=jid, task_id=tid,
                                   attempt=attempt, source=source, level="warn", data={"from": status, "to": "canceled"}))
            continue
        if attempt_status == "interrupted":
            # Not the task's fault: queued again at once, and the attempt does not count.
            cur.execute(
                "UPDATE accs_task SET status = 'queued', next_attempt_at = %s, updated_at = %s, error_code = 'interrupted',"
                " error_message = %s, claimed_by = '', lease_expires_at = NULL, progress = NULL,"
                " max_attempts = max_attempts + 1 WHERE id = %s AND status = %s",
                [now, now, error[:2000], tid, status],
            )
            result.retried.append(tid)
            events.append(EventRow(type="retry", level="warn", job_id=jid, task_id=tid, attempt=attempt, source=source,
                                   message=f"task {status} → queued: attempt {attempt} interrupted by the agent's shutdown",
                                   data={"from": status, "to": "queued", "error": error[:500], "delay_seconds": 0}))
            continue
        if o.retryable and attempt < max_attempts:
            # Count the backoff from the start of the current budget (a retried task starts over).
            in_budget = max(1, attempt - (max_attempts - budget))
            delay = backoff_delay(in_budget, base=accs.backoff_base_sec if base is None else base,
                                  cap=min(cap, accs.backoff_cap_sec))
            next_at = now + timedelta(seconds=delay)
            # A retry that must wait is "scheduled", out of the claim index, until its time comes.
            to = "scheduled" if delay > 0 else "queued"
            cur.execute(
                "UPDATE accs_task SET status = %s, next_attempt_at = %s, updated_at = %s, error_code = %s,"
                " error_message = %s, claimed_by = '', lease_expires_at = NULL, progress = NULL"
                " WHERE id = %s AND status = %s",
                [to, next_at, now, o.error_code or attempt_status, error[:2000], tid, status],
            )
            result.retried.append(tid)
            events.append(EventRow(
                type="retry", level="warn", job_id=jid, task_id=tid, attempt=attempt, source=source,
                message=f"task {status} → {to}: attempt {attempt}/{max_attempts} {attempt_status}, retry in {delay:.1f}s",
                data={"from": status, "to": to, "error": error[:500], "delay_seconds": round(delay, 3),
                      "next_attempt_at": next_at.isoformat()},
            ))
            continue
        cur.execute(
            "UPDATE accs_task SET status = 'error', finished_at = %s, updated_at = %s, error_code = %s,"
            " error_message = %s WHERE id = %s AND status = %s",
            [now, now, o.error_code or attempt_status, error[:2000], tid, status],
        )
        result.failed.append(tid)
        events.append(EventRow(
            type="status", level="error", job_id=jid, task_id=tid, attempt=attempt, source=source,
            message=f"task {status} → error (final after {attempt}/{max_attempts} attempts): {error[:200]}",
            data={"from": status, "to": "error", "dead_letter": True, "error": error[:500],
                  "error_code": o.error_code or attempt_status},
        ))
        if quarantine and host_id:
            events += quarantine_host(cur, host_id, reason=f"task {tid} failed for good: {error[:200]}",
                                      job_id=jid, task_id=tid, now=now, source=source)
        if on_failure == StepFailurePolicy.CONTINUE:
            # Its dependents are skipped and the job ends partial once the rest is final (jobs.finalize).
            events.append(EventRow(
                type=EventType.POLICY, level="warn", job_id=jid, task_id=tid, source=source,
                message=f"step {step_key} failed for good; on_failure continue: its dependents are skipped,"
                        " independent steps go on",
                data={"step": step_key, "on_failure": on_failure},
            ))
        else:
            events += _fail_job(cur, jid, reason=f"task {tid} failed: {error[:500]}", now=now, source=source)
    write_events(events, cursor=cur)
    return touched


FAIL_JOB_SQL = f"""
-- The job fails now, unless a task of an "always" step is not final yet: it then ends "error"
-- (jobs.finalize) once those have run.
UPDATE accs_job j SET status = 'error', error_code = 'task_failed', error_message = %(reason)s,
       finished_at = %(now)s, updated_at = %(now)s
 WHERE j.id = %(job)s AND j.status = %(was)s
   AND NOT EXISTS (SELECT 1 FROM accs_job_step a WHERE a.job_id = j.id AND a.always AND {finished("a")} < a.total)
RETURNING j.id
"""


def _fail_job(cur, job_id: UUID, *, reason: str, now: datetime, source: str) -> list[EventRow]:
    """Fail a (locked) admitted job after a task of a ``fail_job`` step failed for good; return the events.

    Its unstarted tasks are skipped, except those of ``always`` steps, which still run.
    """
    cur.execute(f"SELECT status FROM accs_job WHERE id = %s AND status IN {sql_in(JOB_ADMITTED)}", [job_id])
    row = cur.fetchone()
    if not row:
        return []
    was = row[0]
    skipped = skip_unstarted(cur, [job_id], now=now, source=source, reason="job failed", keep_always=True)
    cur.execute(FAIL_JOB_SQL, {"job": job_id, "was": was, "reason": reason, "now": now})
    if cur.fetchone():
        return [EventRow(type="status", level="error", job_id=job_id, source=source, message=f"job {was} → error",
                         data={"from": was, "to": "error"}), *skipped]
    return [EventRow(type=EventType.POLICY, level="error", job_id=job_id, source=source,
                     message="job fails (on_failure fail_job); its always-run steps run before it ends error",
                     data={"on_failure": StepFailurePolicy.FAIL_JOB, "reason": reason}), *skipped]


def quarantine_host(cur, host_id: int, *, reason: str, job_id, task_id, now: datetime, source: str) -> list[EventRow]:
    """Take a host out of eligibility after a final failure; return its event."""
    cur.execute("UPDATE accs_host SET status = 'error', quarantined_at = %s, quarantine_reason = %s"
                " WHERE id = %s AND status = 'ok' RETURNING name", [now, reason, host_id])
    row = cur.fetchone()
    if not row:
        return []
    return [EventRow(type="status", level="error", job_id=job_id, task_id=task_id, source=source,
                     message=f"host {row[0]} ok → error (quarantined)", data={"host": row[0], "to": "error"})]


# --------------------------------------------------------------------------------------------
# Leases
# --------------------------------------------------------------------------------------------

HEARTBEAT_SQL = """
-- Locks taken in id order (see jobs.locks); the lease is measured on PostgreSQL's clock.
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS v(id, attempt)),
l AS (
    SELECT t.id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
     WHERE t.status IN ('starting', 'running') AND t.claimed_by = %(agent)s
     ORDER BY t.id FOR UPDATE OF t
)
UPDATE accs_task t SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(lease)s),
       heartbeat_at = coalesce(%(now)s::timestamptz, now())
  FROM l WHERE t.id = l.id
RETURNING t.id, t.attempt, t.cancel_requested_at IS NOT NULL
"""


def heartbeat(held: Sequence[tuple[UUID, int]], *, agent_id: str, lease_seconds: float,
              now: datetime | None = None) -> tuple[set[tuple[UUID, int]], set[tuple[UUID, int]]]:
    """Extend the leases of (task, attempt) pairs this agent holds. Return (lost, cancel_requested).

    ``lost`` are attempts no longer held (rescued or canceled): the agent must stop them.
    ``cancel_requested`` are attempts an operator asked to cancel. Both hold (task_id, attempt)
    pairs, so an old attempt's answer never touches a newer one.
    """
    if not held:
        return set(), set()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute(HEARTBEAT_SQL, {"ids": [h[0] for h in held], "attempts": [h[1] for h in held],
                                    "lease": float(lease_seconds), "now": now, "agent": agent_id})
        rows = cur.fetchall()
    kept = {(r[0], r[1]) for r in rows}
    return {(h[0], h[1]) for h in held} - kept, {(r[0], r[1]) for r in rows if r[2]}


def rescue_expired(*, limit: int = 500, now: datetime | None = None) -> ReportResult:
    """Requeue (or fail for good) tasks whose lease expired: a failed attempt, reason lease_expired."""
    result = ReportResult()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        now = now or db_now(cur)
        cur.execute("SELECT id FROM accs_task WHERE status IN ('starting', 'running') AND lease_expires_at < %s"
                    " ORDER BY lease_expires_at LIMIT %s", [now, limit])
        candidates = [r[0] for r in cur.fetchall()]
        if not candidates:
            return result
        lock_jobs_of_tasks(cur, candidates)
        cur.execute("SELECT id, attempt FROM accs_task WHERE id = ANY(%s) AND status IN ('starting', 'running')"
                    " AND lease_expires_at < %s ORDER BY id FOR UPDATE SKIP LOCKED", [candidates, now])
        expired = [Outcome(task_id=tid, attempt=attempt, status="failed", error="lease_expired: no heartbeat",
                           error_code="lease_expired") for tid, attempt in cur.fetchall()]
        if expired:
            touched = _record_failures(cur, expired, result, now=now, source=BUILDER)
            finalize_jobs(cur, sorted(touched, key=str), now=now, source=BUILDER)
    return result


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------

PROGRESS_SQL = """
-- Progress lives on the task row (the job page reads it there). The timeline gets a milestone
-- only when a task crosses a quarter (25, 50 or 75 per cent), not one event per report.
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(att)s::int[], %(p)s::float8[]) AS v(id, attempt, p)),
o AS (SELECT t.id, coalesce(t.progress, 0) AS old FROM accs_task t JOIN v ON v.id = t.id),
upd AS (
    UPDATE accs_task t SET progress = least(greatest(v.p, 0), 1), updated_at = %(now)s
      FROM v JOIN o ON o.id = v.id
     WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = 'running'
    RETURNING t.id, t.job_id, t.attempt, t.progress, o.old
), ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'progress',
           'progress reached ' || (floor(progress * 4) * 25)::int || ' %%',
           jsonb_build_object('progress', progress, 'milestone', floor(progress * 4) / 4)
      FROM upd WHERE floor(progress * 4) > floor(old * 4) AND progress < 1
)
SELECT count(*) FROM upd
"""


def report_progress(items: Sequence[tuple[UUID, int, float]], *, source: str, now: datetime | None = None) -> int:
    """Record live progress of running tasks (fenced by attempt). Return how many were updated."""
    if not items:
        return 0
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        lock_tasks(cur, [i[0] for i in items])
        now = now or db_now(cur)
        cur.execute(PROGRESS_SQL, {"ids": [i[0] for i in items], "att": [i[1] for i in items],
                                   "p": [i[2] for i in items], "now": now, "source": source})
        return cur.fetchone()[0]


PROMOTE_SCHEDULED_SQL = """
-- Retries whose backoff is over become claimable (scheduled → queued), oldest due first.
-- Served by task_scheduled_idx; SKIP LOCKED lets concurrent promoters share the work.
WITH due AS (
    SELECT id FROM accs_task
     WHERE status = 'scheduled' AND next_attempt_at <= coalesce(%(now)s::timestamptz, now())
       AND (%(services)s::bigint[] IS NULL
            OR service_id = ANY(%(services)s::bigint[]))
     ORDER BY next_attempt_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), up AS (
    UPDATE accs_task t SET status = 'queued', updated_at = now() FROM due WHERE t.id = due.id
    RETURNING t.id, t.job_id, t.attempt, t.service_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, attempt, source, level, type, message, data)
    SELECT job_id, id, attempt, %(source)s, 'info', 'status', 'task scheduled → queued (backoff over)',
           '{"from": "scheduled", "to": "queued"}'::jsonb FROM up
)
SELECT s.key, count(*) FROM up JOIN accs_service s ON s.id = up.service_id GROUP BY s.key
"""


def promote_scheduled_in(cur, *, services: Sequence[int] | None = None, limit: int = 1000,
                         source: str = BUILDER, now: datetime | None = None) -> int:
    """Promote due retries on ``cur`` (in the caller's transaction); wake their services; return how many."""
    cur.execute(PROMOTE_SCHEDULED_SQL, {"services": list(services) if services is not None else None,
                                        "limit": limit, "source": source, "now": now})
    rows = cur.fetchall()
    notify(cur, [service_channel(key) for key, _ in rows])
    return sum(n for _, n in rows)


def promote_scheduled(*, limit: int = 1000, now: datetime | None = None) -> int:
    """Make retries whose backoff is over claimable again (a builder duty). Return how many."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        return promote_scheduled_in(cur, limit=limit, now=now)
