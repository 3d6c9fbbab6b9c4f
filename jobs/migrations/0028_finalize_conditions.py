"""Job finalisation evaluates a step's condition (``when``) before promoting its tasks.

``accs_finalize_jobs`` (jobs.finalize.finalize_function_sql) gains one statement: the tasks it is
about to promote whose workflow step has a ``when`` (a jsonpath predicate over its parents' outputs,
read from the workflow version the job runs on) that does not hold are skipped, with an event naming
the condition, and the function repeats its skip, release and promote pass so that their dependents
follow the skip rules in the same call. A frozen copy of the function's text.

Safe under running daemons: CREATE OR REPLACE keeps the name, arguments and result type, so the
previous release's agents and builders call it as before (their report function calls it by that
signature), and a job without conditions runs exactly the statements it ran before (the extra pass
happens only when a condition skipped a task). Replacing a function takes no lock on accs_task or
accs_job. No column is added: the condition is read from the stored workflow version, so a job
instantiated by the previous release's builder honours its conditions too. Going back restores the
previous text (without conditions: their steps then run unconditionally).
"""

from importlib import import_module

from django.db import migrations

FINALIZE = r"""CREATE OR REPLACE FUNCTION accs_finalize_jobs(p_jobs uuid[], p_now timestamptz, p_source text,
                                              p_roots bool)
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
AS $finalize$
#variable_conflict use_column
DECLARE
    v_job_ids uuid[];
    v_steps text[];
    v_roots uuid[];
    v_n bigint;
BEGIN
    v_roots := CASE WHEN p_roots THEN p_jobs ELSE '{}'::uuid[] END;
    -- A pass skips and releases what settled, skips the tasks whose step's condition does not hold and
    -- promotes the rest; steps skipped by a condition settle too, so passes repeat until none is.
    FOR k IN 1..100 LOOP
        FOR i IN 1..100 LOOP
            WITH x AS (UPDATE accs_job_step s SET poisoned = true
 WHERE s.job_id = ANY(p_jobs::uuid[]) AND NOT s.poisoned
   AND s.error + s.skipped + s.canceled + s.blocked > 0  -- the unsuccessful final states
RETURNING s.job_id, s.step_key)
SELECT array_agg(x.job_id), array_agg(x.step_key) INTO v_job_ids, v_steps FROM x;
            EXIT WHEN v_job_ids IS NULL;
            -- Waiting tasks that depend on a step that can no longer succeed are skipped, unless their own
-- step is an "always" step (it runs once its dependencies are final).
WITH p AS (SELECT * FROM unnest(v_job_ids::uuid[], v_steps::text[]) AS p(job_id, step_key)),
sk AS (
    UPDATE accs_task w SET status = 'skipped', finished_at = p_now, updated_at = p_now,
           error_message = 'a dependency did not succeed'
      FROM p WHERE w.job_id = p.job_id AND w.status = 'waiting' AND p.step_key = ANY(w.depends_on)
       AND NOT EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = w.job_id AND own.step_key = w.step_key AND own.always)
    RETURNING w.id, w.job_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT DISTINCT job_id, id, p_source, 'warn', 'status', 'task waiting → skipped (a dependency did not succeed)',
           '{"from": "waiting", "to": "skipped"}'::jsonb FROM sk
)
SELECT count(DISTINCT id) INTO v_n FROM sk;
        END LOOP;
        WITH x AS (-- Steps whose tasks are all final, whatever their outcome: their waiting dependents are looked at
-- once (an unsuccessful step can only promote "always" dependents; the others were skipped).
UPDATE accs_job_step s SET released = true
 WHERE s.job_id = ANY(p_jobs::uuid[]) AND NOT s.released AND (s.done + s.error + s.skipped + s.canceled + s.blocked) = s.total
   AND s.job_id IN (SELECT id FROM accs_job WHERE id = ANY(p_jobs::uuid[]) AND status IN ('running', 'waiting'))
RETURNING s.job_id, s.step_key)
SELECT coalesce(array_agg(x.job_id), '{}'), coalesce(array_agg(x.step_key), '{}') INTO v_job_ids, v_steps FROM x;
        v_n := 0;
        IF cardinality(v_job_ids) > 0 OR cardinality(v_roots) > 0 THEN
            -- Tasks about to be promoted whose step runs only when a condition over its parents' outputs holds
-- ("when": a jsonpath predicate, read from the workflow version the job runs on) and it does not
-- (false, or no boolean at all) are skipped, the condition on the timeline; their dependents then
-- follow the skip rules. Only tasks of workflow steps that have a condition evaluate one.
WITH r AS (SELECT * FROM unnest(v_job_ids::uuid[], v_steps::text[]) AS r(job_id, step_key)),
c AS (
    SELECT w.id, w.job_id, cond.expr
      FROM accs_task w JOIN accs_job j ON j.id = w.job_id
     CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'when'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = w.step_key
         LIMIT 1) #>> '{}' AS expr) cond
     WHERE w.status = 'waiting'
       AND (w.id IN (SELECT t.id FROM accs_task t JOIN r ON t.job_id = r.job_id
                      WHERE t.status = 'waiting' AND r.step_key = ANY(t.depends_on))
            OR (w.job_id = ANY(v_roots::uuid[]) AND cardinality(w.depends_on) = 0))
       AND NOT EXISTS (SELECT 1 FROM accs_job_step d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                          AND CASE WHEN EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = w.job_id AND own.step_key = w.step_key AND own.always) THEN (d.done + d.error + d.skipped + d.canceled + d.blocked) ELSE d.done END < d.total)
       AND cond.expr IS NOT NULL
       AND NOT coalesce(jsonb_path_match(coalesce((SELECT jsonb_object_agg(g.step_key, g.output)
          FROM (SELECT p.step_key,
                       CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)
                            ELSE (array_agg(p.results))[1] END AS output
                  FROM accs_task p
                 WHERE p.job_id = w.job_id AND p.step_key = ANY (w.depends_on)
                 GROUP BY p.step_key) g), '{}'::jsonb), cond.expr::jsonpath, '{}'::jsonb, true), false)
), sk AS (
    UPDATE accs_task t SET status = 'skipped', finished_at = p_now, updated_at = p_now,
           error_message = left('condition did not hold: ' || c.expr, 2000)
      FROM c WHERE t.id = c.id
    RETURNING t.id, t.job_id, c.expr
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, p_source, 'info', 'status', left('task waiting → skipped (condition did not hold: '
                                                          || expr || ')', 2000),
           jsonb_build_object('from', 'waiting', 'to', 'skipped', 'reason', 'condition did not hold', 'when', expr)
      FROM sk
)
SELECT count(*) INTO v_n FROM sk;
            RETURN QUERY -- Waiting dependents of the steps just settled (or, with roots, tasks with no dependency at all)
-- become queued once every step they depend on is done; an "always" step's tasks once every step
-- they depend on is final, whatever its outcome (its own step row says which).
WITH r AS (SELECT * FROM unnest(v_job_ids::uuid[], v_steps::text[]) AS r(job_id, step_key)),
p AS (
    UPDATE accs_task w SET status = 'queued', next_attempt_at = p_now, updated_at = p_now
     WHERE w.status = 'waiting'
       AND (w.id IN (SELECT t.id FROM accs_task t JOIN r ON t.job_id = r.job_id
                      WHERE t.status = 'waiting' AND r.step_key = ANY(t.depends_on))
            OR (w.job_id = ANY(v_roots::uuid[]) AND cardinality(w.depends_on) = 0))
       AND NOT EXISTS (SELECT 1 FROM accs_job_step d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                          AND CASE WHEN EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = w.job_id AND own.step_key = w.step_key AND own.always) THEN (d.done + d.error + d.skipped + d.canceled + d.blocked) ELSE d.done END < d.total)
    RETURNING w.id, w.job_id, w.service_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, p_source, 'info', 'status', 'task waiting → queued',
           '{"from": "waiting", "to": "queued"}'::jsonb FROM p
)
SELECT DISTINCT s.key::text FROM p JOIN accs_service s ON s.id = p.service_id;
        END IF;
        v_roots := '{}'::uuid[];
        EXIT WHEN v_n = 0;
    END LOOP;
    -- Progress, current step and status of admitted jobs. A job whose tasks are all final ends; any
-- other admitted job is "running" while a task of it is starting or running and "waiting"
-- otherwise (task_job_open_idx answers the EXISTS with two index probes). How it ends follows
-- the steps' failure policies: a failed task of a "fail_job" step makes it "error", else a canceled
-- task "canceled", else failed tasks of "continue" steps or blocked hosts "partial", else "done".
WITH agg AS (
    SELECT job_id, sum(total) AS total, sum((s.done + s.error + s.skipped + s.canceled + s.blocked)) AS finished,
           sum(error) AS error, sum(canceled) AS canceled, sum(blocked) AS blocked,
           coalesce(sum(error) FILTER (WHERE on_failure = 'fail_job'), 0) AS fatal,
           coalesce(sum(error) FILTER (WHERE on_failure = 'continue'), 0) AS tolerated,
           count(*) FILTER (WHERE on_failure = 'continue' AND error > 0) AS tolerated_steps,
           (array_agg(step_key ORDER BY position)
                FILTER (WHERE (s.done + s.error + s.skipped + s.canceled + s.blocked) < total))[1] AS current_key
      FROM accs_job_step s WHERE job_id = ANY(p_jobs::uuid[]) GROUP BY job_id
), verdict AS (
    SELECT agg.*, j.status AS was,
           CASE WHEN j.status IN ('running', 'waiting') AND agg.finished = agg.total THEN
                     CASE WHEN agg.fatal > 0 THEN 'error' WHEN agg.canceled > 0 THEN 'canceled'
                          WHEN agg.tolerated + agg.blocked > 0 THEN 'partial' ELSE 'done' END END AS ends,
           CASE WHEN j.status IN ('running', 'waiting') THEN
                     CASE WHEN EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = agg.job_id
                                          AND t.status IN ('running', 'starting')) THEN 'running' ELSE 'waiting' END
                END AS settles,
           concat_ws('; ',
                     CASE WHEN agg.tolerated > 0 THEN agg.tolerated || ' task(s) of ' || agg.tolerated_steps
                          || ' step(s) with on_failure "continue" failed; their dependents were skipped' END,
                     CASE WHEN agg.blocked > 0 THEN agg.blocked || ' of ' || agg.total
                          || ' task(s) blocked on their host' END) AS partly
      FROM agg JOIN accs_job j ON j.id = agg.job_id
), upd AS (
    UPDATE accs_job j
       SET progress = v.finished::float / greatest(v.total, 1),
           current_task_key = coalesce(v.current_key, j.current_task_key),
           status = coalesce(v.ends, v.settles, j.status),
           finished_at = CASE WHEN v.ends IS NOT NULL THEN p_now ELSE j.finished_at END,
           error_code = CASE v.ends WHEN 'error' THEN 'task_failed' WHEN 'canceled' THEN 'canceled'
                                    WHEN 'partial' THEN CASE WHEN v.tolerated > 0 THEN 'steps_failed'
                                                             ELSE 'hosts_blocked' END
                                    ELSE j.error_code END,
           error_message = CASE v.ends WHEN 'error' THEN v.error || ' task(s) failed'
                                       WHEN 'canceled' THEN v.canceled || ' task(s) canceled'
                                       WHEN 'partial' THEN v.partly
                                       ELSE j.error_message END,
           updated_at = p_now
      FROM verdict v WHERE j.id = v.job_id
    RETURNING j.id
)
INSERT INTO accs_event (job_id, source, level, type, message, data)
SELECT v.job_id, p_source, CASE v.ends WHEN 'done' THEN 'info' WHEN 'error' THEN 'error' ELSE 'warn' END, 'status',
       'job ' || v.was || ' → ' || v.ends
           || CASE WHEN v.ends = 'partial' AND v.tolerated = 0 THEN ' (' || v.blocked || ' of ' || v.total
                                                                  || ' task(s) blocked)'
                   WHEN v.ends = 'partial' THEN ' (' || v.partly || ')'
                   WHEN v.ends = 'error' THEN ' (' || v.fatal || ' task(s) of on_failure "fail_job" steps failed)'
                   ELSE '' END,
       jsonb_build_object('from', v.was, 'to', v.ends, 'total', v.total, 'blocked', v.blocked,
                          'canceled', v.canceled, 'error', v.error, 'continue_failed', v.tolerated,
                          'continue_failed_steps', v.tolerated_steps)
  FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NOT NULL
UNION ALL
SELECT v.job_id, p_source, 'info', 'status',
       'job ' || v.was || ' → ' || v.settles || CASE v.settles WHEN 'waiting' THEN ' (no task starting or running)'
                                                   ELSE ' (a task is starting or running)' END,
       jsonb_build_object('from', v.was, 'to', v.settles)
  FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NULL AND v.settles <> v.was;
END
$finalize$"""

# Going back: the function as migration 0020 created it, with the setting 0023 gave it.
_previous = import_module("jobs.migrations.0020_report_functions")
PREVIOUS = [_previous.FINALIZE, "ALTER FUNCTION accs_finalize_jobs(uuid[], timestamptz, text, bool) SET jit = off"]


class Migration(migrations.Migration):
    dependencies = [("jobs", "0027_cluster_pulse")]

    operations = [migrations.RunSQL(FINALIZE, PREVIOUS)]
