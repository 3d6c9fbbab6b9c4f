"""Starting a job that runs now calls a server-side function, planned once per server connection.

A job that is due now, needs no approval and is under no cap starts in one statement (jobs.enqueue.
START_NOW_SQL). It was sent with psycopg's ``prepare=True``, which does nothing on Django's connection
(Django sets ``prepare_threshold`` to None for poolers), so PostgreSQL planned it at every start:
0.33-0.46 ms of the server's 1.0-1.3 ms. ``accs_start_now`` runs the same statement; its plan is made
once per server connection and kept.

Safe under the previous release's code: a new function, which it never calls (its starts send the
statement itself, as before). The body is a copy of jobs.enqueue.start_function_sql() (a test compares
the database's function with the code). Going back drops the function.
"""

from django.db import migrations

START = r"""CREATE OR REPLACE FUNCTION accs_start_now(
    p_id uuid, p_tenant uuid, p_wf uuid, p_svc bigint, p_prio int, p_opts jsonb, p_sp jsonb, p_sched timestamptz,
    p_src text, p_sref text, p_ext text, p_dk text, p_corr text, p_appr text, p_cby int, p_barred int[],
    p_first_key text, p_tasks jsonb, p_steps jsonb, p_source text, p_level text, p_message text, p_event_data jsonb,
    p_channels text[])
RETURNS TABLE (id uuid, order_seq bigint, created_at timestamptz, scheduled_at timestamptz, notified bigint)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $start$
#variable_conflict use_column
BEGIN
    RETURN QUERY
-- A job that is due now, needs no approval and is under no cap starts in ONE statement: the job
-- row (already admitted: waiting), its tasks, its step counts, its events and the wake-up of the agents.
-- A conflicting external_id or dedupe_key inserts nothing at all (the caller then finds the
-- holder): every part below reads from the job insert's RETURNING.
WITH j AS (
INSERT INTO accs_job (id, tenant_id, workflow_id, service_id, status, progress, current_task_key, priority, options,
                      step_params, scheduled_at, error_code, error_message, source, source_ref, external_id,
                      dedupe_key, correlation_id, approval_state, approved_by, created_by_id, created_at,
                      updated_at, started_at, approval_barred)
SELECT p_id::uuid, p_tenant::uuid, p_wf::uuid, p_svc::bigint, 'waiting', 0, p_first_key, p_prio::int,
       coalesce(p_opts::jsonb, '{}'), p_sp::jsonb, coalesce(p_sched::timestamptz, now()), '', '',
       p_src::text, p_sref::text, p_ext::text, p_dk::text, p_corr::text, p_appr::text, '', p_cby::int,
       now(), now(), now(), p_barred::int[]
    ON CONFLICT DO NOTHING
    RETURNING id, order_seq, created_at, scheduled_at
), t AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT r.id, j.id, p_tenant, r.task_key, r.step_key, r.service_id, NULL, r.exclusive, r.status,
           ARRAY(SELECT jsonb_array_elements_text(r.depends_on)), 0, r.max_attempts, now(), r.priority, j.order_seq,
           r.timeout_seconds, r.params, '', '', '', '', '', now(), now()
      FROM j, jsonb_to_recordset(p_tasks::jsonb) AS r(
           id uuid, task_key text, step_key text, service_id bigint, exclusive boolean, status text,
           depends_on jsonb, max_attempts int, priority int, timeout_seconds int, params jsonb)
    RETURNING id, task_key, status
), s AS (
    INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked,
                               released, poisoned, on_failure, always, max_items)
    SELECT j.id, r.step_key, r.position, r.total, 0, 0, 0, 0, 0, false, false, r.on_failure, r.always, r.max_items
      FROM j, jsonb_to_recordset(p_steps::jsonb) AS r(step_key text, position int, total int, on_failure text,
                                                       always boolean, max_items int)
), ev AS (
    -- ONE row records the job's creation with its tasks (events.timeline.creation_event's shape):
    -- the job's move, each task's id, key and first status in data.tasks; readers unfold it.
    INSERT INTO accs_event (job_id, source, level, type, message, data)
    SELECT j.id, p_source, p_level, 'status', p_message, p_event_data::jsonb FROM j
), n AS (
    SELECT pg_notify(c, '') FROM unnest(p_channels::text[]) AS c
)
SELECT j.id, j.order_seq, j.created_at, j.scheduled_at, (SELECT count(*) FROM n) FROM j;
END
$start$"""


class Migration(migrations.Migration):
    dependencies = [("jobs", "0043_attempt_rollup")]

    operations = [migrations.RunSQL(START, "DROP FUNCTION IF EXISTS accs_start_now(uuid, uuid, uuid, bigint, int, jsonb,"
                                           " jsonb, timestamptz, text, text, text, text, text, text, int, int[], text,"
                                           " jsonb, jsonb, text, text, text, jsonb, text[])")]
