"""The report of successes writes one timeline row per task it moves, its job's moves folded in.

An agent's report of a short task moved its job waiting → running, the task starting → running → done and
the job running → done in one transaction, and wrote four timeline rows for it (of the seven a one-task
job wrote from its start to its end). Those moves are now one row per task (events.timeline.unfold shows
its lines): the task's moves in order, the job's moves before them on the row of the job's first task
moved, those after them on its last. ``accs_finalize_and_write`` is the finalization as before, which
also writes the moves its caller hands over; ``accs_report_succeeded`` hands its moves over instead of
writing a row per move.

Both functions also run without sequential scans, and the report finds its tasks' waiting jobs by their
ids: each plan is made once per server connection, and one made from statistics taken while a table was
small (the first call after a burst of work had ended) read every job, step or waiting job at every
report for as long as the connection lived (a report of 64 tasks took 175-200 ms instead of 20-25 ms
behind 12,800 jobs, in about one run of three after a drain).

Safe under the previous release's daemons: the report function keeps its name, arguments and results, so
its agents call it as before and write the new rows (the previous release's pages list such a row as one
line, its message naming the task's and the job's moves); its other verbs call ``accs_finalize_jobs``,
which is left as it was, to be dropped a release later. ``CREATE OR REPLACE FUNCTION`` takes no lock on a
table. Frozen copies of jobs.finalize.finalize_function_sql() and jobs.reports.report_function_sql() (a
test compares the database's functions with the code); going back restores jobs.0045's report function
and drops the new finalization.
"""

from importlib import import_module

from django.db import migrations

FINALIZE = r"""CREATE OR REPLACE FUNCTION accs_finalize_and_write(p_jobs uuid[], p_now timestamptz, p_source text,
                                                   p_roots bool, p_moves jsonb, p_job_moves jsonb)
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
-- No sequential scans: every statement reads rows by the ids it was given (jobs, tasks, their steps), but a
-- plan made while a table was small (a connection's first call after a burst had ended) joined them by
-- reading the whole table, and kept doing so as the table grew, for as long as the connection lived.
SET enable_seqscan = off
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
), jm AS (
    -- The jobs' moves: those the caller made before this statement (a task's start moving its job from
    -- waiting), then this statement's own. A move names its message and level only where they are not
    -- the plain "job <from> → <to>" at level info.
    SELECT m.job_id, true AS before, m.move FROM jsonb_to_recordset(p_job_moves::jsonb) AS m(job_id uuid, move jsonb)
    UNION ALL
    SELECT v.job_id, false,
           jsonb_build_object('from', v.was, 'to', v.ends, 'total', v.total)
           -- (The counts that are not 0: a done job's end names none.)
           || jsonb_strip_nulls(jsonb_build_object(
                  'blocked', nullif(v.blocked, 0), 'canceled', nullif(v.canceled, 0), 'error', nullif(v.error, 0),
                  'continue_failed', nullif(v.tolerated, 0), 'continue_failed_steps', nullif(v.tolerated_steps, 0),
                  'level', CASE v.ends WHEN 'done' THEN NULL WHEN 'error' THEN 'error' ELSE 'warn' END,
                  -- (NULL, so left out, where no reason follows the move: a done or canceled job's.)
                  'message', 'job ' || v.was || ' → ' || v.ends
                             || CASE WHEN v.ends = 'partial' AND v.tolerated = 0
                                         THEN ' (' || v.blocked || ' of ' || v.total || ' task(s) blocked)'
                                     WHEN v.ends = 'partial' THEN ' (' || v.partly || ')'
                                     WHEN v.ends = 'error'
                                         THEN ' (' || v.fatal || ' task(s) of on_failure "fail_job" steps failed)'
                                END))
      FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NOT NULL
    UNION ALL
    SELECT v.job_id, false,
           jsonb_build_object('from', v.was, 'to', v.settles, 'message',
                              'job ' || v.was || ' → ' || v.settles
                              || CASE v.settles WHEN 'waiting' THEN ' (no task starting or running)'
                                                ELSE ' (a task is starting or running)' END)
      FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NULL AND v.settles <> v.was
), tm AS (SELECT * FROM jsonb_to_recordset(p_moves::jsonb) AS m(id bigint, job_id uuid, task_id uuid, attempt int, level text, data jsonb))
, tmo AS (
    SELECT tm.*, row_number() OVER (PARTITION BY tm.job_id ORDER BY tm.id, tm.task_id) AS i,
           count(*) OVER (PARTITION BY tm.job_id) AS n
      FROM tm
), jmv AS (
    SELECT jm.job_id,
           jsonb_agg(jm.move) FILTER (WHERE jm.before) AS before,
           jsonb_agg(jm.move) FILTER (WHERE NOT jm.before) AS after,
           max(CASE jm.move ->> 'level' WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END) FILTER (WHERE jm.before) AS before_rank,
           max(CASE jm.move ->> 'level' WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END) FILTER (WHERE NOT jm.before) AS after_rank
      FROM jm GROUP BY jm.job_id
), r AS (
    SELECT t.id, t.job_id, t.task_id, t.attempt, t.data, t.level,
           CASE WHEN t.i = 1 THEN j.before END AS before, CASE WHEN t.i = t.n THEN j.after END AS after,
           greatest(CASE t.level WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END, CASE WHEN t.i = 1 THEN j.before_rank END,
                    CASE WHEN t.i = t.n THEN j.after_rank END) AS rank
      FROM tmo t LEFT JOIN jmv j ON j.job_id = t.job_id
)
INSERT INTO accs_event (id, ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT coalesce(r.id, nextval('accs_event_id_seq')), p_now, r.job_id, r.task_id, r.attempt, p_source,
       (ARRAY['debug', 'info', 'warn', 'error'])[r.rank + 1], 'status',
       'task ' || (r.data ->> 'from') || ' → ' || (r.data ->> 'to')
       || coalesce(' (job ' || (coalesce(r.before, r.after) -> 0 ->> 'from') || ' → '
                   || (SELECT string_agg(m.move ->> 'to', ' → ' ORDER BY m.i)
                         FROM jsonb_array_elements(coalesce(r.before, '[]') || coalesce(r.after, '[]'))
                              WITH ORDINALITY AS m(move, i)) || ')', ''),
       r.data || jsonb_strip_nulls(jsonb_build_object('level', nullif(r.level, 'info'), 'job_before', r.before,
                                                      'job', r.after))
  FROM r
UNION ALL
SELECT nextval('accs_event_id_seq'), p_now, jm.job_id, NULL, NULL, p_source, coalesce(jm.move ->> 'level', 'info'), 'status',
       coalesce(jm.move ->> 'message', 'job ' || (jm.move ->> 'from') || ' → ' || (jm.move ->> 'to')),
       jm.move - 'message' - 'level'
  FROM jm WHERE jm.job_id NOT IN (SELECT tm.job_id FROM tm);
END
$finalize$;"""

REPORT = r"""CREATE OR REPLACE FUNCTION accs_report_succeeded(
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
    v_all_done uuid[] := '{}';
    v_all_jobs uuid[] := '{}';
    v_moves jsonb := '[]';
    v_job_moves jsonb := '[]';
BEGIN
    -- The lock order (jobs.locks): the jobs of the reported tasks, then the tasks, each sorted by id.
    PERFORM 1 FROM accs_job WHERE id IN (SELECT t.job_id FROM accs_task t WHERE t.id = ANY(p_ids || p_start_ids))
     ORDER BY id FOR NO KEY UPDATE;
    PERFORM 1 FROM accs_task WHERE id = ANY(p_ids || p_start_ids) ORDER BY id FOR UPDATE;
    -- Then the held counts of their keys, sorted: up to two statements below end tasks.
    PERFORM 1 FROM accs_limit_key_held k WHERE (k.service_id, k.key) IN (SELECT t.service_id, t.limit_key FROM accs_task t WHERE t.id = ANY(p_ids) AND t.limit_key IS NOT NULL AND t.status IN ('starting', 'running')) ORDER BY k.service_id, k.key FOR UPDATE;
    -- Starts of attempts still running (mark_running).
    IF cardinality(p_start_ids) > 0 THEN
        v_ids := p_start_ids;
        v_attempts := p_start_attempts;
        v_pids := p_start_pids;
        -- A job is running while a task of it is starting or running: the first start moves it from
-- waiting. Run just before the tasks' own start (same transaction, same fencing), so the timeline
-- reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[]) AS v(id, attempt)),
up AS (
    -- By the ids of the reported tasks' jobs: with "id IN (...)" a generic plan made from statistics that
    -- said few jobs wait (a burst that had ended) walked every waiting job instead, at every report.
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE id = ANY(ARRAY(SELECT t.job_id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
                           WHERE t.status = 'starting' AND t.claimed_by = p_agent))
       AND status = 'waiting'
    RETURNING id
)
SELECT v_job_moves || coalesce(jsonb_agg(jsonb_build_object('job_id', id, 'move', jsonb_build_object('from', 'waiting', 'to', 'running'))), '[]') INTO v_job_moves FROM up;
        WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[], v_pids::int[]) AS v(id, attempt, pid)),
run AS (
    UPDATE accs_task t SET status = 'running', started_at = v_now, updated_at = v_now
      FROM v WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = 'starting' AND t.claimed_by = p_agent
    RETURNING t.id, t.job_id, t.attempt, v.pid
),
att AS (
    UPDATE accs_attempt a SET pid = run.pid FROM run WHERE a.task_id = run.id AND a.attempt_no = run.attempt
)
SELECT v_moves || coalesce(jsonb_agg(x.move), '[]') INTO v_moves FROM (SELECT jsonb_build_object('id', nextval('accs_event_id_seq'), 'job_id', job_id, 'task_id', id, 'attempt', attempt, 'data', jsonb_strip_nulls(jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid))) AS move FROM run ORDER BY id) x;
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
            -- A job is running while a task of it is starting or running: the first start moves it from
-- waiting. Run just before the tasks' own start (same transaction, same fencing), so the timeline
-- reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[]) AS v(id, attempt)),
up AS (
    -- By the ids of the reported tasks' jobs: with "id IN (...)" a generic plan made from statistics that
    -- said few jobs wait (a burst that had ended) walked every waiting job instead, at every report.
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE id = ANY(ARRAY(SELECT t.job_id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
                           WHERE t.status = 'starting' AND t.claimed_by = p_agent))
       AND status = 'waiting'
    RETURNING id
)
SELECT v_job_moves || coalesce(jsonb_agg(jsonb_build_object('job_id', id, 'move', jsonb_build_object('from', 'waiting', 'to', 'running'))), '[]') INTO v_job_moves FROM up;
        END IF;
        -- Fenced by attempt: a report from an attempt that is no longer current changes nothing.
-- v_from is 'running', or 'starting' when the agent reports an attempt's start and end
-- together: the task then goes starting → done in one UPDATE, its move through running on the
-- timeline (the intermediate row version would be visible to no other transaction anyway). A task
-- the report finds already running (an earlier report of its start committed but its answer was
-- lost) goes running → done. "was" is the row as the statement found it.
WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[], v_results::text[], v_codes::int[],
                                v_outs::text[], v_errs::text[], v_pids::int[])
                  AS v(id, attempt, results, code, out, err, pid)),
done AS (
    UPDATE accs_task t SET status = 'done', results = v.results::jsonb, progress = 1, finished_at = v_now,
           started_at = coalesce(t.started_at, v_now), updated_at = v_now
      FROM v JOIN accs_task was ON was.id = v.id
     WHERE t.id = v.id AND t.attempt = v.attempt AND t.status IN (v_from, 'running')
    RETURNING t.id, t.job_id, t.attempt, v.code, v.out, v.err, v.pid, was.status AS was
),
att AS (
    UPDATE accs_attempt a SET status = 'succeeded', finished_at = v_now, exit_code = done.code,
           stdout_tail = done.out, stderr_tail = done.err, pid = coalesce(done.pid, a.pid)
      FROM done WHERE a.task_id = done.id AND a.attempt_no = done.attempt
)
SELECT coalesce(array_agg(x.id), '{}'), coalesce(array_agg(x.job_id), '{}'), v_moves || coalesce(jsonb_agg(x.move), '[]') INTO v_done, v_jobs, v_moves FROM (SELECT id, job_id, jsonb_build_object('id', nextval('accs_event_id_seq'), 'job_id', job_id, 'task_id', id, 'attempt', attempt,
           'data',
           CASE WHEN was = 'starting'
                THEN jsonb_strip_nulls(jsonb_build_object('from', 'starting', 'via', jsonb_build_array('running'),
                                                          'to', 'done', 'pid', pid))
                ELSE jsonb_build_object('from', 'running', 'to', 'done') END) AS move FROM done ORDER BY id) x;
        v_all_done := v_all_done || v_done;
        v_all_jobs := v_all_jobs || v_jobs;
    END LOOP;
    RETURN QUERY SELECT 'done', d::text FROM unnest(v_all_done) AS d;
    -- The jobs are finalized and every move of the report written, a row per task (jobs.finalize).
    IF cardinality(v_all_jobs) > 0 THEN
        RETURN QUERY SELECT 'notify', k FROM accs_finalize_and_write(
            ARRAY(SELECT DISTINCT j FROM unnest(v_all_jobs) AS j ORDER BY 1), v_now, p_source, false, v_moves,
            v_job_moves) AS k;
    ELSE
        WITH jm AS (
    SELECT m.job_id, true AS before, m.move FROM jsonb_to_recordset(v_job_moves::jsonb) AS m(job_id uuid, move jsonb)
), tm AS (SELECT * FROM jsonb_to_recordset(v_moves::jsonb) AS m(id bigint, job_id uuid, task_id uuid, attempt int, level text, data jsonb))
, tmo AS (
    SELECT tm.*, row_number() OVER (PARTITION BY tm.job_id ORDER BY tm.id, tm.task_id) AS i,
           count(*) OVER (PARTITION BY tm.job_id) AS n
      FROM tm
), jmv AS (
    SELECT jm.job_id,
           jsonb_agg(jm.move) FILTER (WHERE jm.before) AS before,
           jsonb_agg(jm.move) FILTER (WHERE NOT jm.before) AS after,
           max(CASE jm.move ->> 'level' WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END) FILTER (WHERE jm.before) AS before_rank,
           max(CASE jm.move ->> 'level' WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END) FILTER (WHERE NOT jm.before) AS after_rank
      FROM jm GROUP BY jm.job_id
), r AS (
    SELECT t.id, t.job_id, t.task_id, t.attempt, t.data, t.level,
           CASE WHEN t.i = 1 THEN j.before END AS before, CASE WHEN t.i = t.n THEN j.after END AS after,
           greatest(CASE t.level WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END, CASE WHEN t.i = 1 THEN j.before_rank END,
                    CASE WHEN t.i = t.n THEN j.after_rank END) AS rank
      FROM tmo t LEFT JOIN jmv j ON j.job_id = t.job_id
)
INSERT INTO accs_event (id, ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT coalesce(r.id, nextval('accs_event_id_seq')), v_now, r.job_id, r.task_id, r.attempt, p_source,
       (ARRAY['debug', 'info', 'warn', 'error'])[r.rank + 1], 'status',
       'task ' || (r.data ->> 'from') || ' → ' || (r.data ->> 'to')
       || coalesce(' (job ' || (coalesce(r.before, r.after) -> 0 ->> 'from') || ' → '
                   || (SELECT string_agg(m.move ->> 'to', ' → ' ORDER BY m.i)
                         FROM jsonb_array_elements(coalesce(r.before, '[]') || coalesce(r.after, '[]'))
                              WITH ORDINALITY AS m(move, i)) || ')', ''),
       r.data || jsonb_strip_nulls(jsonb_build_object('level', nullif(r.level, 'info'), 'job_before', r.before,
                                                      'job', r.after))
  FROM r
UNION ALL
SELECT nextval('accs_event_id_seq'), v_now, jm.job_id, NULL, NULL, p_source, coalesce(jm.move ->> 'level', 'info'), 'status',
       coalesce(jm.move ->> 'message', 'job ' || (jm.move ->> 'from') || ' → ' || (jm.move ->> 'to')),
       jm.move - 'message' - 'level'
  FROM jm WHERE jm.job_id NOT IN (SELECT tm.job_id FROM tm);
    END IF;
END
$report$;"""

_report_before = import_module("jobs.migrations.0045_key_counts_in_order")

DROP_FINALIZE = "DROP FUNCTION IF EXISTS accs_finalize_and_write(uuid[], timestamptz, text, bool, jsonb, jsonb)"


class Migration(migrations.Migration):
    dependencies = [("jobs", "0046_claims_probe_and_mark_what_they_fill")]

    operations = [
        migrations.RunSQL(FINALIZE, DROP_FINALIZE),
        migrations.RunSQL(REPORT, _report_before.REPORT),
    ]
