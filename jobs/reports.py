"""The agents' side of a task's life: start, heartbeat, progress, outcome.

Every function here is fenced by the attempt number: a report from an attempt that is no longer
current changes nothing and is recorded as a ``fenced`` event. Times come from PostgreSQL's
clock (:func:`accs_site.clock.db_now`), never from the agent's. What a failed attempt does to
its task is decided by :mod:`jobs.failure.decide` and written by :mod:`jobs.failure.apply`; the
lease rescue, which reuses both, is :mod:`jobs.rescue`. Locks follow :mod:`jobs.locks`: the
jobs of the reported tasks, then the tasks, each sorted by id.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from accs_site.clock import db_now
from events.timeline import BUILDER, EventRow, write_events
from jobs.failure.apply import record_failures
from jobs.finalize import FINALIZE_FUNCTION, RESERVE_EVENT_ID, WRITE_MOVES_ALONE_SQL, finalize_jobs, write_moves
from jobs.locks import KEY_COUNTS_LOCK_SQL, lock_jobs_of_tasks, lock_key_counts, lock_tasks
from jobs.notify import notify, service_channel
from jobs.outcomes import Outcome, ReportResult, attempt_ending
from jobs.sql import bind_params

__all__ = ["Outcome", "ReportResult", "heartbeat", "mark_running", "promote_scheduled", "promote_scheduled_in",
           "report", "report_progress"]

log = logging.getLogger("accs.reports")



# The statements below hand their moves over to be written together, a row per task with its job's
# moves folded in (jobs.finalize.WRITE_MOVES_SQL), rather than writing a row per move: each returns
# its moves as JSON objects of that shape.

#: A task's move to running, with the agent's process id of the attempt where it is known (the row "run" of a
#: statement).
TASK_STARTED_MOVE = (f"jsonb_build_object('id', {RESERVE_EVENT_ID}, 'job_id', job_id, 'task_id', id,"
                     " 'attempt', attempt,"
                     " 'data', jsonb_strip_nulls(jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid)))")

MARK_RUNNING_SQL = f"""
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(pids)s::int[]) AS v(id, attempt, pid)),
run AS (
    UPDATE accs_task t SET status = 'running', started_at = %(now)s, updated_at = %(now)s
      FROM v WHERE t.id = ANY(%(ids)s::uuid[]) AND t.id = v.id AND t.attempt = v.attempt AND t.status = 'starting'
       AND t.claimed_by = %(agent)s
    RETURNING t.id, t.job_id, t.attempt, v.pid
),
att AS (
    UPDATE accs_attempt a SET pid = run.pid FROM run WHERE a.task_id = run.id AND a.attempt_no = run.attempt
)
SELECT id, {TASK_STARTED_MOVE} FROM run ORDER BY id
"""

#: A job's move from waiting to running (the row "up" of JOBS_RUNNING_SQL).
JOB_STARTED_MOVE = "jsonb_build_object('job_id', id, 'move', jsonb_build_object('from', 'waiting', 'to', 'running'))"

JOBS_RUNNING_SQL = f"""
-- A job is running while a task of it is starting or running: the first start moves it from
-- waiting. Run just before the tasks' own start (same transaction, same fencing), so the timeline
-- reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS v(id, attempt)),
up AS (
    -- By the ids of the reported tasks' jobs, and their status read after them (OFFSET 0): with
    -- "id IN (...)", or the status beside the ids, a generic plan made from statistics that said few jobs
    -- wait (a burst that had ended) walked every waiting job instead, at every report. The caller holds
    -- the jobs' locks, so the status read is the one updated.
    UPDATE accs_job SET status = 'running', updated_at = %(now)s
     WHERE id = ANY(ARRAY(SELECT j.id
                            FROM (SELECT j.id, j.status FROM accs_job j
                                   WHERE j.id = ANY(ARRAY(SELECT t.job_id FROM accs_task t
                                                            JOIN v ON v.id = t.id AND v.attempt = t.attempt
                                                           WHERE t.id = ANY(%(ids)s::uuid[])
                                                             AND t.status = 'starting' AND t.claimed_by = %(agent)s))
                                  OFFSET 0) j
                           WHERE j.status = 'waiting'))
    RETURNING id
)
SELECT {JOB_STARTED_MOVE} FROM up
"""


@dataclass
class Moves:
    """The moves a report made and has not written yet, each a JSON object's text (see jobs.finalize)."""

    tasks: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)


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
        now = now or db_now(cur)
        moves = Moves()
        started = _mark_running(cur, items, agent_id=agent_id, now=now, moves=moves)
        write_moves(cur, moves.tasks, moves.jobs, now=now, source=source)
        return started


def _mark_running(cur, items, *, agent_id: str, now: datetime, moves: Moves) -> set[UUID]:
    """Move tasks to running, adding their moves to ``moves``; the caller holds the locks of their jobs, then
    of the tasks."""
    _jobs_running(cur, items, agent_id=agent_id, now=now, moves=moves)
    cur.execute(MARK_RUNNING_SQL, {"ids": [i[0] for i in items], "attempts": [i[1] for i in items],
                                   "pids": [i[2] for i in items], "now": now, "agent": agent_id})
    rows = cur.fetchall()
    moves.tasks += [move for _, move in rows]
    return {r[0] for r in rows}


def _jobs_running(cur, items, *, agent_id: str, now: datetime, moves: Moves) -> None:
    """Move the waiting jobs of starting tasks (``items`` start with task_id, attempt) to running."""
    cur.execute(JOBS_RUNNING_SQL, {"ids": [i[0] for i in items], "attempts": [i[1] for i in items],
                                   "now": now, "agent": agent_id})
    moves.jobs += [r[0] for r in cur.fetchall()]


#: A task's move to done (the row "done" of COMPLETE_SQL): through running when its start is in the same report.
TASK_DONE_MOVE = f"""jsonb_build_object('id', {RESERVE_EVENT_ID}, 'job_id', job_id, 'task_id', id, 'attempt', attempt,
           'data',
           CASE WHEN was = 'starting'
                THEN jsonb_strip_nulls(jsonb_build_object('from', 'starting', 'via', jsonb_build_array('running'),
                                                          'to', 'done', 'pid', pid))
                ELSE jsonb_build_object('from', 'running', 'to', 'done') END)"""

COMPLETE_SQL = f"""
-- Fenced by attempt: a report from an attempt that is no longer current changes nothing.
-- %(from_status)s is 'running', or 'starting' when the agent reports an attempt's start and end
-- together: the task then goes starting → done in one UPDATE, its move through running on the
-- timeline (the intermediate row version would be visible to no other transaction anyway). A task
-- the report finds already running (an earlier report of its start committed but its answer was
-- lost) goes running → done. "was" is the row as the statement found it.
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(results)s::text[], %(codes)s::int[],
                                %(outs)s::text[], %(errs)s::text[], %(pids)s::int[])
                  AS v(id, attempt, results, code, out, err, pid)),
done AS (
    UPDATE accs_task t SET status = 'done', results = v.results::jsonb, progress = 1, finished_at = %(now)s,
           started_at = coalesce(t.started_at, %(now)s), updated_at = %(now)s
      FROM v JOIN accs_task was ON was.id = v.id
     -- (By primary key, as the claim's update: a join alone let a generic plan made while the table was
     -- small merge the reported tasks with the whole primary key.)
     WHERE t.id = ANY(%(ids)s::uuid[]) AND was.id = ANY(%(ids)s::uuid[])
       AND t.id = v.id AND t.attempt = v.attempt AND t.status IN (%(from_status)s, 'running')
    RETURNING t.id, t.job_id, t.attempt, v.code, v.out, v.err, v.pid, was.status AS was
),
att AS (
    UPDATE accs_attempt a SET status = 'succeeded', finished_at = %(now)s, exit_code = done.code,
           stdout_tail = done.out, stderr_tail = done.err, pid = coalesce(done.pid, a.pid)
      FROM done WHERE a.task_id = done.id AND a.attempt_no = done.attempt
)
SELECT id, job_id, {TASK_DONE_MOVE} FROM done ORDER BY id
"""


# The report of attempts that succeeded (with the starts reported beside them), as one server-side
# function (migration 0020): the locks, the jobs' and tasks' transitions, their events and the jobs'
# finalisation (finalize_jobs' function) in one round trip, each statement planned once per server
# connection. It runs the statements above in report()'s order, their parameters bound to its
# variables; a test compares the database's function with report_function_sql(). Failed,
# interrupted and canceled attempts take report()'s general path (their failure policy is decided in
# Python, jobs.failure.decide).
REPORT_FUNCTION = "accs_report_succeeded"

_REPORT_PARAMS = {"ids": "v_ids", "attempts": "v_attempts", "results": "v_results", "codes": "v_codes",
                  "outs": "v_outs", "errs": "v_errs", "pids": "v_pids", "now": "v_now", "source": "p_source",
                  "agent": "p_agent", "from_status": "v_from", "moves": "v_moves", "job_moves": "v_job_moves"}


def _bind_report(sql: str) -> str:
    return bind_params(sql, _REPORT_PARAMS).strip()


def _select_into(sql: str, last: str, into: str) -> str:
    if not sql.endswith(last):
        raise AssertionError(f"the statement no longer ends with {last!r}: update report_function_sql")
    return sql[: -len(last)] + into


def report_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`REPORT_FUNCTION`, built from the statements above."""
    jobs_running = _select_into(_bind_report(JOBS_RUNNING_SQL), f"SELECT {JOB_STARTED_MOVE} FROM up",
                                f"SELECT v_job_moves || coalesce(jsonb_agg({JOB_STARTED_MOVE}), '[]')"
                                " INTO v_job_moves FROM up")
    # The moves in the order of the tasks' ids, each row's id taken in that order (the sorted subquery's
    # output is computed after its sort).
    mark = _select_into(_bind_report(MARK_RUNNING_SQL), f"SELECT id, {TASK_STARTED_MOVE} FROM run ORDER BY id",
                        "SELECT v_moves || coalesce(jsonb_agg(x.move), '[]') INTO v_moves"
                        f" FROM (SELECT {TASK_STARTED_MOVE} AS move FROM run ORDER BY id) x")
    complete = _select_into(_bind_report(COMPLETE_SQL), f"SELECT id, job_id, {TASK_DONE_MOVE} FROM done ORDER BY id",
                            "SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.job_id), '{}'),"
                            " v_moves || coalesce(jsonb_agg(x.move), '[]') INTO v_done, v_jobs, v_moves"
                            f" FROM (SELECT id, job_id, {TASK_DONE_MOVE} AS move FROM done ORDER BY id) x")
    write_alone = bind_params(WRITE_MOVES_ALONE_SQL, _REPORT_PARAMS).strip()
    return f"""CREATE OR REPLACE FUNCTION {REPORT_FUNCTION}(
    p_start_ids uuid[], p_start_attempts int[], p_start_pids int[],
    p_ids uuid[], p_attempts int[], p_results text[], p_codes int[], p_outs text[], p_errs text[], p_pids int[],
    p_started bool[], p_agent text, p_source text, p_now timestamptz)
RETURNS TABLE (kind text, value text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
-- No sequential scans: every statement reads rows by the ids it was given (jobs, tasks, their steps), but a
-- plan made while a table was small (a connection's first call after a burst had ended) joined them by
-- reading the whole table, and kept doing so as the table grew, for as long as the connection lived.
SET enable_seqscan = off
AS $report$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_from text;
    v_ids uuid[];
    v_attempts int[];
    v_results text[];
    v_codes int[];
    v_outs text[];
    v_errs text[];
    v_pids int[];
    v_done uuid[];
    v_jobs uuid[];
    v_all_done uuid[] := '{{}}';
    v_all_jobs uuid[] := '{{}}';
    v_moves jsonb := '[]';
    v_job_moves jsonb := '[]';
BEGIN
    -- The lock order (jobs.locks): the jobs of the reported tasks, then the tasks, each sorted by id.
    -- (Each statement reads its rows by their ids, "= ANY(ARRAY(...))": a join or "IN (...)" let a plan made
    -- while the table was small read the whole primary key instead, at every report.)
    PERFORM 1 FROM accs_job
     WHERE id = ANY(ARRAY(SELECT t.job_id FROM accs_task t WHERE t.id = ANY(p_ids || p_start_ids)))
     ORDER BY id FOR NO KEY UPDATE;
    PERFORM 1 FROM accs_task WHERE id = ANY(p_ids || p_start_ids) ORDER BY id FOR UPDATE;
    -- Then the held counts of their keys, sorted: up to two statements below end tasks.
    PERFORM {KEY_COUNTS_LOCK_SQL.format(ids="p_ids")};
    -- Starts of attempts still running (mark_running).
    IF cardinality(p_start_ids) > 0 THEN
        v_ids := p_start_ids;
        v_attempts := p_start_attempts;
        v_pids := p_start_pids;
        {jobs_running};
        {mark};
    END IF;
    -- Successes whose start is in this report go starting → done, the others running → done.
    FOREACH v_from IN ARRAY ARRAY['starting', 'running'] LOOP
        SELECT array_agg(v.id), array_agg(v.attempt), array_agg(v.results), array_agg(v.code), array_agg(v.out),
               array_agg(v.err), array_agg(v.pid)
          INTO v_ids, v_attempts, v_results, v_codes, v_outs, v_errs, v_pids
          FROM unnest(p_ids, p_attempts, p_results, p_codes, p_outs, p_errs, p_pids, p_started)
               AS v(id, attempt, results, code, out, err, pid, started)
         WHERE v.started = (v_from = 'starting');
        CONTINUE WHEN v_ids IS NULL;
        IF v_from = 'starting' THEN
            {jobs_running};
        END IF;
        {complete};
        v_all_done := v_all_done || v_done;
        v_all_jobs := v_all_jobs || v_jobs;
    END LOOP;
    RETURN QUERY SELECT 'done', d::text FROM unnest(v_all_done) AS d;
    -- The jobs are finalized and every move of the report written, a row per task (jobs.finalize).
    IF cardinality(v_all_jobs) > 0 THEN
        RETURN QUERY SELECT 'notify', k FROM {FINALIZE_FUNCTION}(
            ARRAY(SELECT DISTINCT j FROM unnest(v_all_jobs) AS j ORDER BY 1), v_now, p_source, false, v_moves,
            v_job_moves) AS k;
    ELSE
        {write_alone};
    END IF;
END
$report$"""


def report(outcomes: Sequence[Outcome], *, source: str, started: Sequence[tuple[UUID, int, int | None]] = (),
           agent_id: str = "", now: datetime | None = None) -> ReportResult:
    """Record how attempts ended, in one transaction: done, retry with backoff, final error, canceled.

    ``started`` optionally moves tasks to running first (in the same transaction), so an agent
    reports a short task's start and end together.
    """
    if all(o.status == "succeeded" for o in outcomes):
        return _report_succeeded(outcomes, source=source, started=started, agent_id=agent_id, now=now)
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
        lock_key_counts(cur, [o.task_id for o in outcomes])
        now = now or db_now(cur)
        moves = Moves()
        if to_mark:
            _mark_running(cur, to_mark, agent_id=agent_id, now=now, moves=moves)
        touched_jobs: set[UUID] = set()
        for group, from_status in ((ok_with_start, "starting"), (ok_running, "running")):
            if not group:
                continue
            if from_status == "starting":
                _jobs_running(cur, [(o.task_id, o.attempt) for o in group], agent_id=agent_id, now=now, moves=moves)
            cur.execute(COMPLETE_SQL, {
                "ids": [o.task_id for o in group], "attempts": [o.attempt for o in group],
                "results": [json.dumps(o.results if o.results is not None else {}, default=str) for o in group],
                "codes": [o.exit_code for o in group], "outs": [o.stdout_tail for o in group],
                "errs": [o.stderr_tail for o in group],
                "pids": [started_pid.get((o.task_id, o.attempt)) for o in group],
                "now": now, "from_status": from_status,
            })
            for tid, jid, move in cur.fetchall():
                result.done.append(tid)
                touched_jobs.add(jid)
                moves.tasks.append(move)
        bad = [o for o in outcomes if o.status != "succeeded"]
        if bad:
            touched_jobs |= record_failures(cur, bad, result, now=now, source=source)
        accepted = set(result.done) | set(result.retried) | set(result.failed) | set(result.canceled)
        rejected = [o for o in outcomes if o.task_id not in accepted]
        if rejected:
            _sort_rejected(cur, rejected, result, source=source)
        # The jobs are finalized and the moves above written with theirs, a row per task (jobs.finalize).
        finalize_jobs(cur, sorted(touched_jobs, key=str), now=now, source=source, moves=moves.tasks,
                      job_moves=moves.jobs)
    return result


REPORT_CALL = f"""
SELECT * FROM {REPORT_FUNCTION}(%(start_ids)s::uuid[], %(start_attempts)s::int[], %(start_pids)s::int[],
    %(ids)s::uuid[], %(attempts)s::int[], %(results)s::text[], %(codes)s::int[], %(outs)s::text[], %(errs)s::text[],
    %(pids)s::int[], %(started)s::bool[], %(agent)s, %(source)s, %(now)s::timestamptz)
"""


def _report_succeeded(outcomes: Sequence[Outcome], *, source: str, started: Sequence[tuple[UUID, int, int | None]],
                      agent_id: str, now: datetime | None) -> ReportResult:
    """Report successes (and starts) with one call of the report function; see :func:`report`.

    Outside a transaction the call is its own, committed by the server: one round trip. Reports
    it refuses (fenced, or repeats of a report whose answer was lost) are sorted out afterwards.
    """
    result = ReportResult()
    started_pid = {(tid, att): pid for tid, att, pid in started}
    reported = {(o.task_id, o.attempt) for o in outcomes}
    only_started = [s for s in started if (s[0], s[1]) not in reported]
    with connection.cursor() as cur:
        cur.execute(REPORT_CALL, {
            "start_ids": [s[0] for s in only_started], "start_attempts": [s[1] for s in only_started],
            "start_pids": [s[2] for s in only_started],
            "ids": [o.task_id for o in outcomes], "attempts": [o.attempt for o in outcomes],
            "results": [json.dumps(o.results if o.results is not None else {}, default=str) for o in outcomes],
            "codes": [o.exit_code for o in outcomes], "outs": [o.stdout_tail for o in outcomes],
            "errs": [o.stderr_tail for o in outcomes],
            "pids": [started_pid.get((o.task_id, o.attempt)) for o in outcomes],
            "started": [(o.task_id, o.attempt) in started_pid for o in outcomes],
            "agent": agent_id, "source": source, "now": now})
        rows = cur.fetchall()
        result.done = [UUID(value) for kind, value in rows if kind == "done"]
        notify(cur, [service_channel(value) for kind, value in rows if kind == "notify"])
    done = set(result.done)
    rejected = [o for o in outcomes if o.task_id not in done]
    if rejected:
        with transaction.atomic(savepoint=False), connection.cursor() as cur:
            _sort_rejected(cur, rejected, result, source=source)
    return result


def _sort_rejected(cur, rejected: Sequence[Outcome], result: ReportResult, *, source: str) -> None:
    """Tell the reports the database refused into repeats (already recorded) and fenced ones (recorded now)."""
    recorded = _already_recorded(cur, rejected)
    result.repeated = [o.task_id for o in rejected if o.task_id in recorded]
    fenced = [o for o in rejected if o.task_id not in recorded]
    if fenced:
        result.fenced = [o.task_id for o in fenced]
        _record_fenced(cur, fenced, source=source)


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
        status, text = attempt_ending(o)
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


# --------------------------------------------------------------------------------------------
# Leases
# --------------------------------------------------------------------------------------------

HEARTBEAT_SQL = """
-- Locks taken in id order (see jobs.locks); the lease is measured on PostgreSQL's clock. Each
-- task is renewed for the lease it was granted (its service's, or the agent's).
WITH v AS (SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::int[], %(leases)s::float8[]) AS v(id, attempt, lease)),
l AS (
    SELECT t.id, v.lease FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
     WHERE t.status IN ('starting', 'running') AND t.claimed_by = %(agent)s
     ORDER BY t.id FOR UPDATE OF t
)
UPDATE accs_task t SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => l.lease),
       heartbeat_at = coalesce(%(now)s::timestamptz, now())
  FROM l WHERE t.id = l.id
RETURNING t.id, t.attempt, t.cancel_requested_at IS NOT NULL
"""


def heartbeat(held: Sequence[tuple[UUID, int]], *, agent_id: str,
              lease_seconds: float | Mapping[tuple[UUID, int], float],
              now: datetime | None = None, cursor: Any = None) -> tuple[set[tuple[UUID, int]], set[tuple[UUID, int]]]:
    """Extend the leases of (task, attempt) pairs this agent holds. Return (lost, cancel_requested).

    ``lease_seconds`` is one length for all, or each pair's own (the lease its claim granted).
    ``lost`` are attempts no longer held (rescued or canceled): the agent must stop them.
    ``cancel_requested`` are attempts an operator asked to cancel. Both hold (task_id, attempt)
    pairs, so an old attempt's answer never touches a newer one.

    ``cursor``: run on this cursor, in its caller's transaction (the agent's lease renewal has a
    connection of its own); otherwise in a transaction on Django's connection.
    """
    if not held:
        return set(), set()
    if cursor is None:
        with transaction.atomic(savepoint=False), connection.cursor() as cur:
            return heartbeat(held, agent_id=agent_id, lease_seconds=lease_seconds, now=now, cursor=cur)
    leases = [float(lease_seconds[(h[0], h[1])] if isinstance(lease_seconds, Mapping) else lease_seconds)
              for h in held]
    cursor.execute(HEARTBEAT_SQL, {"ids": [h[0] for h in held], "attempts": [h[1] for h in held],
                                   "leases": leases, "now": now, "agent": agent_id})
    rows = cursor.fetchall()
    kept = {(r[0], r[1]) for r in rows}
    return {(h[0], h[1]) for h in held} - kept, {(r[0], r[1]) for r in rows if r[2]}


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


# Retries whose backoff is over become claimable (scheduled → queued), oldest due first, each
# with its event; ``up`` returns the promoted tasks. Served by task_scheduled_idx; SKIP LOCKED lets
# concurrent promoters share the work. The builder's duty runs it below; the claim function
# (jobs.claim.plain_claim_function_sql) runs the same text with its own variables bound.
PROMOTE_DUE_SQL = """WITH due AS (
    SELECT id FROM accs_task
     WHERE status = 'scheduled' AND next_attempt_at <= coalesce(%(now)s::timestamptz, now())
       AND (%(services)s::bigint[] IS NULL
            OR service_id = ANY(%(services)s::bigint[]))
     ORDER BY next_attempt_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), up AS (
    -- (By primary key: joined to due, a plan made while the table was nearly empty read all of it.)
    UPDATE accs_task t SET status = 'queued', updated_at = now() WHERE t.id = ANY(ARRAY(SELECT id FROM due))
    RETURNING t.id, t.job_id, t.attempt, t.service_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, attempt, source, level, type, message, data)
    SELECT job_id, id, attempt, %(source)s, 'info', 'status', 'task scheduled → queued (backoff over)',
           '{"from": "scheduled", "to": "queued"}'::jsonb FROM up
)"""

PROMOTE_SCHEDULED_SQL = f"""
{PROMOTE_DUE_SQL}
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


def __getattr__(name: str):
    """Keep ``jobs.reports.rescue_expired`` working for one release (it moved to :mod:`jobs.rescue`)."""
    if name == "rescue_expired":
        import warnings

        # Imported here, not at the top: jobs.rescue builds on what this module's callers use, and
        # only a site naming the old path should load it through here.
        from jobs.rescue import rescue_expired

        warnings.warn("jobs.reports.rescue_expired moved to jobs.rescue.rescue_expired (also jobs.transitions);"
                      " the old name is removed in ACCS 0.3.0", DeprecationWarning, stacklevel=2)
        return rescue_expired
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
