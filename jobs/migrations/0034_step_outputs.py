"""A step's output is gathered once, when its tasks are all final, for its dependents to read in one row.

Before, every task of a step read its parents' outputs from their tasks: after a 1,000-host fan-out each
of the next step's 1,000 tasks gathered the 1,000 outputs again (a million rows read, 6.7 ms per task
instead of well under one), and a task with no dependency still read its job's tasks.

``accs_job_step`` gains ``output`` (nullable jsonb). ``accs_finalize_jobs`` (jobs.finalize.finalize_function_sql,
a frozen copy of its text) fills it when it releases a step of a job with more than one step; the step
counts' trigger (``accs_task_step_counts``) clears it whenever a task of the step enters or leaves a final
state, so a gathered output is never older than the step's tasks. The agent reads it through a new function,
``accs_step_context`` (jobs.inputs.step_context_function_sql: planned once per connection; planning the
statement at every attempt cost 5 ms), and falls back to the tasks when a parent has none; a task with no
dependency reads no parent at all.

A stored ``when`` or ``fan_out.over`` that is not a jsonpath (written past the validator, which refuses it on
every save path) made every report settling its job raise. Both functions now read it through
``accs_jsonpath`` (new: NULL for an invalid one): such a condition never holds and its step is skipped
saying so, and such a fan-out fails its step saying so.

Safe under running daemons: adding a nullable column changes the catalogue only (no rewrite; a brief lock
on accs_job_step alone, not on accs_task or accs_job); CREATE OR REPLACE keeps both functions' names,
arguments and results; only this release's agents call the new function. The previous release's agents
read parents from their tasks as before and never see the column. Going back drops the column and the new function and restores both previous texts.
"""

from importlib import import_module

from django.db import migrations, models

JSONPATH = r"""CREATE OR REPLACE FUNCTION accs_jsonpath(p_text text)
RETURNS jsonpath
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $jsonpath$
BEGIN
    RETURN p_text::jsonpath;
EXCEPTION WHEN syntax_error OR invalid_parameter_value OR data_exception THEN
    RETURN NULL;  -- not a jsonpath
END
$jsonpath$"""

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
    v_m bigint;
BEGIN
    v_roots := CASE WHEN p_roots THEN p_jobs ELSE '{}'::uuid[] END;
    -- A pass skips and releases what settled, skips the tasks whose step's condition does not hold, makes
    -- one task per item of the steps fanning out over a parent's list and promotes the rest; steps a
    -- condition or a fan-out ended settle too, so passes repeat until none is.
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
-- Each such step's output is gathered once here, for its dependents' tasks to read from this row (see
-- jobs.inputs), when the job has another step that could read it.
UPDATE accs_job_step s
   SET released = true,
       output = CASE WHEN EXISTS (SELECT 1 FROM accs_job_step o WHERE o.job_id = s.job_id AND o.step_key <> s.step_key)
                     THEN (SELECT CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)
                            ELSE (array_agg(p.results))[1] END FROM accs_task p
                            WHERE p.job_id = s.job_id AND p.step_key = s.step_key) END
 WHERE s.job_id = ANY(p_jobs::uuid[]) AND NOT s.released AND (s.done + s.error + s.skipped + s.canceled + s.blocked) = s.total
   AND s.job_id IN (SELECT id FROM accs_job WHERE id = ANY(p_jobs::uuid[]) AND status IN ('running', 'waiting'))
RETURNING s.job_id, s.step_key)
SELECT coalesce(array_agg(x.job_id), '{}'), coalesce(array_agg(x.step_key), '{}') INTO v_job_ids, v_steps FROM x;
        v_n := 0;
        IF cardinality(v_job_ids) > 0 OR cardinality(v_roots) > 0 THEN
            -- Tasks about to be promoted whose step runs only when a condition over its parents' outputs holds
-- ("when": a jsonpath predicate, read from the workflow version the job runs on) and it does not
-- (false, or no boolean at all) are skipped, the condition on the timeline; their dependents then
-- follow the skip rules. Only tasks of workflow steps that have a condition evaluate one. A stored
-- condition that is not a jsonpath at all (written past the validator) never holds, and says so.
WITH r AS (SELECT * FROM unnest(v_job_ids::uuid[], v_steps::text[]) AS r(job_id, step_key)),
c AS (
    SELECT w.id, w.job_id, cond.expr,
           CASE WHEN accs_jsonpath(cond.expr) IS NULL THEN 'condition is not a valid jsonpath'
                ELSE 'condition did not hold' END AS why
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
                 GROUP BY p.step_key) g), '{}'::jsonb), accs_jsonpath(cond.expr), '{}'::jsonb, true),
                        false)
), sk AS (
    UPDATE accs_task t SET status = 'skipped', finished_at = p_now, updated_at = p_now,
           error_message = left(c.why || ': ' || c.expr, 2000)
      FROM c WHERE t.id = c.id
    RETURNING t.id, t.job_id, c.expr, c.why
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, p_source, 'info', 'status', left('task waiting → skipped (' || why || ': ' || expr || ')',
                                                          2000),
           jsonb_build_object('from', 'waiting', 'to', 'skipped', 'reason', why, 'when', expr)
      FROM sk
)
SELECT count(*) INTO v_n FROM sk;
            -- Tasks about to be promoted whose step fans out over a list a parent returned ("fan_out": {"over":
-- jsonpath}, read from the workflow version the job runs on) become one task per item: the task itself
-- is item 0 (its key gains "[0]"), a copy is inserted for each further item (key "<step>[i]") and the
-- step's total grows to match, so its dependents wait for every item. Each item task reads its item
-- from the same list when it runs (jobs.inputs). An empty list skips the step's task; no list, or more
-- items than the step row's limit, fails it with the reason; either way no item task is made.
WITH r AS (SELECT * FROM unnest(v_job_ids::uuid[], v_steps::text[]) AS r(job_id, step_key)),
f AS (
    SELECT w.id, w.job_id, w.step_key, fo.over, coalesce(js.max_items, 1000) AS max_items,
           jsonb_path_query_first(coalesce((SELECT jsonb_object_agg(g.step_key, g.output)
          FROM (SELECT p.step_key,
                       CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)
                            ELSE (array_agg(p.results))[1] END AS output
                  FROM accs_task p
                 WHERE p.job_id = w.job_id AND p.step_key = ANY (w.depends_on)
                 GROUP BY p.step_key) g), '{}'::jsonb), accs_jsonpath(fo.over), '{}'::jsonb, true) AS list
      FROM accs_task w JOIN accs_job j ON j.id = w.job_id
      JOIN accs_job_step js ON js.job_id = w.job_id AND js.step_key = w.step_key
     CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'fan_out'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = w.step_key
         LIMIT 1) ->> 'over' AS over) fo
     WHERE w.status = 'waiting'
       AND (w.id IN (SELECT t.id FROM accs_task t JOIN r ON t.job_id = r.job_id
                      WHERE t.status = 'waiting' AND r.step_key = ANY(t.depends_on))
            OR (w.job_id = ANY(v_roots::uuid[]) AND cardinality(w.depends_on) = 0))
       AND NOT EXISTS (SELECT 1 FROM accs_job_step d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                          AND CASE WHEN EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = w.job_id AND own.step_key = w.step_key AND own.always) THEN (d.done + d.error + d.skipped + d.canceled + d.blocked) ELSE d.done END < d.total)
       AND w.task_key = w.step_key AND fo.over IS NOT NULL
), v AS (
    SELECT f.*, CASE WHEN accs_jsonpath(f.over) IS NULL THEN 'is not a valid jsonpath'
                     WHEN f.list IS NULL THEN 'found no value in the parents'' outputs'
                     WHEN jsonb_typeof(f.list) <> 'array' THEN 'found ' || jsonb_typeof(f.list) || ', not a list'
                     WHEN jsonb_array_length(f.list) > f.max_items
                         THEN 'found ' || jsonb_array_length(f.list) || ' items, more than the limit of '
                              || f.max_items || ' (ACC_MAX_FAN_OUT_ITEMS)'
                END AS failure,
           CASE WHEN jsonb_typeof(f.list) = 'array' THEN jsonb_array_length(f.list) END AS n
      FROM f
), t AS (
    UPDATE accs_task t
       SET task_key = CASE WHEN v.failure IS NULL AND v.n > 0 THEN t.step_key || '[0]' ELSE t.task_key END,
           status = CASE WHEN v.failure IS NOT NULL THEN 'error' WHEN v.n = 0 THEN 'skipped' ELSE t.status END,
           finished_at = CASE WHEN v.failure IS NOT NULL OR v.n = 0 THEN p_now END,
           error_code = CASE WHEN v.failure IS NOT NULL THEN 'fan_out_failed' ELSE t.error_code END,
           error_message = CASE WHEN v.failure IS NOT NULL
                                     THEN left('fan_out over ' || v.over || ' ' || v.failure, 2000)
                                WHEN v.n = 0 THEN left('fan_out over an empty list: ' || v.over, 2000)
                                ELSE t.error_message END,
           updated_at = p_now
      FROM v WHERE t.id = v.id
    RETURNING t.id, t.job_id, t.step_key, t.status, t.error_message, v.n, v.over
), more AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT encode(int8send((greatest((extract(epoch FROM clock_timestamp()) * 1000)::bigint, ('x' || left(replace(w.id::text, '-', ''), 12))::bit(48)::bigint + 1) << 16) | 28672 | ((i)::bigint >> 30 & 4095)) || int8send(x'8000000000000000'::bit(64)::bigint | (((i)::bigint & 1073741823) << 32) | floor(random() * 4294967296)::bigint), 'hex')::uuid, w.job_id, w.tenant_id, w.step_key || '[' || i || ']', w.step_key,
           w.service_id, w.host_id, w.exclusive, 'waiting', w.depends_on, 0, w.max_attempts, p_now, w.priority,
           w.order_seq, w.timeout_seconds, w.params, w.assigned_node, '', '', '', '', p_now, p_now
      FROM v JOIN accs_task w ON w.id = v.id CROSS JOIN LATERAL generate_series(1, v.n - 1) AS i
     WHERE v.failure IS NULL AND v.n > 1
     ORDER BY w.id, i
), grow AS (
    UPDATE accs_job_step s SET total = s.total + v.n - 1
      FROM v WHERE s.job_id = v.job_id AND s.step_key = v.step_key AND v.failure IS NULL AND v.n > 1
), halt AS (
    -- A failed fan-out of an on_failure "fail_job" step fails its job as a failed task does (jobs.failure):
    -- the job's other unstarted tasks are skipped, except those of "always" steps.
    UPDATE accs_task o SET status = 'skipped', finished_at = p_now, updated_at = p_now,
           error_message = 'job failed'
      FROM (SELECT u.id, u.status AS was FROM accs_task u
             WHERE u.job_id IN (SELECT v.job_id FROM v JOIN accs_job_step js ON js.job_id = v.job_id
                                                        AND js.step_key = v.step_key
                                 WHERE v.failure IS NOT NULL AND js.on_failure = 'fail_job')
               AND u.status IN ('queued', 'scheduled', 'waiting') AND NOT EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = u.job_id AND own.step_key = u.step_key AND own.always)
               AND u.id NOT IN (SELECT id FROM v)) x
     WHERE o.id = x.id
    RETURNING o.id, o.job_id, x.was
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, p_source, 'warn', 'status', 'task ' || was || ' → skipped (job failed)',
           jsonb_build_object('from', was, 'to', 'skipped', 'reason', 'job failed') FROM halt
    UNION ALL
    SELECT job_id, id, p_source, CASE status WHEN 'error' THEN 'error' ELSE 'info' END, 'status',
           CASE status WHEN 'waiting' THEN 'step ' || step_key || ' fanned out over ' || over || ': ' || n || ' task(s)'
                ELSE left('task waiting → ' || status || ' (' || error_message || ')', 2000) END,
           CASE status WHEN 'waiting' THEN jsonb_build_object('fan_out', over, 'tasks', n)
                ELSE jsonb_build_object('from', 'waiting', 'to', status, 'reason', error_message, 'fan_out', over) END
      FROM t
    UNION ALL
    -- The job's own line, as a failed task's fail_job policy writes one: why the job fails.
    SELECT t.job_id, NULL, p_source, 'error', 'policy',
           left('job fails (on_failure fail_job): ' || t.error_message, 2000),
           jsonb_build_object('on_failure', 'fail_job', 'reason', t.error_message, 'fan_out', t.over)
      FROM t JOIN accs_job_step js ON js.job_id = t.job_id AND js.step_key = t.step_key
     WHERE t.status = 'error' AND js.on_failure = 'fail_job'
)
SELECT count(*) INTO v_m FROM t WHERE t.status <> 'waiting';
            v_n := v_n + v_m;
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

STEP_CONTEXT = r"""CREATE OR REPLACE FUNCTION accs_step_context(p_task uuid)
RETURNS TABLE (inputs jsonb, output_schema jsonb)
LANGUAGE plpgsql STABLE
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $context$
#variable_conflict use_column
BEGIN
    RETURN QUERY
SELECT po.inputs || coalesce((SELECT jsonb_build_object(
                                  'item', jsonb_path_query_first(po.inputs, accs_jsonpath(fo.over), '{}',
                                                                 true) -> ix.i,
                                  'index', ix.i)
                                FROM (SELECT substring(t.task_key FROM '\[([0-9]+)\]$')::int AS i) ix WHERE ix.i IS NOT NULL AND fo.over IS NOT NULL),
                              '{}'::jsonb) AS inputs,
       (SELECT s.value -> 'output_schema'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = t.step_key
         LIMIT 1) AS output_schema
  FROM accs_task t JOIN accs_job j ON j.id = t.job_id
 CROSS JOIN LATERAL (SELECT CASE
            WHEN cardinality(t.depends_on) = 0 THEN '{}'::jsonb
            -- The parents' gathered outputs, one step row each (job_step_unique), when every parent has one.
            ELSE coalesce((SELECT CASE WHEN bool_and(s.output IS NOT NULL)
                                       THEN jsonb_object_agg(s.step_key, s.output) END
                             FROM accs_job_step s
                            WHERE s.job_id = t.job_id AND s.step_key = ANY (t.depends_on) AND s.total > 0),
                          coalesce((SELECT jsonb_object_agg(g.step_key, g.output)
          FROM (SELECT p.step_key,
                       CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)
                            ELSE (array_agg(p.results))[1] END AS output
                  FROM accs_task p
                 WHERE p.job_id = t.job_id AND p.step_key = ANY (t.depends_on)
                 GROUP BY p.step_key) g), '{}'::jsonb))
            END AS inputs) po
 CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'fan_out'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = t.step_key
         LIMIT 1) ->> 'over' AS over) fo
 WHERE t.id = p_task;
END
$context$"""

STEP_COUNTS = r"""
CREATE OR REPLACE FUNCTION accs_task_step_counts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accs_job_step s
       SET done = s.done + d.done, error = s.error + d.error, skipped = s.skipped + d.skipped,
           canceled = s.canceled + d.canceled, blocked = s.blocked + d.blocked,
           -- A step whose tasks' final states change has no gathered output until it is released again.
           output = NULL
      FROM (SELECT x.job_id, x.step_key, sum(x.done) AS done, sum(x.error) AS error, sum(x.skipped) AS skipped,
                   sum(x.canceled) AS canceled, sum(x.blocked) AS blocked
              FROM (SELECT n.job_id, n.step_key, (n.status = 'done')::int AS done, (n.status = 'error')::int AS error,
                           (n.status = 'skipped')::int AS skipped, (n.status = 'canceled')::int AS canceled,
                           (n.status = 'blocked')::int AS blocked
                      FROM accs_task_new n WHERE n.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')
                    UNION ALL
                    SELECT o.job_id, o.step_key, -(o.status = 'done')::int, -(o.status = 'error')::int,
                           -(o.status = 'skipped')::int, -(o.status = 'canceled')::int, -(o.status = 'blocked')::int
                      FROM accs_task_old o WHERE o.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')) x
             GROUP BY x.job_id, x.step_key
            HAVING sum(x.done) <> 0 OR sum(x.error) <> 0 OR sum(x.skipped) <> 0 OR sum(x.canceled) <> 0
                OR sum(x.blocked) <> 0) d
     WHERE s.job_id = d.job_id AND s.step_key = d.step_key;
    RETURN NULL;
END
$$;
"""

_finalize_before = import_module("jobs.migrations.0030_fan_out_over_items")
_counts_before = import_module("jobs.migrations.0021_step_counts_linear")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0033_claim_skips_paused_tenants")]

    operations = [
        migrations.AddField(
            model_name="jobstep",
            name="output",
            field=models.JSONField(
                blank=True, null=True,
                help_text="The step's output gathered once its tasks were all final (a fanned-out step's as a list),"
                          " read by its dependents; cleared when a task of it leaves or enters a final state again."),
        ),
        migrations.RunSQL(JSONPATH, "DROP FUNCTION IF EXISTS accs_jsonpath(text)"),
        migrations.RunSQL(STEP_COUNTS, _counts_before.LINEAR),
        migrations.RunSQL(FINALIZE, _finalize_before.FINALIZE),
        migrations.RunSQL(STEP_CONTEXT, "DROP FUNCTION IF EXISTS accs_step_context(uuid)"),
    ]
