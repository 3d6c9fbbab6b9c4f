"""Writing what :mod:`jobs.failure.decide` decided: one batched statement per target state.

Used by the agents' reports (:mod:`jobs.reports`) and the lease rescue (:mod:`jobs.rescue`). The
caller holds the locks of the tasks' jobs, then of the tasks (:mod:`jobs.locks`), in its
transaction; every statement here names the state the task leaves and its attempt, so a row
that moved meanwhile is left alone, and every change writes its event.

A host's quarantine is the fleet's state (:mod:`nodes.quarantine` sets and clears it): the
``nodes`` app registers the function that sets it with :func:`register_host_quarantine`, and a
dead letter on a host whose service quarantines it calls that function in this transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

from accs_site.conf import accs
from events.models import EventType
from events.timeline import EventRow, write_events
from jobs.failure.decide import FAIL_JOB, Action, Decision, RetryDefaults, TaskFacts, decide
from jobs.finalize import JOB_FAILED_REASON, finished, skip_unstarted
from jobs.outcomes import Outcome, ReportResult
from jobs.pulse import RESTARTED_AT_SQL
from jobs.states import JOB_ADMITTED, sql_in

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper

log = logging.getLogger("accs.reports")


@dataclass(frozen=True)
class HostFailure:
    """A task that failed for good on a host whose service quarantines it."""

    host_id: int
    reason: str
    job_id: UUID
    task_id: UUID


# (cursor, failures, *, now, source) -> the events of the hosts it quarantined
HostQuarantine = Callable[..., list[EventRow]]
_host_quarantine: HostQuarantine | None = None


def register_host_quarantine(fn: HostQuarantine) -> None:
    """Name the function that quarantines hosts (the ``nodes`` app registers its own when it is ready)."""
    global _host_quarantine
    _host_quarantine = fn


FACTS_SQL = f"""
SELECT t.id, t.job_id, t.attempt, t.max_attempts, t.status, s.max_attempts, s.backoff_base_seconds,
       s.backoff_cap_seconds, t.host_id, s.quarantine_host_on_final_failure, t.cancel_requested_at IS NOT NULL,
       t.step_key, js.on_failure,
       -- An outage (jobs.pulse) began before the lease ended and ended after its last renewal,
       -- or PostgreSQL restarted since that renewal (a report can come before a builder stamped).
       coalesce(t.heartbeat_at < {RESTARTED_AT_SQL}, false)
           OR EXISTS (SELECT 1 FROM accs_outage o WHERE o.ended_at > t.heartbeat_at
                         AND o.began_at <= t.lease_expires_at),
       -- The task's earlier interrupted attempts: the bound of refunds counts them (task_id, attempt_no index).
       (SELECT count(*) FROM accs_attempt a WHERE a.task_id = t.id AND a.attempt_no < t.attempt
           AND a.status = 'interrupted')
  FROM accs_task t JOIN accs_service s ON s.id = t.service_id
  LEFT JOIN accs_job_step js ON js.job_id = t.job_id AND js.step_key = t.step_key
 WHERE t.id = ANY(%s) AND t.status = ANY(%s)
 ORDER BY t.id
"""


def load_facts(cur: CursorWrapper, outcomes: Sequence[Outcome], *,
               from_statuses: Sequence[str] = ("starting", "running")) -> list[tuple[TaskFacts, Outcome]]:
    """Read what the decision needs about the tasks of ``outcomes`` (those still in ``from_statuses``)."""
    by_id = {o.task_id: o for o in outcomes}
    cur.execute(FACTS_SQL, [list(by_id), list(from_statuses)])
    return [(TaskFacts(task_id=r[0], job_id=r[1], attempt=r[2], max_attempts=r[3], status=r[4], budget=r[5],
                       backoff_base=r[6], backoff_cap=r[7], host_id=r[8], quarantine_on_final_failure=r[9],
                       cancel_requested=r[10], step_key=r[11], on_failure=r[12], held_across_restart=r[13],
                       interrupted_before=r[14]),
             by_id[r[0]])
            for r in cur.fetchall()]


def record_failures(cur: CursorWrapper, outcomes: Sequence[Outcome], result: ReportResult, *, now: datetime,
                    source: str, from_statuses: Sequence[str] = ("starting", "running")) -> set[UUID]:
    """Decide and apply badly ended attempts (the caller holds the locks); return the jobs touched.

    An outcome whose attempt is no longer the task's current one changes nothing here: the
    caller records it as fenced.
    """
    decisions = decide(load_facts(cur, outcomes, from_statuses=from_statuses), now=now,
                       defaults=RetryDefaults(base=accs.backoff_base_sec, cap=accs.backoff_cap_sec,
                                              max_refunded=accs.max_refunded_attempts))
    return apply(cur, decisions, result, now=now, source=source)


END_ATTEMPTS_SQL = """
UPDATE accs_attempt a SET status = v.status, finished_at = %(now)s, exit_code = v.code, stdout_tail = v.out,
       stderr_tail = v.err, error_text = v.error
  FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(statuses)s::text[], %(codes)s::int[], %(outs)s::text[],
              %(errs)s::text[], %(errors)s::text[]) AS v(id, attempt, status, code, out, err, error)
 WHERE a.task_id = v.id AND a.attempt_no = v.attempt AND a.status = 'running'
"""

# Back to the queue: a retry (queued, or scheduled until its backoff is over) or an interrupted
# attempt (queued at once, and max_attempts grows by one so it does not use up the budget).
REQUEUE_SQL = """
UPDATE accs_task t SET status = %(to)s, next_attempt_at = v.next_at, updated_at = %(now)s, error_code = v.code,
       error_message = v.message, claimed_by = '', lease_expires_at = NULL, progress = NULL,
       max_attempts = t.max_attempts + v.refund
  FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(froms)s::text[], %(next_at)s::timestamptz[], %(codes)s::text[],
              %(messages)s::text[], %(refunds)s::int[]) AS v(id, attempt, was, next_at, code, message, refund)
 WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = v.was
RETURNING t.id
"""

# A final state: canceled, or error (a dead letter).
END_SQL = """
UPDATE accs_task t SET status = %(to)s, finished_at = %(now)s, updated_at = %(now)s, error_code = v.code,
       error_message = v.message
  FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(froms)s::text[], %(codes)s::text[], %(messages)s::text[])
       AS v(id, attempt, was, code, message)
 WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = v.was
RETURNING t.id
"""

TARGETS = ("canceled", "queued", "scheduled", "error")


def apply(cur: CursorWrapper, decisions: Sequence[Decision], result: ReportResult, *, now: datetime,
          source: str) -> set[UUID]:
    """Write ``decisions``: attempts ended, then one statement per target state; return the jobs touched."""
    if not decisions:
        return set()
    _end_attempts(cur, decisions, now=now)
    moved: set[UUID] = set()
    for to in TARGETS:
        group = [d for d in decisions if d.to == to]
        if group:
            moved |= _move(cur, group, to=to, now=now)
    done = [d for d in decisions if d.task_id in moved]
    for d in done:
        {Action.CANCEL: result.canceled, Action.REQUEUE: result.retried, Action.RETRY: result.retried,
         Action.DEAD_LETTER: result.failed}[d.action].append(d.task_id)
    events = [_task_event(d, source=source) for d in done]
    events += _quarantine(cur, [d for d in done if d.quarantine_host], now=now, source=source)
    failed_jobs: set[UUID] = set()
    for d in done:
        if d.continue_policy:
            # Its dependents are skipped and the job ends partial once the rest is final (jobs.finalize).
            events.append(EventRow(
                type=EventType.POLICY, level="warn", job_id=d.facts.job_id, task_id=d.task_id, source=source,
                message=f"step {d.facts.step_key} failed for good; on_failure continue: its dependents are skipped,"
                        " independent steps go on",
                data={"step": d.facts.step_key, "on_failure": d.facts.on_failure},
            ))
        elif d.fail_job and d.facts.job_id not in failed_jobs:
            failed_jobs.add(d.facts.job_id)
            events += fail_job(cur, d.facts.job_id, reason=f"task {d.task_id} failed: {d.error[:500]}", now=now,
                               source=source)
    write_events(events, cursor=cur)
    return {d.facts.job_id for d in done}


def _end_attempts(cur: CursorWrapper, decisions: Sequence[Decision], *, now: datetime) -> None:
    o = [d.outcome for d in decisions]
    cur.execute(END_ATTEMPTS_SQL, {
        "ids": [d.task_id for d in decisions], "attempts": [d.facts.attempt for d in decisions],
        "statuses": [d.attempt_status for d in decisions], "codes": [x.exit_code for x in o],
        "outs": [x.stdout_tail for x in o], "errs": [x.stderr_tail for x in o],
        "errors": [d.error for d in decisions], "now": now,
    })


def _move(cur: CursorWrapper, group: Sequence[Decision], *, to: str, now: datetime) -> set[UUID]:
    """Move one target state's tasks in one statement; return the ids moved."""
    params: dict[str, Any] = {
        "to": to, "now": now, "ids": [d.task_id for d in group], "attempts": [d.facts.attempt for d in group],
        "froms": [d.facts.status for d in group], "codes": [d.error_code for d in group],
        "messages": [d.error[:2000] for d in group]}
    if to in ("queued", "scheduled"):
        cur.execute(REQUEUE_SQL, {**params, "next_at": [d.next_attempt_at for d in group],
                                  "refunds": [int(d.refund) for d in group]})
    else:
        cur.execute(END_SQL, params)
    return {r[0] for r in cur.fetchall()}


def _task_event(d: Decision, *, source: str) -> EventRow:
    f, was = d.facts, d.facts.status
    common: dict[str, Any] = {"job_id": f.job_id, "task_id": f.task_id, "attempt": f.attempt, "source": source}
    if d.action is Action.CANCEL:
        return EventRow(type="status", message=f"task {was} → canceled", level="warn", **common,
                        data={"from": was, "to": "canceled"})
    if d.action is Action.REQUEUE:
        return EventRow(type="retry", level="warn", **common,
                        message=f"task {was} → queued: attempt {f.attempt} {d.why}; it does not count",
                        data={"from": was, "to": "queued", "error": d.error[:500], "delay_seconds": 0,
                              "reason": d.error_code, "counted": False})
    words, counted = _counted_interruption(d)
    if d.action is Action.RETRY:
        return EventRow(type="retry", level="warn", **common,
                        message=f"task {was} → {d.to}: attempt {f.attempt}/{f.max_attempts} {d.attempt_status},"
                                f" retry in {d.delay:.1f}s{words}",
                        data={"from": was, "to": d.to, "error": d.error[:500], "delay_seconds": round(d.delay, 3),
                              "next_attempt_at": d.next_attempt_at.isoformat() if d.next_attempt_at else None,
                              **counted})
    return EventRow(type="status", level="error", **common,
                    message=f"task {was} → error (final after {f.attempt}/{f.max_attempts} attempts{words}):"
                            f" {d.error[:200]}",
                    data={"from": was, "to": "error", "dead_letter": True, "error": d.error[:500],
                          "error_code": d.error_code, **counted})


def _counted_interruption(d: Decision) -> tuple[str, dict[str, Any]]:
    """Words and event data saying that an interrupted attempt counted, past the bound of refunds."""
    if not d.counted_interruption:
        return "", {}
    n = d.facts.interrupted_before
    return (f"; {d.why}, it counts: {n} interrupted attempt(s) of this task were not counted already",
            {"reason": d.error_code, "counted": True, "refunded_before": n})


def _quarantine(cur: CursorWrapper, decisions: Sequence[Decision], *, now: datetime, source: str) -> list[EventRow]:
    if not decisions:
        return []
    if _host_quarantine is None:
        log.warning("no host quarantine is registered (is the nodes app installed?): %d host(s) stay eligible",
                    len(decisions))
        return []
    failures = [HostFailure(host_id=d.facts.host_id, reason=f"task {d.task_id} failed for good: {d.error[:200]}",
                            job_id=d.facts.job_id, task_id=d.task_id) for d in decisions if d.facts.host_id]
    return _host_quarantine(cur, failures, now=now, source=source)


FAIL_JOB_SQL = f"""
-- The job fails now, unless a task of an "always" step is not final yet: it then ends "error"
-- (jobs.finalize) once those have run.
UPDATE accs_job j SET status = 'error', error_code = 'task_failed', error_message = %(reason)s,
       finished_at = %(now)s, updated_at = %(now)s
 WHERE j.id = %(job)s AND j.status = %(was)s
   AND NOT EXISTS (SELECT 1 FROM accs_job_step a WHERE a.job_id = j.id AND a.always AND {finished("a")} < a.total)
RETURNING j.id
"""


def fail_job(cur: CursorWrapper, job_id: UUID, *, reason: str, now: datetime, source: str) -> list[EventRow]:
    """Fail a (locked) admitted job after a task of a ``fail_job`` step failed for good; return the events.

    Its unstarted tasks are skipped, except those of ``always`` steps, which still run.
    """
    cur.execute(f"SELECT status FROM accs_job WHERE id = %s AND status IN {sql_in(JOB_ADMITTED)}", [job_id])
    row = cur.fetchone()
    if not row:
        return []
    was = row[0]
    skipped = skip_unstarted(cur, [job_id], now=now, source=source, reason=JOB_FAILED_REASON, keep_always=True)
    cur.execute(FAIL_JOB_SQL, {"job": job_id, "was": was, "reason": reason, "now": now})
    if cur.fetchone():
        return [EventRow(type="status", level="error", job_id=job_id, source=source, message=f"job {was} → error",
                         data={"from": was, "to": "error"}), *skipped]
    return [EventRow(type=EventType.POLICY, level="error", job_id=job_id, source=source,
                     message="job fails (on_failure fail_job); its always-run steps run before it ends error",
                     data={"on_failure": FAIL_JOB, "reason": reason}), *skipped]
