"""Admission and instantiation: the builder's side of a job's life (queued → waiting).

A due job (scheduled time reached, approval not pending or rejected) is admitted when its
workflow's ``max_active_jobs`` and its tenant's ``max_in_flight`` have room, strictly in
``order_seq`` order, and then instantiated: one task per step (one per host for a fan-out step),
its step counts, and its events, in the transaction that moves it to ``waiting`` (it becomes
``running`` when an agent starts one of its tasks, see :mod:`jobs.reports`).

Exactness under several builders: admission takes the advisory locks of every tenant and
workflow whose cap it counts (sorted, see :mod:`jobs.locks`), counts their jobs that hold
capacity (admitted, or with a task starting or running whatever the job's status), and
admits job by job in order, adding each admitted job to the counts before looking at the next.
A job retried by an operator comes back through the same door (:func:`readmit`).

The job row itself is inserted by :mod:`jobs.enqueue`, the one place a job is created.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.clock import db_now
from events.timeline import BUILDER, EventRow, creation_event, write_events
from jobs.finalize import finalize_jobs
from jobs.instantiate import HostInfo, InstantiationError, JobRow, ServiceInfo, build_task_rows, step_rows, steps_for
from jobs.locks import advisory_locks, lock_jobs
from jobs.models import TaskStatus
from jobs.notify import builder_channel, notify, service_channel
from jobs.sql import from_json
from jobs.states import JOB_ADMITTED, TASK_HELD, sql_in

log = logging.getLogger("accs.admission")


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

DUE_LIMITED_SQL = """
-- Due jobs under a cap, oldest first (order_seq): read without locks; admission locks and counts.
SELECT j.id, j.tenant_id, j.workflow_id, tn.max_in_flight, coalesce(w.max_active_jobs, 0)
  FROM accs_job j
  JOIN accs_tenant tn ON tn.id = j.tenant_id
  LEFT JOIN accs_workflow w ON w.id = j.workflow_id
 WHERE j.status = 'queued' AND j.scheduled_at <= %(now)s
   AND j.approval_state IN ('not_required', 'approved')
   AND (coalesce(w.max_active_jobs, 0) > 0 OR tn.max_in_flight > 0)
 ORDER BY j.order_seq
 LIMIT %(limit)s
"""


def tenant_lock_key(tenant_id: Any) -> str:
    return f"accs:tenant:{tenant_id}"


def workflow_lock_key(workflow_id: Any) -> str:
    return f"accs:workflow:{workflow_id}"


HOLDING_SQL = f"""
-- The jobs that hold capacity under the given tenants and workflows: every admitted job, and every
-- job, whatever its own status, while a task of it is starting or running (a job canceled or
-- failed while a task of it still runs keeps its slot until that task ends). One statement, so
-- one snapshot: a job moving from admitted to ended while its task runs is counted either way.
-- The held tasks come from task_lease_idx (few: the fleet's slots), the admitted jobs from
-- job_workflow_admitted_idx and job_tenant_status_created_idx.
SELECT h.tenant_id, h.workflow_id, grouping(h.tenant_id), count(*) FROM (
    SELECT j.id, j.tenant_id, j.workflow_id FROM accs_job j
     WHERE j.status IN {sql_in(JOB_ADMITTED)}
       AND (j.tenant_id = ANY(%(tenants)s::uuid[]) OR j.workflow_id = ANY(%(workflows)s::uuid[]))
    UNION
    SELECT j.id, j.tenant_id, j.workflow_id FROM accs_job j
     WHERE j.id IN (SELECT t.job_id FROM accs_task t WHERE t.status IN {sql_in(TASK_HELD)})
       AND (j.tenant_id = ANY(%(tenants)s::uuid[]) OR j.workflow_id = ANY(%(workflows)s::uuid[]))
) h
 GROUP BY GROUPING SETS ((h.tenant_id), (h.workflow_id))
"""


def _holding_counts(cur, *, tenants: Sequence[Any], workflows: Sequence[Any]) -> tuple[dict, dict]:
    """Count the jobs holding capacity per tenant and per workflow (see HOLDING_SQL)."""
    cur.execute(HOLDING_SQL, {"tenants": [str(t) for t in tenants], "workflows": [str(w) for w in workflows if w]})
    by_tenant: dict[str, int] = {}
    by_workflow: dict[str, int] = {}
    wanted_t, wanted_w = {str(t) for t in tenants}, {str(w) for w in workflows if w}
    for tenant_id, workflow_id, by_workflow_set, n in cur.fetchall():
        if not by_workflow_set and str(tenant_id) in wanted_t:
            by_tenant[str(tenant_id)] = n
        elif by_workflow_set and workflow_id and str(workflow_id) in wanted_w:
            by_workflow[str(workflow_id)] = n
    return by_tenant, by_workflow


def _admit_in_order(cur, candidates: list[tuple], *, limit: int) -> list[UUID]:
    """Admit capped jobs strictly oldest first; the caller holds the advisory locks.

    ``candidates`` are (id, tenant, workflow, tenant cap, workflow cap) in ``order_seq`` order. A
    job that does not fit holds back every younger job of its workflow and tenant, so a
    ``max_active_jobs`` of 1 runs one job at a time, oldest first.
    """
    tenants = sorted({str(c[1]) for c in candidates})
    workflows = sorted({str(c[2]) for c in candidates if c[2]})
    running_t, running_w = _holding_counts(cur, tenants=tenants, workflows=workflows)
    held_t: set[str] = set()
    held_w: set[str] = set()
    admitted: list[UUID] = []
    for jid, tenant, workflow, tenant_cap, wf_cap in candidates:
        t, w = str(tenant), str(workflow) if workflow else None
        if len(admitted) >= limit:
            break
        if t in held_t or (w and w in held_w):
            continue
        fits_t = not tenant_cap or running_t.get(t, 0) < tenant_cap
        fits_w = not wf_cap or running_w.get(w, 0) < wf_cap
        if not (fits_t and fits_w):
            if not fits_t:
                held_t.add(t)
            if w and (not fits_w or wf_cap):
                held_w.add(w)  # oldest first within a capped workflow
            continue
        admitted.append(jid)
        running_t[t] = running_t.get(t, 0) + 1
        if w:
            running_w[w] = running_w.get(w, 0) + 1
    return admitted


def start_due_jobs(*, limit: int = 500, now: datetime | None = None) -> list[UUID]:
    """Admit and instantiate due jobs: the builder's main duty. Return the ids started."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        now = now or db_now(cur)
        cur.execute(DUE_LIMITED_SQL, {"now": now, "limit": limit})
        candidates = cur.fetchall()
        limited: list[UUID] = []
        if candidates:
            advisory_locks(cur, [tenant_lock_key(c[1]) for c in candidates if c[3]]
                           + [workflow_lock_key(c[2]) for c in candidates if c[2] and c[4]])
            limited = _admit_in_order(cur, candidates, limit=limit)
        cur.execute(DUE_UNLIMITED_SQL, {"now": now, "limit": max(0, limit - len(limited))})
        ids = [r[0] for r in cur.fetchall()] + limited
        return _instantiate(cur, ids, now=now, source=BUILDER)


def start_jobs(job_ids: Sequence[UUID], *, now: datetime | None = None, source: str = "api") -> list[UUID]:
    """Instantiate the given queued jobs now if they are due (the caller checked that they need no admission)."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        now = now or db_now(cur)
        return _instantiate(cur, list(job_ids), now=now, source=source)


def readmit(cur, job_id: UUID, *, tenant_id: Any, workflow_id: Any, now: datetime, source: str) -> str:
    """Send a retried job back through admission; return the job's new status.

    The caller holds the job's and its tasks' locks. A job under no cap is ``waiting`` again at
    once; under a workflow or tenant cap it is ``queued`` with its unstarted tasks ``waiting``,
    and a builder admits it in ``order_seq`` order with every other due job.
    """
    cur.execute("SELECT tn.max_in_flight, coalesce(w.max_active_jobs, 0) FROM accs_tenant tn"
                " LEFT JOIN accs_workflow w ON w.id = %s WHERE tn.id = %s", [workflow_id, tenant_id])
    tenant_cap, wf_cap = cur.fetchone()
    if not (tenant_cap or wf_cap):
        return "waiting"
    # Under a cap the builder decides, in order_seq order with every other due job.
    cur.execute("WITH o AS (SELECT id, status FROM accs_task WHERE job_id = %s AND status IN ('queued', 'scheduled'))"
                " UPDATE accs_task t SET status = 'waiting', updated_at = %s FROM o WHERE t.id = o.id"
                " RETURNING t.id, o.status", [job_id, now])
    write_events([EventRow(type="status", message=f"task {frm} → waiting (the job waits for admission)",
                           job_id=job_id, task_id=tid, source=source, data={"from": frm, "to": "waiting"})
                  for tid, frm in sorted(cur.fetchall())], cursor=cur)  # the order of creation
    notify(cur, [builder_channel()])
    return "queued"


def read_hosts(cur) -> list[HostInfo]:
    """Return every host a fan-out step may run on, by name."""
    cur.execute("SELECT id, name, node_id, labels FROM accs_host ORDER BY name")
    return [HostInfo(r[0], r[1], r[2], from_json(r[3]) or {}) for r in cur.fetchall()]


INSERT_TASKS_SQL = """
-- One JSON document per batch: one round trip whatever the size.
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

INSERT_STEPS_SQL = """
INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked, released,
                           poisoned, on_failure, always, max_items)
SELECT r.job_id, r.step_key, r.position, r.total, 0, 0, 0, 0, r.blocked, false, false, r.on_failure, r.always,
       r.max_items
  FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(job_id uuid, step_key text, position int, total int, blocked int,
                                               on_failure text, always boolean, max_items int)
"""


def _insert_tasks(cur, rows: list[dict[str, Any]], *, now: datetime) -> None:
    """Insert the task rows built by :func:`jobs.instantiate.build_task_rows` and their step counts."""
    cur.execute(INSERT_TASKS_SQL, {"now": now, "rows": json.dumps(rows, default=str)})
    cur.execute(INSERT_STEPS_SQL, {"rows": json.dumps(step_rows(rows))})


def _instantiate(cur, job_ids: list[UUID], *, now: datetime, source: str) -> list[UUID]:
    """Create the tasks of due queued jobs and move the jobs to waiting, with events.

    A job that already has tasks (re-admitted after a retry) only moves to waiting and has its
    waiting roots promoted. A job whose definition can no longer be turned into tasks (a step's
    service renamed or deleted, no host matches) fails alone, with the reason in its event.
    """
    if not job_ids:
        return []
    lock_jobs(cur, job_ids)
    cur.execute(
        # A job's priority is clamped into its tenant's band here too, whoever wrote the row and
        # whenever the band changed: the tasks are what the claim orders.
        "SELECT j.id, j.tenant_id, j.workflow_id, j.service_id, greatest(tn.min_priority, least(tn.max_priority,"
        "       j.priority)), j.order_seq, j.options, j.step_params, w.steps, s.key, j.started_at IS NOT NULL"
        "  FROM accs_job j JOIN accs_tenant tn ON tn.id = j.tenant_id"
        "  LEFT JOIN accs_workflow w ON w.id = j.workflow_id LEFT JOIN accs_service s ON s.id = j.service_id"
        " WHERE j.id = ANY(%s::uuid[]) AND j.status = 'queued' AND j.scheduled_at <= %s"
        # Nothing instantiates a job whose approval is pending or rejected, whoever calls.
        "   AND j.approval_state IN ('not_required', 'approved')"
        " ORDER BY j.order_seq",
        [[str(j) for j in job_ids], now],
    )
    rows = cur.fetchall()
    readmitted = [r[0] for r in rows if r[10]]
    jobs = [(*r[:6], from_json(r[6]), from_json(r[7]), from_json(r[8]), r[9]) for r in rows if not r[10]]
    service_keys = {key for *_, steps, key in jobs if key} | {
        step["service"] for *_, steps, _key in jobs if steps for step in steps}
    cur.execute("SELECT id, key, base_priority, max_attempts, timeout_seconds, exclusive_per_host FROM accs_service"
                " WHERE key = ANY(%s) AND is_active", [sorted(service_keys)])
    services = {r[1]: ServiceInfo(*r) for r in cur.fetchall()}
    needs_hosts = any(s.get("fan_out") == "hosts" for *_, steps, _k in jobs if steps for s in steps)
    hosts: list[HostInfo] = []
    blocked: set[tuple[int, int]] = set()
    if needs_hosts:
        hosts = read_hosts(cur)
        cur.execute("SELECT host_id, service_id FROM accs_host_block")
        blocked = {(h, s) for h, s in cur.fetchall()}
    task_rows: list[dict[str, Any]] = []
    started: list[UUID] = []
    failed: list[tuple[UUID, str, str]] = []
    for jid, tenant_id, wf_id, svc_id, prio, seq, options, step_params, steps, svc_key in jobs:
        job = JobRow(jid, tenant_id, wf_id, svc_id, prio, seq, options or {}, step_params or {})
        try:
            task_rows += build_task_rows(job, steps_for(job, steps, svc_key), services, hosts=hosts, blocked=blocked)
            started.append(jid)
        except InstantiationError as exc:
            failed.append((jid, exc.code, str(exc)))
    if task_rows:
        _insert_tasks(cur, task_rows, now=now)
    events: list[EventRow] = []
    moving = started + readmitted
    if moving:
        # A new job's current task is its first step, as the one-statement start writes it
        # (jobs.enqueue); a re-admitted job keeps its own.
        first: dict[UUID, tuple[int, str]] = {}
        for row in task_rows:
            if row["job_id"] not in first or row["position"] < first[row["job_id"]][0]:
                first[row["job_id"]] = (row["position"], row["step_key"])
        cur.execute(
            "UPDATE accs_job j SET status = 'waiting', started_at = coalesce(j.started_at, %s), updated_at = %s,"
            "       current_task_key = coalesce(m.first_key, j.current_task_key)"
            "  FROM unnest(%s::uuid[], %s::text[]) AS m(id, first_key)"
            " WHERE j.id = m.id AND j.status = 'queued' RETURNING j.id",
            [now, now, [str(j) for j in moving], [first[j][1] if j in first else None for j in moving]],
        )
        moved = {r[0] for r in cur.fetchall()}
        started = [j for j in started if j in moved]
        readmitted = [j for j in readmitted if j in moved]
        # One event per admitted job records its move and the tasks it created (events.timeline), as
        # the one-statement start in jobs.enqueue does.
        created: dict[UUID, list[dict[str, Any]]] = {j: [] for j in started}
        for row in task_rows:
            if row["job_id"] in created:
                created[row["job_id"]].append(row)
        events += [creation_event(j, created[j], source=source) for j in started]
        events += [EventRow(type="status", message="job queued → waiting (admitted again after a retry)", job_id=j,
                            source=source, data={"from": "queued", "to": "waiting"}) for j in readmitted]
    for jid, code, message in failed:
        cur.execute("UPDATE accs_job SET status = 'error', error_code = %s, error_message = %s, finished_at = %s,"
                    " updated_at = %s WHERE id = %s AND status = 'queued'", [code, message, now, now, jid])
        events.append(EventRow(type="status", message=f"job queued → error: {message}", job_id=jid, source=source,
                               level="error", data={"from": "queued", "to": "error", "error_code": code}))
        log.warning("job %s cannot be instantiated: %s", jid, message, extra={"job_id": jid})
    write_events(events, cursor=cur)
    if started:
        started_set = set(started)
        queued_services = {r["service_id"] for r in task_rows
                           if r["status"] == TaskStatus.QUEUED and r["job_id"] in started_set}
        notify(cur, [service_channel(s.key) for s in services.values() if s.id in queued_services])
        with_blocked = {r["job_id"] for r in task_rows
                        if r["status"] == TaskStatus.BLOCKED and r["job_id"] in started_set}
        finalize_jobs(cur, sorted(with_blocked, key=str), now=now, source=source)
    if readmitted:
        finalize_jobs(cur, readmitted, now=now, source=source, roots=True)
    return started + readmitted

