"""Narrow starts: a one-task job written as one row, widened into its job when it is taken.

``enqueue`` writes a start that needs nothing decided before it runs as one row of ``accs_start``
(:class:`jobs.models.Start`): no job, task, step or event row, two index entries. Such a start is a
job of one service, due now, with no idempotency key (``external_id``, ``dedupe_key``), no approval,
no options, no tenant cap, and a service without a rate or per-key limit; the site turns the path on
with ``ACC_NARROW_STARTS``. Every other start takes the wide path (:data:`jobs.enqueue.START_NOW_SQL`
or the builder's admission).

A start is *widened* by one statement (:data:`WIDEN_SQL`): the start row is deleted and its job
(``waiting``), task (``queued``), step and creation event are written, with the job id, task id,
priority, place in the global order and creation time the start was given, so nothing the start
promised changes. Three callers widen, each under the start rows' locks:

* the claim (``accs_claim_plain``): before it looks for work, the head of each service's queue, per
  tenant, as many starts as the agent has free slots, so the claim takes narrow and wide work in
  the one global order;
* the builder (:mod:`jobs.duties.narrow`): every start older than ``ACC_NARROW_WIDEN_AFTER_SEC``,
  so a start no agent takes soon (its service's agents are busy, or none runs) still becomes a job
  that every list and count shows;
* a read by id (:func:`widen`): the API's and the Tasks backend's read of one job, the job page and
  the operators' verbs, so a job just started is found as a queued job.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from uuid import UUID

from django.db import connection

WIDEN_FUNCTION = "accs_widen_starts"

# The job row of a widened start: the columns of every job insert (jobs.enqueue.JOB_COLUMNS), read
# from the start and its service.
_JOB_FIELD_SQL = {
    "id": "g.id", "tenant": "g.tenant_id", "wf": "NULL::uuid", "svc": "g.service_id", "prio": "g.job_priority",
    "opts": "'{}'::jsonb", "sp": "jsonb_build_object(g.svc_key, g.params)", "sched": "g.created_at",
    "src": "g.source", "sref": "g.source_ref", "ext": "NULL::text", "dk": "NULL::text", "corr": "g.correlation_id",
    "appr": "'not_required'", "cby": "g.created_by_id", "barred": "NULL::int[]",
}


def widen_sql() -> str:
    """Return the statement that widens the starts in ``v_ids``, which the statement before it locked.

    What each start becomes is what jobs.enqueue's one-statement start writes for a one-task service
    job: the job already admitted (waiting, its task named current), its task queued with the
    service's attempts, timeout and exclusivity as they are now, its one step row, and its compact
    creation event (stamped at the start's creation, as the job and task are).
    """
    # Imported here: jobs.enqueue writes narrow starts, and the lock helpers every verb uses widen
    # them (jobs.locks imports this module), so this module imports nothing of the engine at load.
    from jobs.enqueue import insert_job_sql

    return """WITH gone AS (
    DELETE FROM accs_start s WHERE s.id = ANY(v_ids)
    RETURNING s.id, s.task_id, s.tenant_id, s.service_id, s.priority, s.job_priority, s.order_seq, s.params,
              s.source, s.source_ref, s.correlation_id, s.created_by_id, s.created_at
), g AS (
    SELECT gone.*, sv.key::text AS svc_key, sv.exclusive_per_host, sv.max_attempts, sv.timeout_seconds
      FROM gone JOIN accs_service sv ON sv.id = gone.service_id
), j AS (
""" + insert_job_sql(lambda name: _JOB_FIELD_SQL[name], order_seq="g.order_seq", status="'waiting'",
                     current_task_key="g.svc_key", started_at="g.created_at", created_at="g.created_at") + """
      FROM g
    RETURNING id
), t AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT g.task_id, j.id, g.tenant_id, g.svc_key, g.svc_key, g.service_id, NULL, g.exclusive_per_host, 'queued',
           '{}', 0, g.max_attempts, g.created_at, g.priority, g.order_seq, g.timeout_seconds, g.params,
           '', '', '', '', '', g.created_at, now()
      FROM g JOIN j ON j.id = g.id
), st AS (
    INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked,
                               released, poisoned, on_failure, always, max_items)
    SELECT j.id, g.svc_key, 0, 1, 0, 0, 0, 0, 0, false, false, 'fail_job', false, NULL
      FROM g JOIN j ON j.id = g.id
)
""" + _WIDENED


# What the widening statement answers: the ids of the jobs it made.
_WIDENED = "SELECT coalesce(array_agg(g.id), '{}') FROM g"

# The creation rows of jobs made of narrow starts (the ids in {jobs}) whose task no claim has taken yet:
# what jobs.enqueue's one-statement start writes for a one-task job, stamped at the start's creation
# with the start's source. A task a claim took carries its job's creation in the claim's row instead.
CREATIONS_SQL = """INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
SELECT j.created_at, j.id, 'api:' || j.source, 'info', 'status', 'job created waiting, 1 task queued',
       jsonb_build_object('from', 'created', 'to', 'waiting', 'approval', 'not_required',
                          'tasks', jsonb_build_array(jsonb_build_object('id', t.id::text, 'task_key', t.task_key,
                                                                        'to', 'queued')))
  FROM accs_job j JOIN accs_task t ON t.job_id = j.id
 WHERE j.id = ANY({jobs}) AND t.attempt = 0
 ORDER BY j.id"""


def widen_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`WIDEN_FUNCTION`.

    ``accs_widen_starts(ids, services, per_queue, before, limit)`` widens, by the first argument
    given: the starts ``ids`` (waiting for a start another transaction is widening: it is a job once
    that commits), the first ``per_queue`` starts of each of ``services`` per tenant in the claim's
    order, or up to ``limit`` starts created before ``before``. Those two pass over a start another
    transaction holds. It answers how many starts it widened. A migration holds a copy; a test
    compares the database's function with this text.
    """
    widen = widen_sql().replace(_WIDENED, _WIDENED.replace(" FROM g", " INTO v_widened FROM g"))
    return f"""CREATE OR REPLACE FUNCTION {WIDEN_FUNCTION}(
    p_ids uuid[], p_svc_ids bigint[], p_per_queue int, p_before timestamptz, p_limit int, p_events boolean)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
-- One plan per server connection (see jobs.claim's claim function); every statement reads rows by
-- the ids and index order it is given.
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $widen$
DECLARE
    v_ids uuid[];
    v_widened uuid[];
BEGIN
    IF p_ids IS NOT NULL THEN
        -- Locked in id order, waited for: one lock order for every widening that waits.
        v_ids := ARRAY(SELECT s.id FROM accs_start s WHERE s.id = ANY(p_ids) ORDER BY s.id FOR UPDATE);
    ELSIF p_svc_ids IS NOT NULL THEN
        -- Each service's tenants with starts, by a skip scan of start_claim_idx (one descent per
        -- tenant), then each tenant's first starts in the claim's order (priority, then order).
        v_ids := ARRAY(
            WITH RECURSIVE heads AS (
                SELECT q.id AS service_id,
                       (SELECT s.tenant_id FROM accs_start s WHERE s.service_id = q.id
                         ORDER BY s.service_id, s.tenant_id LIMIT 1) AS tenant_id
                  FROM unnest(p_svc_ids) AS q(id)
                UNION ALL
                SELECT h.service_id,
                       (SELECT s.tenant_id FROM accs_start s WHERE s.service_id = h.service_id
                           AND s.tenant_id > h.tenant_id ORDER BY s.service_id, s.tenant_id LIMIT 1)
                  FROM heads h WHERE h.tenant_id IS NOT NULL
            )
            SELECT x.id FROM heads h CROSS JOIN LATERAL (
                SELECT s.id FROM accs_start s
                 WHERE s.service_id = h.service_id AND s.tenant_id = h.tenant_id
                 ORDER BY s.priority DESC, s.order_seq, s.id
                 LIMIT p_per_queue
                   FOR UPDATE SKIP LOCKED) x
             WHERE h.tenant_id IS NOT NULL);
    ELSE
        -- The oldest first, by the time-ordered ids of the primary key.
        v_ids := ARRAY(SELECT s.id FROM accs_start s WHERE s.created_at < p_before ORDER BY s.id
                        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    END IF;
    IF cardinality(v_ids) = 0 THEN
        RETURN '{{}}';
    END IF;
{widen};
    IF p_events THEN
{textwrap.indent(CREATIONS_SQL.format(jobs="v_widened").strip(), "        ")};
    END IF;
    RETURN v_widened;
END
$widen$"""


WIDEN_IDS_SQL = f"SELECT cardinality({WIDEN_FUNCTION}(%(ids)s::uuid[], NULL, NULL, NULL, NULL, true))"
WIDEN_AGED_SQL = (f"SELECT cardinality({WIDEN_FUNCTION}(NULL, NULL, NULL, now() - make_interval(secs => %(after)s),"
                  " %(limit)s, true))")


def widen(ids: Iterable[UUID | str]) -> int:
    """Make the narrow starts among ``ids`` jobs now, in the caller's transaction; return how many.

    Called before a read of jobs by id, so a job just started on the narrow path reads as the queued
    job it is. Ids that name no start cost one probe of the start table's primary key.
    """
    wanted = sorted({str(i) for i in ids})
    if not wanted:
        return 0
    with connection.cursor() as cur:
        cur.execute(WIDEN_IDS_SQL, {"ids": wanted})
        return int(cur.fetchone()[0])


def widen_aged(*, after_seconds: float, limit: int) -> int:
    """Widen up to ``limit`` starts older than ``after_seconds`` (the builder's duty); return how many."""
    with connection.cursor() as cur:
        cur.execute(WIDEN_AGED_SQL, {"after": after_seconds, "limit": limit})
        return int(cur.fetchone()[0])
