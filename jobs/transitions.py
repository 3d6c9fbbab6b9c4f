"""The state machine (JOB3): every task and job status change, and nothing else, lives here.

Each transition is a conditional UPDATE naming the state(s) it leaves (and, for tasks held by an
agent, the attempt number, which fences late reports), plus its Event rows, in one transaction.
A transition that no longer applies changes nothing and says so in its return value.

Hot paths (claim lives in :mod:`jobs.claim`; reports and starts here) are set-based: one statement
handles a whole batch, so batching claims and reports costs no correctness and no event.

Transactions are ``atomic(savepoint=False)``: called inside a caller's transaction (the Python
API, an agent's report batch) a transition joins it without SAVEPOINT round trips, and a failure
aborts the whole caller's transaction, which is what the callers want.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection, transaction
from django.utils import timezone

from accs_site.conf import accs
from events.timeline import EventRow, write_events
from jobs.backoff import backoff_delay
from jobs.instantiate import (
    HostInfo, InstantiationError, JobRow, ServiceInfo, build_task_rows, steps_for,
)
from jobs.models import ApprovalState, JobStatus, TaskStatus
from jobs.sql import from_json
from jobs.notify import builder_channel, notify, service_channel

log = logging.getLogger("accs.transitions")

BUILDER = "builder"


# --------------------------------------------------------------------------------------------
# Jobs: queued → running (instantiation)
# --------------------------------------------------------------------------------------------

DUE_UNLIMITED_SQL = """
-- Due jobs whose admission needs no count (no workflow max_active_jobs, no tenant cap), in global
-- order; SKIP LOCKED lets several builders share the work. Served by job_due_idx.
SELECT j.id FROM accs_job j
  JOIN accs_tenant tn ON tn.id = j.tenant_id
  LEFT JOIN accs_workflow w ON w.id = j.workflow_id
 WHERE j.status = 'queued' AND j.scheduled_at <= %(now)s
   AND j.approval_state IN ('not_required', 'approved')
   AND coalesce(w.max_active_jobs, 0) = 0 AND tn.max_in_flight = 0
 ORDER BY j.scheduled_at, j.order_seq
 LIMIT %(limit)s
   FOR UPDATE OF j SKIP LOCKED
"""

DUE_LIMITED_KEYS_SQL = """
SELECT DISTINCT j.tenant_id, j.workflow_id FROM accs_job j
  JOIN accs_tenant tn ON tn.id = j.tenant_id
  LEFT JOIN accs_workflow w ON w.id = j.workflow_id
 WHERE j.status = 'queued' AND j.scheduled_at <= %(now)s
   AND j.approval_state IN ('not_required', 'approved')
   AND (coalesce(w.max_active_jobs, 0) > 0 OR tn.max_in_flight > 0)
 LIMIT %(limit)s
"""


def _lock_key(kind: str, value: Any) -> str:
    return f"accs:{kind}:{value}"


def _admit_limited(cur, *, tenant_id: UUID, workflow_id: UUID | None, now: datetime, limit: int) -> list[UUID]:
    """Admit the oldest due jobs of one (tenant, workflow) pair within its caps (CLM3).

    Advisory locks serialise admission per tenant and per workflow across builders, so counting
    running jobs and admitting new ones cannot interleave; jobs are taken strictly in order_seq.
    """
    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_lock_key("tenant", tenant_id)])
    if workflow_id:
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_lock_key("workflow", workflow_id)])
    cur.execute(
        "SELECT tn.max_in_flight, (SELECT count(*) FROM accs_job r WHERE r.tenant_id = tn.id AND r.status = 'running'),"
        "       coalesce(w.max_active_jobs, 0),"
        "       (SELECT count(*) FROM accs_job r WHERE r.workflow_id = w.id AND r.status = 'running')"
        "  FROM accs_tenant tn LEFT JOIN accs_workflow w ON w.id = %s WHERE tn.id = %s",
        [workflow_id, tenant_id],
    )
    tenant_cap, tenant_running, wf_cap, wf_running = cur.fetchone()
    room = limit
    if tenant_cap:
        room = min(room, tenant_cap - tenant_running)
    if wf_cap:
        room = min(room, wf_cap - (wf_running or 0))
    if room <= 0:
        return []
    cur.execute(
        "SELECT id FROM accs_job WHERE tenant_id = %s AND workflow_id IS NOT DISTINCT FROM %s AND status = 'queued'"
        "   AND scheduled_at <= %s AND approval_state IN ('not_required', 'approved')"
        " ORDER BY order_seq LIMIT %s FOR UPDATE",
        [tenant_id, workflow_id, now, room],
    )
    return [r[0] for r in cur.fetchall()]


def start_due_jobs(*, limit: int = 500, now: datetime | None = None) -> list[UUID]:
    """Instantiate due jobs (BLD1): the builder's main duty. Return the ids started."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute(DUE_UNLIMITED_SQL, {"now": now, "limit": limit})
        ids = [r[0] for r in cur.fetchall()]
        cur.execute(DUE_LIMITED_KEYS_SQL, {"now": now, "limit": limit})
        for tenant_id, workflow_id in sorted(cur.fetchall(), key=lambda k: (str(k[0]), str(k[1]))):
            if len(ids) >= limit:
                break
            ids += _admit_limited(cur, tenant_id=tenant_id, workflow_id=workflow_id, now=now, limit=limit - len(ids))
        return _instantiate(cur, ids, now=now, source=BUILDER)


def start_jobs(job_ids: Sequence[UUID], *, now: datetime | None = None, source: str = "api") -> list[UUID]:
    """Instantiate the given queued jobs now (the caller checked that they are due and admitted)."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        return _instantiate(cur, list(job_ids), now=now, source=source)  # locks them


INSERT_TASKS_SQL = """
-- One JSON document per batch: one round trip whatever the size (cheaper than COPY's protocol
-- exchange for the single-job path, and as fast for large batches).
INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status, depends_on,
                       attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,
                       assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at, finished_at)
SELECT r.id, r.job_id, r.tenant_id, r.task_key, r.step_key, r.service_id, r.host_id, r.exclusive, r.status,
       ARRAY(SELECT jsonb_array_elements_text(r.depends_on)), 0, r.max_attempts, %(now)s, r.priority, r.order_seq,
       r.timeout_seconds, r.params, r.assigned_node, '', '', r.error_code, r.error_message, %(now)s, %(now)s,
       CASE WHEN r.status = 'blocked' THEN %(now)s END
  FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(
       id uuid, job_id uuid, tenant_id uuid, task_key text, step_key text, service_id bigint, host_id bigint,
       exclusive boolean, status text, depends_on jsonb, max_attempts int, priority int, order_seq bigint,
       timeout_seconds int, params jsonb, assigned_node text, error_code text, error_message text)
"""


def _insert_tasks(cur, rows: list[dict[str, Any]], *, now: datetime) -> None:
    """Insert the task rows built by :func:`jobs.instantiate.build_task_rows` in one statement."""
    cur.execute(INSERT_TASKS_SQL, {"now": now, "rows": json.dumps(rows, default=str)})


def _instantiate(cur, job_ids: list[UUID], *, now: datetime, source: str) -> list[UUID]:
    """Create the tasks of locked queued jobs and move the jobs to running, with events."""
    if not job_ids:
        return []
    cur.execute(
        "SELECT j.id, j.tenant_id, j.workflow_id, j.service_id, j.priority, j.order_seq, j.options, j.step_params,"
        "       w.steps, s.key FROM accs_job j LEFT JOIN accs_workflow w ON w.id = j.workflow_id"
        "  LEFT JOIN accs_service s ON s.id = j.service_id WHERE j.id = ANY(%s) AND j.status = 'queued'"
        # CTL3: nothing instantiates a job whose approval is pending or rejected, whoever calls.
        "   AND j.approval_state IN ('not_required', 'approved')"
        " ORDER BY j.order_seq FOR UPDATE OF j",
        [job_ids],
    )
    jobs = [(*r[:6], from_json(r[6]), from_json(r[7]), from_json(r[8]), r[9]) for r in cur.fetchall()]
    service_keys = {key for *_, steps, key in jobs if key} | {
        step["service"] for *_, steps, _key in jobs if steps for step in steps}
    cur.execute("SELECT id, key, base_priority, max_attempts, timeout_seconds, exclusive_per_host FROM accs_service"
                " WHERE key = ANY(%s)", [sorted(service_keys)])
    services = {r[1]: ServiceInfo(*r) for r in cur.fetchall()}
    needs_hosts = any(s.get("fan_out") == "hosts" for *_, steps, _k in jobs if steps for s in steps)
    hosts: list[HostInfo] = []
    blocked: set[tuple[int, int]] = set()
    if needs_hosts:
        cur.execute("SELECT id, name, node_id, labels FROM accs_host ORDER BY name")
        hosts = [HostInfo(r[0], r[1], r[2], from_json(r[3]) or {}) for r in cur.fetchall()]
        cur.execute("SELECT host_id, service_id FROM accs_host_block")
        blocked = {(h, s) for h, s in cur.fetchall()}
    task_rows: list[dict[str, Any]] = []
    started: list[UUID] = []
    failed: list[tuple[UUID, str, str]] = []
    for jid, tenant_id, wf_id, svc_id, prio, seq, options, step_params, steps, svc_key in jobs:
        job = JobRow(jid, tenant_id, wf_id, svc_id, prio, seq, options or {}, step_params or {})
        try:
            task_rows += build_task_rows(job, steps_for(job, steps, svc_key), services, hosts=hosts,
                                         blocked=blocked)
            started.append(jid)
        except InstantiationError as exc:
            failed.append((jid, exc.code, str(exc)))
    if task_rows:
        _insert_tasks(cur, task_rows, now=now)
    events: list[EventRow] = []
    if started:
        cur.execute(
            "UPDATE accs_job SET status = 'running', started_at = %s, updated_at = %s,"
            "       current_task_key = coalesce((SELECT t.task_key FROM accs_task t WHERE t.job_id = accs_job.id"
            "                                    ORDER BY t.created_at, t.task_key LIMIT 1), '')"
            " WHERE id = ANY(%s) AND status = 'queued' RETURNING id",
            [now, now, started],
        )
        started = [r[0] for r in cur.fetchall()]
        events += [EventRow(type="status", message="job queued → running", job_id=j, source=source,
                            data={"from": "queued", "to": "running"}) for j in started]
        started_set = set(started)
        for row in task_rows:
            if row["job_id"] in started_set:
                status = row["status"]
                events.append(EventRow(type="status", message=f"task created {status}", job_id=row["job_id"],
                                       task_id=row["id"], source=source,
                                       level="warn" if status == TaskStatus.BLOCKED else "info",
                                       data={"to": status, "task_key": row["task_key"]}))
    for jid, code, message in failed:
        cur.execute("UPDATE accs_job SET status = 'error', error_code = %s, error_message = %s, finished_at = %s,"
                    " updated_at = %s WHERE id = %s AND status = 'queued'", [code, message, now, now, jid])
        events.append(EventRow(type="status", message=f"job queued → error: {message}", job_id=jid, source=source,
                               level="error", data={"from": "queued", "to": "error", "error_code": code}))
    write_events(events, cursor=cur)
    if started:
        started_set = set(started)
        queued_services = {r["service_id"] for r in task_rows
                           if r["status"] == TaskStatus.QUEUED and r["job_id"] in started_set}
        notify(cur, [service_channel(s.key) for s in services.values() if s.id in queued_services])
        with_blocked = {r["job_id"] for r in task_rows if r["status"] == TaskStatus.BLOCKED and r["job_id"] in started_set}
        _finalize_jobs(cur, sorted(with_blocked, key=str), now=now, source=source)
    return started


# --------------------------------------------------------------------------------------------
# Tasks held by agents: starting → running → done | queued (retry) | error | canceled
# --------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How one attempt ended, as reported by an agent."""

    task_id: UUID
    attempt: int
    status: str  # AttemptStatus value: succeeded | failed | timeout | canceled
    results: Any = None
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    error: str = ""
    error_code: str = ""
    retryable: bool = True


@dataclass
class ReportResult:
    """What a report changed; ``fenced`` lists reports rejected because the attempt is no longer current."""

    done: list[UUID] = field(default_factory=list)
    retried: list[UUID] = field(default_factory=list)
    failed: list[UUID] = field(default_factory=list)
    canceled: list[UUID] = field(default_factory=list)
    fenced: list[UUID] = field(default_factory=list)


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


def mark_running(items: Sequence[tuple[UUID, int, int | None]], *, agent_id: str, source: str,
                 now: datetime | None = None) -> set[UUID]:
    """Move claimed tasks to running; ``items`` are (task_id, attempt, pid). Return the ids moved."""
    if not items:
        return set()
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        return _mark_running(cur, items, agent_id=agent_id, source=source, now=now)


def _mark_running(cur, items, *, agent_id: str, source: str, now: datetime) -> set[UUID]:
    cur.execute(MARK_RUNNING_SQL, {"ids": [i[0] for i in items], "attempts": [i[1] for i in items],
                                   "pids": [i[2] for i in items], "now": now, "agent": agent_id, "source": source})
    return {r[0] for r in cur.fetchall()}


COMPLETE_SQL = """
-- Fenced by attempt: a report from an attempt that is no longer current changes nothing.
-- %(from_status)s is 'running', or 'starting' when the agent reports an attempt's start and end
-- together: the task then goes starting → done in one UPDATE and BOTH transitions get their event
-- (the intermediate row version would be visible to no other transaction anyway).
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(results)s::text[], %(codes)s::int[],
                                %(outs)s::text[], %(errs)s::text[], %(pids)s::int[])
                  AS v(id, attempt, results, code, out, err, pid)),
done AS (
    UPDATE accs_task t SET status = 'done', results = v.results::jsonb, progress = 1, finished_at = %(now)s,
           started_at = coalesce(t.started_at, %(now)s), updated_at = %(now)s
      FROM v WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = %(from_status)s
    RETURNING t.id, t.job_id, t.attempt, v.code, v.out, v.err, v.pid
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
      FROM done WHERE %(from_status)s = 'starting'
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
    now = now or timezone.now()
    result = ReportResult()
    started_pid = {(tid, att): pid for tid, att, pid in started}
    # Successes whose start is in this same report go starting → done in one statement.
    ok = [o for o in outcomes if o.status == "succeeded"]
    ok_with_start = [o for o in ok if (o.task_id, o.attempt) in started_pid]
    ok_running = [o for o in ok if (o.task_id, o.attempt) not in started_pid]
    combined = {(o.task_id, o.attempt) for o in ok_with_start}
    to_mark = [s for s in started if (s[0], s[1]) not in combined]
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if to_mark:
            _mark_running(cur, to_mark, agent_id=agent_id, source=source, now=now)
        if not outcomes:
            return result
        touched_jobs: set[UUID] = set()
        for group, from_status in ((ok_with_start, "starting"), (ok_running, "running")):
            if not group:
                continue
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
        fenced = [o for o in outcomes if o.task_id not in accepted]
        if fenced:
            result.fenced = [o.task_id for o in fenced]
            _record_fenced(cur, fenced, now=now, source=source)
        _finalize_jobs(cur, sorted(touched_jobs, key=str), now=now, source=source, failures=bool(bad))
    return result


def _record_fenced(cur, outcomes: Sequence[Outcome], *, now: datetime, source: str) -> None:
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
    """Apply failed/timeout/canceled outcomes: retry with backoff, or final error (dead letter)."""
    by_id = {o.task_id: o for o in outcomes}
    cur.execute(
        "SELECT t.id, t.job_id, t.attempt, t.max_attempts, t.status, t.host_id, s.backoff_base_seconds,"
        "       s.backoff_cap_seconds, s.quarantine_host_on_final_failure, t.cancel_requested_at IS NOT NULL,"
        "       s.max_attempts"
        "  FROM accs_task t JOIN accs_service s ON s.id = t.service_id"
        " WHERE t.id = ANY(%s) AND t.status = ANY(%s) ORDER BY t.id FOR UPDATE OF t",
        [list(by_id), list(from_statuses)],
    )
    touched: set[UUID] = set()
    events: list[EventRow] = []
    for (tid, jid, attempt, max_attempts, status, host_id, base, cap, quarantine, cancel_requested,
         budget) in cur.fetchall():
        o = by_id[tid]
        if o.attempt != attempt:
            continue  # fenced: reported below by the caller
        touched.add(jid)
        attempt_status = o.status if o.status in ("failed", "timeout", "canceled") else "failed"
        error = o.error or ("timeout" if attempt_status == "timeout" else "failed")
        cur.execute(
            "UPDATE accs_attempt SET status = %s, finished_at = %s, exit_code = %s, stdout_tail = %s,"
            " stderr_tail = %s, error_text = %s WHERE task_id = %s AND attempt_no = %s AND status = 'running'",
            [attempt_status, now, o.exit_code, o.stdout_tail, o.stderr_tail, error, tid, attempt],
        )
        if attempt_status == "canceled" or cancel_requested:
            cur.execute("UPDATE accs_task SET status = 'canceled', finished_at = %s, updated_at = %s,"
                        " error_code = 'canceled', error_message = %s WHERE id = %s AND status = %s",
                        [now, now, error, tid, status])
            result.canceled.append(tid)
            events.append(EventRow(type="status", message=f"task {status} → canceled", job_id=jid, task_id=tid,
                                   attempt=attempt, source=source, level="warn", data={"from": status, "to": "canceled"}))
            continue
        if o.retryable and attempt < max_attempts:
            # Count the backoff from the start of the current budget (a retried task starts over).
            in_budget = max(1, attempt - (max_attempts - budget))
            delay = backoff_delay(in_budget, base=accs.backoff_base_sec if base is None else base, cap=cap)
            next_at = now + timedelta(seconds=delay)
            cur.execute(
                "UPDATE accs_task SET status = 'queued', next_attempt_at = %s, updated_at = %s, error_code = %s,"
                " error_message = %s, claimed_by = '', lease_expires_at = NULL, progress = NULL"
                " WHERE id = %s AND status = %s",
                [next_at, now, o.error_code or attempt_status, error[:2000], tid, status],
            )
            result.retried.append(tid)
            events.append(EventRow(
                type="retry", level="warn", job_id=jid, task_id=tid, attempt=attempt, source=source,
                message=f"task {status} → queued: attempt {attempt}/{max_attempts} {attempt_status}, retry in {delay:.1f}s",
                data={"from": status, "to": "queued", "error": error[:500], "delay_seconds": round(delay, 3),
                      "next_attempt_at": next_at.isoformat()},
            ))
        else:
            cur.execute(
                "UPDATE accs_task SET status = 'error', finished_at = %s, updated_at = %s, error_code = %s,"
                " error_message = %s WHERE id = %s AND status = %s",
                [now, now, o.error_code or attempt_status, error[:2000], tid, status],
            )
            result.failed.append(tid)
            events.append(EventRow(
                type="status", level="error", job_id=jid, task_id=tid, attempt=attempt, source=source,
                message=f"task {status} → error (final after {attempt}/{max_attempts} attempts): {error[:200]}",
                data={"from": status, "to": "error", "dead_letter": True, "error": error[:500]},
            ))
            if quarantine and host_id:
                events += _quarantine_host(cur, host_id, reason=f"task {tid} failed for good: {error[:200]}",
                                           job_id=jid, task_id=tid, now=now, source=source)
            cur.execute(
                "UPDATE accs_job SET status = 'error', error_code = 'task_failed', error_message = %s, finished_at = %s,"
                " updated_at = %s WHERE id = %s AND status = 'running' RETURNING id",
                [f"task {tid} failed: {error[:500]}", now, now, jid],
            )
            if cur.fetchone():
                events.append(EventRow(type="status", level="error", job_id=jid, source=source,
                                       message="job running → error", data={"from": "running", "to": "error"}))
                events += _skip_unstarted(cur, [jid], now=now, source=source, reason="job failed")
    write_events(events, cursor=cur)
    return touched


def _quarantine_host(cur, host_id: int, *, reason: str, job_id, task_id, now: datetime, source: str) -> list[EventRow]:
    cur.execute("UPDATE accs_host SET status = 'error', quarantined_at = %s, quarantine_reason = %s"
                " WHERE id = %s AND status = 'ok' RETURNING name", [now, reason, host_id])
    row = cur.fetchone()
    if not row:
        return []
    return [EventRow(type="status", level="error", job_id=job_id, task_id=task_id, source=source,
                     message=f"host {row[0]} ok → error (quarantined)", data={"host": row[0], "to": "error"})]


def _skip_unstarted(cur, job_ids: Sequence[UUID], *, now: datetime, source: str, reason: str,
                    to: str = "skipped") -> list[EventRow]:
    cur.execute(
        f"UPDATE accs_task SET status = '{to}', finished_at = %s, updated_at = %s, error_message = %s"
        " WHERE job_id = ANY(%s) AND status IN ('waiting', 'queued') RETURNING id, job_id, status",
        [now, now, reason, list(job_ids)],
    )
    return [EventRow(type="status", job_id=jid, task_id=tid, source=source, level="warn",
                     message=f"task → {to} ({reason})", data={"to": to, "reason": reason})
            for tid, jid, _ in cur.fetchall()]


SKIP_ORPHANS_SQL = """
-- Waiting tasks whose dependency can no longer succeed are skipped (repeated for chains).
UPDATE accs_task w SET status = 'skipped', finished_at = %(now)s, updated_at = %(now)s,
       error_message = 'a dependency did not succeed'
 WHERE w.job_id = ANY(%(jobs)s) AND w.status = 'waiting'
   AND EXISTS (SELECT 1 FROM accs_task d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                  AND d.status IN ('error', 'skipped', 'canceled', 'blocked'))
RETURNING w.id, w.job_id
"""

PROMOTE_AND_FINISH_SQL = """
-- JOB2: waiting → queued once every dependency is done. JOB4: progress = share of finished tasks,
-- current_task_key = first unfinished task, and a running job whose tasks are all final with none
-- in error is done. The caller locked the job rows first, so this statement's snapshot includes
-- every committed sibling completion and two completions in one job cannot miss each other.
WITH p AS (
    UPDATE accs_task w SET status = 'queued', next_attempt_at = %(now)s, updated_at = %(now)s
     WHERE w.job_id = ANY(%(jobs)s) AND w.status = 'waiting'
       AND NOT EXISTS (SELECT 1 FROM accs_task d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                          AND d.status <> 'done')
    RETURNING w.id, w.job_id, w.service_id
), pev AS (
    INSERT INTO accs_event (ts, job_id, task_id, source, level, type, message, data)
    SELECT %(now)s, job_id, id, %(source)s, 'info', 'status', 'task waiting → queued',
           '{"from": "waiting", "to": "queued"}'::jsonb FROM p
), agg AS (
    SELECT t.job_id,
           count(*) AS total,
           count(*) FILTER (WHERE t.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')) AS finished,
           count(*) FILTER (WHERE t.status = 'error') AS errors,
           (array_agg(t.task_key ORDER BY t.created_at, t.task_key)
                FILTER (WHERE t.status NOT IN ('done', 'error', 'skipped', 'canceled', 'blocked')))[1] AS current_key
      FROM accs_task t WHERE t.job_id = ANY(%(jobs)s) GROUP BY t.job_id
), upd AS (
    UPDATE accs_job j
       SET progress = agg.finished::float / greatest(agg.total, 1),
           current_task_key = coalesce(agg.current_key, j.current_task_key),
           status = CASE WHEN j.status = 'running' AND agg.finished = agg.total AND agg.errors = 0 THEN 'done'
                         ELSE j.status END,
           finished_at = CASE WHEN j.status = 'running' AND agg.finished = agg.total AND agg.errors = 0 THEN %(now)s
                              ELSE j.finished_at END,
           updated_at = %(now)s
      FROM agg WHERE j.id = agg.job_id
    RETURNING j.id, j.status
), jev AS (
    INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
    SELECT %(now)s, id, %(source)s, 'info', 'status', 'job running → done', '{"from": "running", "to": "done"}'::jsonb
      FROM upd WHERE status = 'done'
)
SELECT DISTINCT s.key FROM p JOIN accs_service s ON s.id = p.service_id
"""


def _finalize_jobs(cur, job_ids: Sequence[UUID], *, now: datetime, source: str, failures: bool = True) -> None:
    """Skip orphaned waiters, promote ready ones, update progress and finish jobs (JOB2, JOB4).

    ``failures=False`` (a report of successes only) skips the orphan pass: a success can make
    no waiting task unreachable.
    """
    if not job_ids:
        return
    jobs = sorted(set(job_ids), key=str)
    # Lock the jobs first so the statements below see every committed sibling completion.
    cur.execute("SELECT id FROM accs_job WHERE id = ANY(%s) ORDER BY id FOR UPDATE", [jobs])
    for _ in range(100 if failures else 0):  # bounded by the depth of the DAG
        cur.execute(SKIP_ORPHANS_SQL, {"jobs": jobs, "now": now})
        skipped = cur.fetchall()
        if not skipped:
            break
        write_events([EventRow(type="status", job_id=j, task_id=t, source=source, level="warn",
                               message="task waiting → skipped (a dependency did not succeed)",
                               data={"from": "waiting", "to": "skipped"}) for t, j in skipped], cursor=cur)
    cur.execute(PROMOTE_AND_FINISH_SQL, {"jobs": jobs, "now": now, "source": source})
    notify(cur, [service_channel(r[0]) for r in cur.fetchall()])


# --------------------------------------------------------------------------------------------
# Leases (RTY2)
# --------------------------------------------------------------------------------------------

HEARTBEAT_SQL = """
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS v(id, attempt))
UPDATE accs_task t SET lease_expires_at = %(lease)s, heartbeat_at = %(now)s
  FROM v WHERE t.id = v.id AND t.attempt = v.attempt AND t.status IN ('starting', 'running')
   AND t.claimed_by = %(agent)s
RETURNING t.id, t.attempt, t.cancel_requested_at IS NOT NULL
"""


def heartbeat(held: Sequence[tuple[UUID, int]], *, agent_id: str, lease_seconds: float,
              now: datetime | None = None) -> tuple[set[tuple[UUID, int]], set[tuple[UUID, int]]]:
    """Extend the leases of (task, attempt) pairs this agent holds. Return (lost, cancel_requested).

    ``lost`` are attempts no longer held (rescued or canceled): the agent must stop them.
    ``cancel_requested`` are attempts an operator asked to cancel (JOB5). Both hold
    (task_id, attempt) pairs, so an old attempt's answer never touches a newer one.
    """
    if not held:
        return set(), set()
    now = now or timezone.now()
    with connection.cursor() as cur:
        cur.execute(HEARTBEAT_SQL, {"ids": [h[0] for h in held], "attempts": [h[1] for h in held],
                                    "lease": now + timedelta(seconds=lease_seconds), "now": now, "agent": agent_id})
        rows = cur.fetchall()
    kept = {(r[0], r[1]) for r in rows}
    return {(h[0], h[1]) for h in held} - kept, {(r[0], r[1]) for r in rows if r[2]}


def rescue_expired(*, limit: int = 500, now: datetime | None = None) -> ReportResult:
    """Requeue (or fail for good) tasks whose lease expired: a failed attempt, reason lease_expired."""
    now = now or timezone.now()
    result = ReportResult()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute(
            "SELECT id, attempt FROM accs_task WHERE status IN ('starting', 'running') AND lease_expires_at < %s"
            " ORDER BY lease_expires_at LIMIT %s FOR UPDATE SKIP LOCKED",
            [now, limit],
        )
        expired = [Outcome(task_id=tid, attempt=attempt, status="failed", error="lease_expired: no heartbeat",
                           error_code="lease_expired") for tid, attempt in cur.fetchall()]
        if expired:
            touched = _record_failures(cur, expired, result, now=now, source=BUILDER)
            _finalize_jobs(cur, sorted(touched, key=str), now=now, source=BUILDER)
    return result


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------

def report_progress(items: Sequence[tuple[UUID, int, float]], *, source: str, now: datetime | None = None) -> int:
    """Record live progress of running tasks (fenced by attempt). Return how many were updated."""
    if not items:
        return 0
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute(
            "WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(att)s::int[], %(p)s::float8[]) AS v(id, attempt, p)),"
            " upd AS (UPDATE accs_task t SET progress = least(greatest(v.p, 0), 1), updated_at = %(now)s FROM v"
            "         WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = 'running'"
            "         RETURNING t.id, t.job_id, t.attempt, t.progress)"
            " INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)"
            " SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'progress', 'progress ' || round((progress * 100)::numeric, 1) || '%%',"
            "        jsonb_build_object('progress', progress) FROM upd",
            {"ids": [i[0] for i in items], "att": [i[1] for i in items], "p": [i[2] for i in items],
             "now": now, "source": source},
        )
        return cur.rowcount


# --------------------------------------------------------------------------------------------
# Operator and API actions: cancel, retry, approve, reject, host quarantine (JOB5, CTL3, RTY4)
# --------------------------------------------------------------------------------------------

@dataclass
class ActionResult:
    """Outcome of an operator action: ``changed`` False means it no longer applied (and why)."""

    changed: bool
    message: str


def _job_event(cur, job_id, message: str, *, by: str, level: str = "info", data: dict | None = None) -> None:
    write_events([EventRow(type="status", message=message, job_id=job_id, source=f"user:{by}" if by else "api",
                           level=level, data=data or {})], cursor=cur)


def cancel_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Cancel a queued or running job: unstarted tasks are canceled, running ones told to stop."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_job SET status = 'canceled', finished_at = %s, updated_at = %s,"
                    " error_code = 'canceled', error_message = %s WHERE id = %s AND status IN ('queued', 'running')"
                    " RETURNING status", [now, now, f"canceled by {by or 'api'}", job_id])
        if not cur.fetchone():
            return ActionResult(False, "job is not queued or running; nothing to cancel")
        _job_event(cur, job_id, "job → canceled", by=by, level="warn", data={"to": "canceled"})
        write_events(_skip_unstarted(cur, [job_id], now=now, source=f"user:{by}", reason="job canceled", to="canceled"),
                     cursor=cur)
        cur.execute("UPDATE accs_task SET cancel_requested_at = %s WHERE job_id = %s AND status IN ('starting', 'running')"
                    " AND cancel_requested_at IS NULL RETURNING id, attempt", [now, job_id])
        held = cur.fetchall()
        write_events([EventRow(type="status", message="cancel requested; the agent stops the task at its next heartbeat",
                               job_id=job_id, task_id=t, attempt=a, source=f"user:{by}", level="warn")
                      for t, a in held], cursor=cur)
        cur.execute("UPDATE accs_job SET progress = (SELECT count(*) FILTER (WHERE status IN ('done','error','skipped',"
                    "'canceled','blocked'))::float / greatest(count(*), 1) FROM accs_task WHERE job_id = %s) WHERE id = %s",
                    [job_id, job_id])
    return ActionResult(True, f"job canceled ({len(held)} running task(s) told to stop)")


def cancel_task(task_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Cancel one task: waiting/queued → canceled; starting/running → the agent is told to stop."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET status = 'canceled', finished_at = %s, updated_at = %s, error_code = 'canceled'"
                    " WHERE id = %s AND status IN ('waiting', 'queued') RETURNING job_id, status", [now, now, task_id])
        row = cur.fetchone()
        if row:
            write_events([EventRow(type="status", message="task → canceled", job_id=row[0], task_id=task_id,
                                   source=f"user:{by}", level="warn", data={"to": "canceled"})], cursor=cur)
            _finalize_jobs(cur, [row[0]], now=now, source=f"user:{by}")
            return ActionResult(True, "task canceled")
        cur.execute("UPDATE accs_task SET cancel_requested_at = %s WHERE id = %s AND status IN ('starting', 'running')"
                    " RETURNING job_id, attempt", [now, task_id])
        row = cur.fetchone()
        if row:
            write_events([EventRow(type="status", message="cancel requested", job_id=row[0], task_id=task_id,
                                   attempt=row[1], source=f"user:{by}", level="warn")], cursor=cur)
            return ActionResult(True, "cancel requested; the agent stops the task at its next heartbeat")
    return ActionResult(False, "task is already finished; nothing to cancel")


def _reset_tasks(cur, where_sql: str, params: list, *, now: datetime, source: str) -> list[tuple]:
    """Put failed/skipped/canceled/blocked tasks back: queued (no deps) or waiting, attempts reset.

    "Attempts reset" renews the retry budget: ``max_attempts`` becomes the attempts used so far plus
    the service's budget. Attempt numbers themselves never go back, so each Attempt row keeps its
    number and a late report from an earlier attempt stays fenced.
    """
    cur.execute(
        "UPDATE accs_task t SET status = CASE WHEN cardinality(t.depends_on) = 0 THEN 'queued' ELSE 'waiting' END,"
        "  max_attempts = t.attempt + s.max_attempts,"
        "  next_attempt_at = %s, updated_at = %s, finished_at = NULL, error_code = '', error_message = '',"
        "  results = NULL, progress = NULL, claimed_by = '', lease_expires_at = NULL, cancel_requested_at = NULL"
        "  FROM accs_service s"
        f" WHERE s.id = t.service_id AND {where_sql} AND t.status IN ('error', 'skipped', 'canceled', 'blocked')"
        " RETURNING t.id, t.job_id, t.status, t.service_id",
        [now, now, *params],
    )
    rows = cur.fetchall()
    write_events([EventRow(type="status", message=f"task → {st} (retry, attempts reset)", job_id=j, task_id=t,
                           source=source, data={"to": st, "retry": True}) for t, j, st, _ in rows], cursor=cur)
    return rows


def _notify_services(cur, service_ids: Iterable[int]) -> None:
    ids = sorted(set(service_ids))
    if ids:
        cur.execute("SELECT key FROM accs_service WHERE id = ANY(%s)", [ids])
        notify(cur, [service_channel(r[0]) for r in cur.fetchall()])


def retry_job(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put a failed or canceled job back to work: failed/skipped/canceled tasks are reset (JOB5)."""
    now = now or timezone.now()
    source = f"user:{by}" if by else "api"
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("SELECT status, approval_state, started_at IS NOT NULL FROM accs_job WHERE id = %s FOR UPDATE", [job_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "no such job")
        status, approval, instantiated = row
        if approval in (ApprovalState.PENDING, ApprovalState.REJECTED):
            return ActionResult(False, f"job approval is {approval}; approve it before it can run")
        if status not in (JobStatus.ERROR, JobStatus.CANCELED):
            return ActionResult(False, f"job is {status}; only failed or canceled jobs can be retried")
        new_status = "running" if instantiated else "queued"
        cur.execute("UPDATE accs_job SET status = %s, finished_at = NULL, error_code = '', error_message = '',"
                    " updated_at = %s WHERE id = %s AND status = %s", [new_status, now, job_id, status])
        _job_event(cur, job_id, f"job {status} → {new_status} (retry)", by=by, data={"from": status, "to": new_status})
        rows = _reset_tasks(cur, "t.job_id = %s", [job_id], now=now, source=source)
        _notify_services(cur, [r[3] for r in rows if r[2] == "queued"])
        if not instantiated:
            notify(cur, [builder_channel()])
        _finalize_jobs(cur, [job_id], now=now, source=source)
    return ActionResult(True, f"job back to {new_status}; {len(rows)} task(s) reset")


def retry_task(task_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Put one failed (dead-letter), skipped, canceled or blocked task back to queued, attempts reset."""
    now = now or timezone.now()
    source = f"user:{by}" if by else "api"
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("SELECT j.id, j.status, j.approval_state FROM accs_task t JOIN accs_job j ON j.id = t.job_id"
                    " WHERE t.id = %s FOR UPDATE OF j", [task_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "no such task")
        job_id, job_status, approval = row
        if approval in (ApprovalState.PENDING, ApprovalState.REJECTED):
            return ActionResult(False, f"job approval is {approval}; approve it before it can run")
        rows = _reset_tasks(cur, "t.id = %s", [task_id], now=now, source=source)
        if not rows:
            return ActionResult(False, "task is not failed, skipped, canceled or blocked")
        if job_status in (JobStatus.ERROR, JobStatus.CANCELED, JobStatus.DONE):
            cur.execute("UPDATE accs_job SET status = 'running', finished_at = NULL, error_code = '', error_message = '',"
                        " updated_at = %s WHERE id = %s", [now, job_id])
            _job_event(cur, job_id, f"job {job_status} → running (task retried)", by=by,
                       data={"from": job_status, "to": "running"})
            # Dependents skipped because this task failed get another chance too.
            _reset_tasks(cur, "t.job_id = %s AND t.status = 'skipped'", [job_id], now=now, source=source)
        _notify_services(cur, [r[3] for r in rows])
        _finalize_jobs(cur, [job_id], now=now, source=source)
    return ActionResult(True, "task queued again")


def approve(job_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Approve a job waiting for approval (CTL3); the builder then starts it."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_job SET approval_state = 'approved', approved_by = %s, approved_at = %s, updated_at = %s"
                    " WHERE id = %s AND approval_state = 'pending' AND status = 'queued' RETURNING id",
                    [by, now, now, job_id])
        if not cur.fetchone():
            return ActionResult(False, "job is not waiting for approval")
        write_events([EventRow(type="approval", message=f"job approved by {by or 'api'}", job_id=job_id,
                               source=f"user:{by}" if by else "api", data={"from": "pending", "to": "approved"})],
                     cursor=cur)
        notify(cur, [builder_channel()])
    return ActionResult(True, "job approved")


def reject(job_id: UUID, *, by: str = "", reason: str = "", now: datetime | None = None) -> ActionResult:
    """Reject a job waiting for approval: the job and its unstarted tasks are canceled (CTL3)."""
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_job SET approval_state = 'rejected', approved_by = %s, approved_at = %s,"
                    " status = 'canceled', finished_at = %s, updated_at = %s, error_code = 'rejected', error_message = %s"
                    " WHERE id = %s AND approval_state = 'pending' AND status IN ('queued', 'running') RETURNING id",
                    [by, now, now, now, reason or f"rejected by {by or 'api'}", job_id])
        if not cur.fetchone():
            return ActionResult(False, "job is not waiting for approval")
        write_events([EventRow(type="approval", message=f"job rejected by {by or 'api'}: job → canceled", job_id=job_id,
                               source=f"user:{by}" if by else "api", level="warn",
                               data={"from": "pending", "to": "rejected", "reason": reason})], cursor=cur)
        write_events(_skip_unstarted(cur, [job_id], now=now, source=f"user:{by}", reason="job rejected", to="canceled"),
                     cursor=cur)
    return ActionResult(True, "job rejected and canceled")


def clear_quarantine(host_id: int, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Make a quarantined host eligible again (RTY4)."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_host SET status = 'ok', quarantined_at = NULL, quarantine_reason = ''"
                    " WHERE id = %s AND status = 'error' RETURNING name", [host_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "host is not quarantined")
        write_events([EventRow(type="status", message=f"host {row[0]} error → ok (quarantine cleared by {by or 'api'})",
                               source=f"user:{by}" if by else "api", data={"host": row[0], "to": "ok"})], cursor=cur)
        cur.execute("SELECT DISTINCT service_id FROM accs_task WHERE host_id = %s AND status = 'queued'", [host_id])
        _notify_services(cur, [r[0] for r in cur.fetchall()])
    return ActionResult(True, f"host {row[0]} is eligible again")


def block_queued_tasks(*, service_id: int, host_ids: Sequence[int], now: datetime | None = None,
                       source: str = "agent") -> int:
    """Move queued tasks of a service on blocked hosts to ``blocked`` (CLM4). Return how many."""
    if not host_ids:
        return 0
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET status = 'blocked', finished_at = %s, updated_at = %s, error_code = 'host_blocked'"
                    " WHERE service_id = %s AND host_id = ANY(%s) AND status = 'queued' RETURNING id, job_id",
                    [now, now, service_id, list(host_ids)])
        rows = cur.fetchall()
        write_events([EventRow(type="status", message="task queued → blocked (host block)", job_id=j, task_id=t,
                               source=source, level="warn", data={"from": "queued", "to": "blocked"})
                      for t, j in rows], cursor=cur)
        _finalize_jobs(cur, sorted({j for _, j in rows}, key=str), now=now, source=source)
    return len(rows)


__all__ = [
    "ActionResult", "Outcome", "ReportResult", "approve", "block_queued_tasks", "cancel_job", "cancel_task",
    "clear_quarantine", "heartbeat", "mark_running", "reject", "report", "report_progress", "rescue_expired",
    "retry_job", "retry_task", "start_due_jobs", "start_jobs",
]


# --------------------------------------------------------------------------------------------
# Nodes: active ⇄ draining (OPS1). A draining node's agents claim nothing new and finish what
# they hold; the agent reads Node.state at each heartbeat.
# --------------------------------------------------------------------------------------------

def _set_node_state(name: str, *, to: str, by: str) -> ActionResult:
    source = f"user:{by}" if by else "api"
    frm = "draining" if to == "active" else "active"
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_node SET state = %s WHERE name = %s AND state = %s RETURNING name", [to, name, frm])
        if not cur.fetchone():
            cur.execute("SELECT state FROM accs_node WHERE name = %s", [name])
            row = cur.fetchone()
            return ActionResult(False, f"node {name} is {row[0]}; nothing to do" if row else f"no node {name!r}")
        write_events([EventRow(type="node", message=f"node {name} {frm} → {to} (by {by or 'api'})", source=source,
                               level="warn" if to == "draining" else "info",
                               data={"node": name, "from": frm, "to": to})], cursor=cur)
    return ActionResult(True, f"node {name} is {to}" + (": it claims nothing new" if to == "draining" else ""))


def drain_node(name: str, *, by: str = "") -> ActionResult:
    """Stop a node from claiming new tasks; its running tasks finish normally."""
    return _set_node_state(name, to="draining", by=by)


def undrain_node(name: str, *, by: str = "") -> ActionResult:
    """Let a draining node claim tasks again."""
    return _set_node_state(name, to="active", by=by)


__all__ += ["drain_node", "undrain_node"]
