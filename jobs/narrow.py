"""Narrow starts: a one-task job written as one row, widened into its job when it is taken.

``enqueue`` writes a start that needs nothing decided before it runs as one row of ``accs_start``
(:class:`jobs.models.Start`): no job, task, step or event row, two index entries. Such a start is a
job of one service, due now, with no idempotency key (``external_id``, ``dedupe_key``), no approval,
no options, no tenant cap, and a service without a rate or per-key limit; the site turns the path on
with ``ACC_NARROW_STARTS``. Every other start takes the wide path (:data:`jobs.enqueue.START_NOW_SQL`
or the builder's admission).

A start is *widened* by one statement (:func:`jobs.enqueue.widen_sql`, where every job row is
inserted; run by the function ``accs_widen_starts``): the start row is deleted and its job
(``waiting``), task (``queued``), step and creation event are written, with the job id, task id,
priority, place in the global order and creation time the start was given, so nothing the start
promised changes. Three callers widen, each under the start rows' locks:

* the claim (``accs_claim_plain``): before it looks for work, the head of each service's queue, per
  tenant, as many starts as the agent has free slots, so the claim takes narrow and wide work in
  the one global order;
* the builder (:mod:`jobs.duties.narrow`): every start older than ``ACC_NARROW_WIDEN_AFTER_SEC``,
  so a start no agent takes soon (its service's agents are busy, or none runs) still becomes a job
  that every list and count shows;
* a read by id (:func:`widen`): the API's read of one job and its actions on it, the Tasks backend's
  ``get_result()`` and the operators' verbs (``jobs.locks.lock_jobs``), so a job just started is
  found as a queued job.

A task the claim takes right after widening it carries its job's creation in the claim's timeline
row (:data:`CREATIONS_SQL` writes the creation rows of the others).
"""

from __future__ import annotations

from collections.abc import Iterable
from uuid import UUID

from django.db import connection

WIDEN_FUNCTION = "accs_widen_starts"

# What the widening statement answers: the ids of the jobs it made.
WIDENED = "SELECT coalesce(array_agg(g.id), '{}') FROM g"

# The creation rows of jobs made of narrow starts (the ids in {jobs}) whose task no claim has taken yet:
# what jobs.enqueue's one-statement start writes for a one-task job, stamped at the start's creation
# with the start's source. A task a claim took carries its job's creation in the claim's row instead.
CREATIONS_SQL = """INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
SELECT j.created_at, j.id, 'api:' || j.source, 'info', 'status', 'job created waiting, 1 task queued',
       jsonb_build_object('from', 'created', 'to', 'waiting', 'approval', 'not_required',
                          'tasks', jsonb_build_array(jsonb_build_object('id', t.id::text, 'task_key', t.task_key,
                                                                        'to', 'queued')))
  FROM accs_job j JOIN accs_task t ON t.job_id = j.id
 -- (The tasks by their jobs too: joined alone, a plan made while the task table was nearly empty read
 -- all of task_job_key_unique for them, at every claim that widened a start it did not take.)
 WHERE j.id = ANY({jobs}) AND t.job_id = ANY({jobs}) AND t.attempt = 0
 ORDER BY j.id"""


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
