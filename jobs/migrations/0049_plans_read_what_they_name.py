"""The claim, the report and the finalization read the rows they name, whatever the tables held when planned.

Each statement of ``accs_report_succeeded`` and ``accs_finalize_and_write`` is planned once per server
connection. Where a statement joined its ids to a table, or named them with ``IN (...)``, a plan made
while the table was small (a connection's first report on a young or just emptied database) read the
whole primary key, or every unstarted task of every job, and kept doing so as the table grew: behind
12,800 queued tasks a report of 64 took 31-62 ms, 55 ms of it in the step that fails the rest of a job
whose fan-out failed, at every report, with no fan-out in sight. The statements now name their rows by
``= ANY(ARRAY(...))`` (the report's locks, the tasks' moves, the jobs' verdicts, the unstarted tasks
of a failed job) or by job (the waiting tasks a promotion looks at, task_job_open_idx), so a plan can
only read the rows asked for. The claim functions, as the report's already did, and the attempts' insert
trigger (a primary-key lookup, planned as a sequential scan of the nearly empty task table, once per
task claimed) run without sequential scans; the creation rows of narrow starts widened but not taken
(``accs_widen_starts``, the plain claim) read their tasks by job.

Safe under the previous release's daemons: every function keeps its name, arguments and results, and
``CREATE OR REPLACE FUNCTION`` takes no lock on a table. Frozen copies of the code's function texts (a
test compares the database's functions with the code); going back restores jobs.0040's trigger, jobs.0047's
report and finalization and jobs.0048's claims and widening.
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
   -- (The jobs read by id alone, then their status: OFFSET 0 keeps the status out of the read, where a plan
   -- made while few jobs were admitted read every admitted job through job_workflow_admitted_idx.)
   AND s.job_id = ANY(ARRAY(SELECT j.id FROM (SELECT id, status FROM accs_job WHERE id = ANY(p_jobs::uuid[])
                                               OFFSET 0) j
                             WHERE j.status IN ('running', 'waiting')))
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
      FROM accs_task w
     -- (The task's job by one probe of its primary key, LIMIT 1 keeping it a probe: joined, a plan made
     -- while the job table was nearly empty read all of it, and drove the tasks from it.)
     CROSS JOIN LATERAL (SELECT j.workflow_id FROM accs_job j WHERE j.id = w.job_id LIMIT 1) j
     CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'when'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = w.step_key
         LIMIT 1) #>> '{}' AS expr) cond
     WHERE w.status = 'waiting'
       -- (The jobs named first, so the waiting tasks are read by job, task_job_open_idx, and not every
       -- waiting task of every job: the alternatives below each name one of these jobs.)
       AND w.job_id = ANY(ARRAY(SELECT r.job_id FROM r) || v_roots::uuid[])
       AND (EXISTS (SELECT 1 FROM r WHERE r.job_id = w.job_id AND r.step_key = ANY(w.depends_on))
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
      FROM c WHERE t.id = ANY(ARRAY(SELECT c.id FROM c)) AND t.id = c.id
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
      FROM accs_task w
     -- (The task's job and step row by one probe each, as the condition's skip reads its job.)
     CROSS JOIN LATERAL (SELECT j.workflow_id FROM accs_job j WHERE j.id = w.job_id LIMIT 1) j
     CROSS JOIN LATERAL (SELECT js.max_items FROM accs_job_step js
                          WHERE js.job_id = w.job_id AND js.step_key = w.step_key LIMIT 1) js
     CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'fan_out'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = w.step_key
         LIMIT 1) ->> 'over' AS over) fo
     WHERE w.status = 'waiting'
       -- (The jobs named first, so the waiting tasks are read by job, task_job_open_idx, and not every
       -- waiting task of every job: the alternatives below each name one of these jobs.)
       AND w.job_id = ANY(ARRAY(SELECT r.job_id FROM r) || v_roots::uuid[])
       AND (EXISTS (SELECT 1 FROM r WHERE r.job_id = w.job_id AND r.step_key = ANY(w.depends_on))
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
      -- (The tasks by primary key, as every update here: joined alone to the few rows of v, a plan made while
      -- the table was small read the whole primary key, at every call, however few v held.)
      FROM v WHERE t.id = ANY(ARRAY(SELECT v.id FROM v)) AND t.id = v.id
    RETURNING t.id, t.job_id, t.step_key, t.status, t.error_message, v.n, v.over
), more AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT encode(int8send((greatest((extract(epoch FROM clock_timestamp()) * 1000)::bigint, ('x' || left(replace(w.id::text, '-', ''), 12))::bit(48)::bigint + 1) << 16) | 28672 | ((i)::bigint >> 30 & 4095)) || int8send(x'8000000000000000'::bit(64)::bigint | (((i)::bigint & 1073741823) << 32) | floor(random() * 4294967296)::bigint), 'hex')::uuid, w.job_id, w.tenant_id, w.step_key || '[' || i || ']', w.step_key,
           w.service_id, w.host_id, w.exclusive, 'waiting', w.depends_on, 0, w.max_attempts, p_now, w.priority,
           w.order_seq, w.timeout_seconds, w.params, w.assigned_node, '', '', '', '', p_now, p_now
      FROM v JOIN accs_task w ON w.id = v.id AND w.id = ANY(ARRAY(SELECT v.id FROM v))
     CROSS JOIN LATERAL generate_series(1, v.n - 1) AS i
     WHERE v.failure IS NULL AND v.n > 1
     ORDER BY w.id, i
), grow AS (
    UPDATE accs_job_step s SET total = s.total + v.n - 1
      FROM v WHERE s.job_id = v.job_id AND s.step_key = v.step_key AND v.failure IS NULL AND v.n > 1
), rest AS (
    -- A failed fan-out of an on_failure "fail_job" step fails its job as a failed task does (jobs.failure):
    -- the job's other unstarted tasks are skipped (halt), except those of "always" steps. (Read by job,
    -- task_job_open_idx: "IN (...)" let a plan read every unstarted task of every job.)
    SELECT u.id, u.status AS was FROM accs_task u
     WHERE u.job_id = ANY(ARRAY(SELECT v.job_id FROM v JOIN accs_job_step js ON js.job_id = v.job_id
                                                      AND js.step_key = v.step_key
                               WHERE v.failure IS NOT NULL AND js.on_failure = 'fail_job'))
       AND u.status IN ('queued', 'scheduled', 'waiting') AND NOT EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = u.job_id AND own.step_key = u.step_key AND own.always)
       AND u.id NOT IN (SELECT id FROM v)
), halt AS (
    UPDATE accs_task o SET status = 'skipped', finished_at = p_now, updated_at = p_now,
           error_message = 'job failed'
     -- (By primary key alone, as the claim's update; each task's status before comes from rest. Joined to
     -- rest, a plan could read every named task once per task of rest: a failed job's thousands.)
     WHERE o.id = ANY(ARRAY(SELECT x.id FROM rest x))
    RETURNING o.id, o.job_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT h.job_id, h.id, p_source, 'warn', 'status', 'task ' || x.was || ' → skipped (job failed)',
           jsonb_build_object('from', x.was, 'to', 'skipped', 'reason', 'job failed')
      FROM halt h JOIN rest x ON x.id = h.id
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
       -- (The jobs named first, so the waiting tasks are read by job, task_job_open_idx, and not every
       -- waiting task of every job: the alternatives below each name one of these jobs.)
       AND w.job_id = ANY(ARRAY(SELECT r.job_id FROM r) || v_roots::uuid[])
       AND (EXISTS (SELECT 1 FROM r WHERE r.job_id = w.job_id AND r.step_key = ANY(w.depends_on))
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
     -- (The jobs by primary key: joined alone, a generic plan made while the table was small read the
     -- whole primary key at every call.)
     WHERE j.id = ANY(p_jobs::uuid[])
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
      -- (Each job by its primary key, one probe per verdict: written as a range, the condition cannot be
      -- hashed or merged, so no plan can read the whole primary key to join it, as one made while the
      -- table was nearly empty did at every call; "= ANY" beside the join let a plan read every named
      -- job for each verdict instead.)
      FROM verdict v WHERE j.id >= v.job_id AND j.id <= v.job_id
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
    -- (Each statement reads its rows by their ids, "= ANY(ARRAY(...))": a join or "IN (...)" let a plan made
    -- while the table was small read the whole primary key instead, at every report.)
    PERFORM 1 FROM accs_job
     WHERE id = ANY(ARRAY(SELECT t.job_id FROM accs_task t WHERE t.id = ANY(p_ids || p_start_ids)))
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
    -- By the ids of the reported tasks' jobs, and their status read after them (OFFSET 0): with
    -- "id IN (...)", or the status beside the ids, a generic plan made from statistics that said few jobs
    -- wait (a burst that had ended) walked every waiting job instead, at every report. The caller holds
    -- the jobs' locks, so the status read is the one updated.
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE id = ANY(ARRAY(SELECT j.id
                            FROM (SELECT j.id, j.status FROM accs_job j
                                   WHERE j.id = ANY(ARRAY(SELECT t.job_id FROM accs_task t
                                                            JOIN v ON v.id = t.id AND v.attempt = t.attempt
                                                           WHERE t.id = ANY(v_ids::uuid[])
                                                             AND t.status = 'starting' AND t.claimed_by = p_agent))
                                  OFFSET 0) j
                           WHERE j.status = 'waiting'))
    RETURNING id
)
SELECT v_job_moves || coalesce(jsonb_agg(jsonb_build_object('job_id', id, 'move', jsonb_build_object('from', 'waiting', 'to', 'running'))), '[]') INTO v_job_moves FROM up;
        WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[], v_pids::int[]) AS v(id, attempt, pid)),
run AS (
    UPDATE accs_task t SET status = 'running', started_at = v_now, updated_at = v_now
      FROM v WHERE t.id = ANY(v_ids::uuid[]) AND t.id = v.id AND t.attempt = v.attempt AND t.status = 'starting'
       AND t.claimed_by = p_agent
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
    -- By the ids of the reported tasks' jobs, and their status read after them (OFFSET 0): with
    -- "id IN (...)", or the status beside the ids, a generic plan made from statistics that said few jobs
    -- wait (a burst that had ended) walked every waiting job instead, at every report. The caller holds
    -- the jobs' locks, so the status read is the one updated.
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE id = ANY(ARRAY(SELECT j.id
                            FROM (SELECT j.id, j.status FROM accs_job j
                                   WHERE j.id = ANY(ARRAY(SELECT t.job_id FROM accs_task t
                                                            JOIN v ON v.id = t.id AND v.attempt = t.attempt
                                                           WHERE t.id = ANY(v_ids::uuid[])
                                                             AND t.status = 'starting' AND t.claimed_by = p_agent))
                                  OFFSET 0) j
                           WHERE j.status = 'waiting'))
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
     -- (By primary key, as the claim's update: a join alone let a generic plan made while the table was
     -- small merge the reported tasks with the whole primary key.)
     WHERE t.id = ANY(v_ids::uuid[]) AND was.id = ANY(v_ids::uuid[])
       AND t.id = v.id AND t.attempt = v.attempt AND t.status IN (v_from, 'running')
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

CLAIM = r"""CREATE OR REPLACE FUNCTION accs_claim_plain(
    p_svc_ids bigint[], p_weights int[], p_adjust int[], p_node_caps int[], p_channels text[],
    p_node text, p_agent text, p_pid int, p_source text, p_now timestamptz, p_free int, p_slot_cap int,
    p_cpu_budget int, p_lease float8, p_blocked bigint[], p_exclude uuid[], p_promote_limit int,
    p_try_capped boolean)
RETURNS TABLE (id uuid, job_id uuid, task_key text, attempt int, params jsonb, timeout_seconds int,
               host text, service_id bigint, lease float8, left_out text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement, made at its first call: planning a custom plan
-- at every call (the default until PostgreSQL trusts a generic one) is what the function is for
-- avoiding. The claim statement's shape does not depend on its parameters' values (ids go through
-- arrays, scans are bounded per service), so the generic plan is the plan.
SET plan_cache_mode = force_generic_plan
-- No JIT: a generic plan cannot see the scans' limits, so its estimated cost passes jit_above_cost
-- once the backlog is large (100k queued) and every call would compile its expressions
-- (1.4 s) to run them on a few rows.
SET jit = off
-- No sorts where an index gives the order: the generic plan is made from the statistics of the
-- connection's first call, and statistics go stale (after a TRUNCATE, or a backlog that came and
-- went since the last ANALYZE say nothing is queued). Trusting them, the plan read each host's
-- head through task_job_open_idx (every queued task, sorted per host: 0.2 ms a host, 150 ms a
-- claim on a 500-host node) instead of task_claim_host_idx (one descent, in claim order). The
-- sorts no index can give (a few rows) are still made.
SET enable_sort = off
-- No sequential scans, as the report's and the finalization's functions: a plan made while the task table
-- was nearly empty read the whole table for the node's held tasks, the services' held counts and the due
-- retries, at every claim, for as long as the connection lived (the tables grew under it).
SET enable_seqscan = off
AS $claim$
#variable_conflict use_column
DECLARE
    v_stamp timestamptz;
    v_promoted bigint[];
    v_created uuid[] := '{}';  -- jobs this call made of narrow starts whose creation the claim's rows carry
    v_limited bigint[];
    v_capped bigint[];
    v_caps int[];
    v_full bigint[];  -- services left out: nothing queued, a capped one's cap full, or its lock busy
    v_busy bigint[] := '{}';  -- capped services whose lock another claimer held
    v_hosts_all int;
    v_hosts_ok int;
    v_hosts bigint[];
    v_held int;
    v_held_cpu int;
    v_slots int;
    v_cpu int;
    v_ids bigint[];
    v_rooms int[];
    v_weights int[];
    v_adjust int[];
    v_leases jsonb;
    v_texts text[];
    v_zeros int[];
    v_falses bool[];
BEGIN
    -- Retries of these services whose backoff is over (the builder's promotion, PROMOTE_DUE_SQL).
    WITH due AS (
        SELECT id FROM accs_task
         WHERE status = 'scheduled' AND next_attempt_at <= coalesce(p_now::timestamptz, now())
           AND (p_svc_ids::bigint[] IS NULL
                OR service_id = ANY(p_svc_ids::bigint[]))
         ORDER BY next_attempt_at LIMIT p_promote_limit
           FOR UPDATE SKIP LOCKED
    ), up AS (
        -- (By primary key: joined to due, a plan made while the table was nearly empty read all of it.)
        UPDATE accs_task t SET status = 'queued', updated_at = now() WHERE t.id = ANY(ARRAY(SELECT id FROM due))
        RETURNING t.id, t.job_id, t.attempt, t.service_id
    ), ev AS (
        INSERT INTO accs_event (job_id, task_id, attempt, source, level, type, message, data)
        SELECT job_id, id, attempt, p_source, 'info', 'status', 'task scheduled → queued (backoff over)',
               '{"from": "scheduled", "to": "queued"}'::jsonb FROM up
    )
    SELECT array_agg(DISTINCT up.service_id) INTO v_promoted FROM up;
    IF v_promoted IS NOT NULL THEN
        PERFORM pg_notify(c.ch, '') FROM (SELECT DISTINCT x.ch FROM unnest(p_channels, p_svc_ids) AS x(ch, sid)
                                          WHERE x.sid = ANY(v_promoted) ORDER BY 1) c;
    END IF;
    IF p_free > 0 THEN
        v_created := accs_widen_starts(NULL, p_svc_ids, p_free, NULL, NULL, false);
    END IF;
    -- The services as the database holds them now: one with a rate or per-key limit is not claimed
    -- here; a capped one is, under its lock, with the cap read now.
    SELECT coalesce(array_agg(s.id), '{}') INTO v_limited FROM accs_service s
     WHERE s.id = ANY(p_svc_ids) AND (s.rate_limit > 0 OR s.rate_key_limit > 0 OR s.concurrency_key_limit > 0);
    -- A look at the services without any lock: one with no queued task this node could take has
    -- nothing to claim now (a new task's NOTIFY wakes the claimers again), and a capped one whose
    -- cap is full now stays full for this claim (claims only fill it; a finish frees room for the
    -- next claim). Either is left out of this claim, so its claimers do not queue for a lock only
    -- to find nothing (task_claim_idx, task_claim_host_idx, task_held_service_idx).
    -- (OFFSET 0 keeps each count a single evaluation: flattened into the aggregates' filters, it
    -- would be counted once per filter. The held tasks are counted only when some are queued.)
    SELECT coalesce(array_agg(c.id) FILTER (WHERE c.room AND c.cap > 0), '{}'),
           coalesce(array_agg(c.cap) FILTER (WHERE c.room AND c.cap > 0), '{}'),
           coalesce(array_agg(c.id) FILTER (WHERE NOT c.room), '{}')
      INTO v_capped, v_caps, v_full
      FROM (SELECT s.id, s.max_concurrent AS cap,
                   (coalesce((SELECT true FROM accs_task t
                     WHERE t.service_id = s.id AND t.status = 'queued' AND t.host_id IS NULL
                     ORDER BY t.service_id, t.tenant_id LIMIT 1), false)
            OR EXISTS (SELECT 1 FROM accs_host h
                        WHERE h.node_id = p_node
                          AND coalesce((SELECT true FROM accs_task t
                                         WHERE t.host_id = h.id AND t.service_id = s.id AND t.status = 'queued'
                                         ORDER BY t.host_id, t.service_id LIMIT 1), false)))
                   AND (s.max_concurrent <= 0
                        OR (SELECT count(*) FROM accs_task t
                             WHERE t.status IN ('starting', 'running') AND t.service_id = s.id) < s.max_concurrent)
                   AS room
              FROM accs_service s
             WHERE s.id = ANY(p_svc_ids) AND s.id <> ALL(v_limited)
            OFFSET 0) c;
    -- Nothing to claim when every service was left out (the usual idle poll): no lock, no scan.
    <<claiming>>
    BEGIN
        EXIT claiming WHEN cardinality(v_limited) + cardinality(v_full) >= cardinality(p_svc_ids);
        IF p_try_capped THEN
            -- Behind a pooler: the node's lock ('accs:node:<name>', shared by the node's agents only)
            -- is waited for, holding no other meanwhile; each capped service's ('accs:service:<id>'),
            -- shared by every claimer of the fleet, is only tried. A service whose lock another
            -- claimer holds is left out of this claim and named in the answer ('busy'), and the
            -- caller claims again a moment later: in line for it, each claimer would hold one of the
            -- pool's few server connections through the wait, and the reports would queue behind
            -- them. A try never waits, so it adds no lock-order cycle.
            PERFORM pg_advisory_xact_lock(k.h) FROM (SELECT DISTINCT hashtext(x.key) AS h FROM unnest(ARRAY['accs:node:' || p_node]) AS x(key) ORDER BY 1) k;
            SELECT coalesce(array_agg(c.id) FILTER (WHERE NOT c.got), '{}') INTO v_busy
              FROM (SELECT c.id, pg_try_advisory_xact_lock(hashtext('accs:service:' || c.id)) AS got
                      FROM unnest(v_capped) AS c(id) OFFSET 0) c;
        ELSE
            -- Direct: the node's and each capped service's lock, waited for as
            -- jobs.locks.advisory_locks takes them (sorted by key hash). A waiter sleeps on its own
            -- connection; claimers retrying instead would take the CPU the lock's holder needs.
            PERFORM pg_advisory_xact_lock(k.h) FROM (SELECT DISTINCT hashtext(x.key) AS h FROM unnest(ARRAY['accs:node:' || p_node] || ARRAY(SELECT 'accs:service:' || c FROM unnest(v_capped) AS c)) AS x(key) ORDER BY 1) k;
        END IF;
        -- Under the locks, the look for queued work again: the claimer that held a service's lock
        -- before this one may have taken all of it.
        SELECT v_full || v_busy
               || coalesce(array_agg(c.id) FILTER (WHERE NOT (coalesce((SELECT true FROM accs_task t
                     WHERE t.service_id = c.id AND t.status = 'queued' AND t.host_id IS NULL
                     ORDER BY t.service_id, t.tenant_id LIMIT 1), false)
            OR EXISTS (SELECT 1 FROM accs_host h
                        WHERE h.node_id = p_node
                          AND coalesce((SELECT true FROM accs_task t
                                         WHERE t.host_id = h.id AND t.service_id = c.id AND t.status = 'queued'
                                         ORDER BY t.host_id, t.service_id LIMIT 1), false)))), '{}')
          INTO v_full FROM unnest(v_capped) AS c(id) WHERE c.id <> ALL(v_busy);
        EXIT claiming WHEN cardinality(v_limited) + cardinality(v_full) >= cardinality(p_svc_ids);
        v_stamp := coalesce(p_now, clock_timestamp());
        SELECT count(*), count(*) FILTER (WHERE h.status = 'ok'),
               coalesce(array_agg(h.id) FILTER (WHERE h.status = 'ok' AND h.id <> ALL(p_blocked)), '{}')
          INTO v_hosts_all, v_hosts_ok, v_hosts
          FROM accs_host h WHERE h.node_id = p_node;
        -- Held tasks on this node (task_held_node_idx), as HELD_SQL counts them.
        SELECT count(*), coalesce(sum(s.cpu_weight), 0) INTO v_held, v_held_cpu
          FROM accs_task t JOIN accs_service s ON s.id = t.service_id
         WHERE t.status IN ('starting', 'running') AND t.node = p_node;
        v_slots := least(p_free,
                         CASE WHEN v_hosts_all > 0 THEN least(p_slot_cap, v_hosts_ok) ELSE p_slot_cap END - v_held);
        v_cpu := p_cpu_budget - v_held_cpu;
        IF v_slots > 0 THEN
            -- Each service's room (service_room): the node's slots and CPU, its per-node cap, and its
            -- fleet-wide cap as the look read it, less what the whole fleet holds now (under its lock).
            SELECT array_agg(r.id ORDER BY r.ord), array_agg(r.room ORDER BY r.ord), array_agg(r.weight ORDER BY r.ord),
                   array_agg(r.adjust ORDER BY r.ord),
                   coalesce(jsonb_object_agg(r.id::text, r.lease::float8) FILTER (WHERE r.lease > 0), '{}')
              INTO v_ids, v_rooms, v_weights, v_adjust, v_leases
              FROM (SELECT u.id, u.ord, greatest(u.weight, 1) AS weight, u.adjust, s.lease_seconds AS lease,
                           least(v_slots, v_cpu / greatest(u.weight, 1),
                                 CASE WHEN u.cap > 0 THEN u.cap - (SELECT count(*) FROM accs_task t
                                                                    WHERE t.status IN ('starting', 'running')
                                                                      AND t.node = p_node AND t.service_id = u.id)
                                 END,
                                 (SELECT c.cap - (SELECT count(*) FROM accs_task t
                                                   WHERE t.status IN ('starting', 'running') AND t.service_id = u.id)
                                    FROM unnest(v_capped, v_caps) AS c(id, cap) WHERE c.id = u.id)) AS room
                      FROM unnest(p_svc_ids, p_weights, p_adjust, p_node_caps) WITH ORDINALITY
                           AS u(id, weight, adjust, cap, ord)
                      JOIN accs_service s ON s.id = u.id
                     WHERE u.id <> ALL(v_limited) AND u.id <> ALL(v_full)
                    OFFSET 0) r  -- each count once (the filter below would repeat them)
             WHERE r.room > 0;
            IF v_ids IS NOT NULL THEN
                v_texts := array_fill(''::text, ARRAY[cardinality(v_ids)]);
                v_zeros := array_fill(0, ARRAY[cardinality(v_ids)]);
                v_falses := array_fill(false, ARRAY[cardinality(v_ids)]);
                RETURN QUERY
WITH RECURSIVE svc AS (
    -- (A key path as an array once, not once per task a scan passes over.)
    SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
      FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                         v_rooms::int[], v_texts::text[], v_zeros::int[], v_texts::text[],
                         v_zeros::int[], v_zeros::int[], v_falses::bool[])
             AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
), tenant_heads AS (
    -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
    -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
    -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
    SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                   WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                   ORDER BY t.tenant_id LIMIT 1) AS tenant_id
      FROM svc
    UNION ALL
    SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                           WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                             AND t.tenant_id > q.tenant_id
                           ORDER BY t.tenant_id LIMIT 1)
      FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
), paused_tenants AS MATERIALIZED (
    -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
    -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
    -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
    -- tenant) passes over its tasks bound to this node's hosts one by one.
    SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
), queued_tenants AS (
    SELECT q.service_id, q.tenant_id FROM tenant_heads q
     WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
), free AS (
    -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
    -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
    -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
    -- take the same row.
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
        SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at
          FROM accs_task t
         WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
           AND t.next_attempt_at <= v_stamp
           -- Tasks this agent still runs (an older attempt it has not finished) are never
           -- claimed by it again: its own late finish would otherwise race the new attempt.
           AND t.id <> ALL(p_exclude::uuid[])
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT svc.scan
           FOR UPDATE OF t SKIP LOCKED) c
), bound_seen AS (
    -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
    -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
    -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
        SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
               t.created_at
          FROM accs_task t
         WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
           AND t.next_attempt_at <= v_stamp
           AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
           AND t.id <> ALL(p_exclude::uuid[])
           -- Exclusive work: not while another exclusive task is held on the host (served by
           -- the partial unique index task_one_held_per_exclusive_host).
           AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                               AND x.status IN ('starting', 'running')))
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT svc.scan) c
), bound AS (
    -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
    -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
    -- locked (a row another claimer took since it was read is passed over).
    SELECT b.* FROM bound_seen b JOIN (
        SELECT t.id FROM accs_task t
         WHERE t.id = ANY(ARRAY(SELECT r.id
                                  FROM (SELECT s.id, s.service_id,
                                               row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                  ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                           s.id) AS nth
                                          FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                 WHERE r.nth <= svc.scan))
           AND t.status = 'queued'
         ORDER BY t.id
           FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
), cand AS (
    SELECT * FROM free UNION ALL SELECT * FROM bound
), turns AS (
    -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
    -- then each one's second...), and within a turn the tenant served least recently goes first.
    SELECT src.*, tn.served_at, svc.room,
           row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                              ORDER BY src.order_seq, src.created_at, src.id) AS turn
      FROM cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
), fair AS (
    -- Each tenant's scan read up to the service's room, so no more than the room per service,
    -- taken in the fair order.
    SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                       ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                created_at, id) AS srank
      FROM turns
), ranked AS (
    SELECT src.*,
           row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                              ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
               AS host_rank,
           row_number() OVER w AS n, sum(weight) OVER w AS cpu
      FROM fair src
     WHERE srank <= room
    WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
), pick AS (
    -- One global order across the services; the node's slot and CPU room taken in that order;
    -- an exclusive host gets one task per claim.
    SELECT id FROM ranked
     WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
), upd AS (
    UPDATE accs_task t
       SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
           claimed_at = v_stamp,
           -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
           -- lease_expires_at - heartbeat_at).
           lease_expires_at = v_stamp + make_interval(
               secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
           heartbeat_at = v_stamp, updated_at = v_stamp,
           cancel_requested_at = NULL, started_at = NULL
     -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
     -- read the whole task table.
     WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
    RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
              t.priority, t.order_seq, t.created_at, t.tenant_id
), served AS (
    -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
    -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
    -- skipped, never waited for (its mark is as recent).
    UPDATE accs_tenant tn SET served_at = v_stamp
     WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                 ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
       AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
), att AS (
    INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                              stderr_tail, error_text)
    SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
      FROM upd
), ev AS (
    -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
    -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
    -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
    -- start to claim.
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
           CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                ELSE 'task queued → starting' END,
           jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
           || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                  'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                  'task_key', upd.task_key))
              ELSE '{}'::jsonb END
      FROM upd
)
SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
       coalesce((v_leases ->> upd.service_id::text)::float8, p_lease), NULL::text
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
            END IF;
        END IF;
    END claiming;
    -- The starts this call widened but did not take: their creation rows (jobs.narrow).
    IF cardinality(v_created) > 0 THEN
        INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
        SELECT j.created_at, j.id, 'api:' || j.source, 'info', 'status', 'job created waiting, 1 task queued',
               jsonb_build_object('from', 'created', 'to', 'waiting', 'approval', 'not_required',
                                  'tasks', jsonb_build_array(jsonb_build_object('id', t.id::text, 'task_key', t.task_key,
                                                                                'to', 'queued')))
          FROM accs_job j JOIN accs_task t ON t.job_id = j.id
         -- (The tasks by their jobs too: joined alone, a plan made while the task table was nearly empty read
         -- all of task_job_key_unique for them, at every claim that widened a start it did not take.)
         WHERE j.id = ANY(v_created) AND t.job_id = ANY(v_created) AND t.attempt = 0
         ORDER BY j.id;
    END IF;
    -- The services left out for the caller to handle, each as a row without a task: those with a
    -- rate or per-key limit ('limited': the general path claims them) and the capped ones whose lock
    -- was busy ('busy': claim them again soon).
    RETURN QUERY SELECT NULL::uuid, NULL::uuid, NULL::text, NULL::int, NULL::jsonb, NULL::int, NULL::text, l.id,
                        NULL::float8, l.why
                   FROM (SELECT x, 'limited' FROM unnest(v_limited) AS x
                         UNION ALL SELECT x, 'busy' FROM unnest(v_busy) AS x) AS l(id, why);
END
$claim$;"""

KEYED_CLAIM = r"""CREATE OR REPLACE FUNCTION accs_claim_keyed(
    p_svc_ids bigint[], p_weights int[], p_adjust int[], p_node_caps int[], p_channels text[],
    p_node text, p_agent text, p_pid int, p_source text, p_now timestamptz, p_free int, p_slot_cap int,
    p_cpu_budget int, p_lease float8, p_blocked bigint[], p_exclude uuid[], p_promote_limit int)
RETURNS TABLE (id uuid, job_id uuid, task_key text, attempt int, params jsonb, timeout_seconds int,
               host text, service_id bigint, lease float8)
LANGUAGE plpgsql VOLATILE
-- Planned once per server connection, never compiled, and no sort where an index gives the order
-- (stale statistics cannot turn a head's probe into a sort of the backlog): as the plain claim
-- function (jobs.claim); no sequential scans either.
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_sort = off
SET enable_seqscan = off
AS $claim$
#variable_conflict use_column
DECLARE
    v_stamp timestamptz;
    v_promoted bigint[];
    v_created uuid[] := '{}';  -- jobs this call made of narrow starts whose creation the claim's rows carry
    v_pass int;
    v_hosts_all int;
    v_hosts_ok int;
    v_hosts bigint[];
    v_held int;
    v_held_cpu int;
    v_slots int;
    v_cpu int;
    v_ids bigint[] := p_svc_ids;  -- the services still in this claim
    v_rooms int[];
    v_weights int[];
    v_adjust int[];
    v_scans int[];
    v_rpaths text[];
    v_rlimits int[];
    v_cpaths text[];
    v_climits int[];
    v_periods int[];
    v_rated bool[];
    v_leases jsonb;
    v_keyed bigint[];  -- the services with a per-key limit
    v_kinds text;  -- the kinds of per-key limit among them: 'c' a cap, 'r' a rate (KEYED_CLAIM_STATEMENTS)
    v_any_rated boolean;  -- whether any of the services records its starts
BEGIN
    -- Retries of these services whose backoff is over (the builder's promotion, PROMOTE_DUE_SQL).
    WITH due AS (
        SELECT id FROM accs_task
         WHERE status = 'scheduled' AND next_attempt_at <= coalesce(p_now::timestamptz, now())
           AND (p_svc_ids::bigint[] IS NULL
                OR service_id = ANY(p_svc_ids::bigint[]))
         ORDER BY next_attempt_at LIMIT p_promote_limit
           FOR UPDATE SKIP LOCKED
    ), up AS (
        -- (By primary key: joined to due, a plan made while the table was nearly empty read all of it.)
        UPDATE accs_task t SET status = 'queued', updated_at = now() WHERE t.id = ANY(ARRAY(SELECT id FROM due))
        RETURNING t.id, t.job_id, t.attempt, t.service_id
    ), ev AS (
        INSERT INTO accs_event (job_id, task_id, attempt, source, level, type, message, data)
        SELECT job_id, id, attempt, p_source, 'info', 'status', 'task scheduled → queued (backoff over)',
               '{"from": "scheduled", "to": "queued"}'::jsonb FROM up
    )
    SELECT array_agg(DISTINCT up.service_id) INTO v_promoted FROM up;
    IF v_promoted IS NOT NULL THEN
        PERFORM pg_notify(c.ch, '') FROM (SELECT DISTINCT x.ch FROM unnest(p_channels, p_svc_ids) AS x(ch, sid)
                                          WHERE x.sid = ANY(v_promoted) ORDER BY 1) c;
    END IF;
    IF p_free > 0 THEN
        PERFORM accs_widen_starts(NULL, p_svc_ids, p_free, NULL, NULL, true);
    END IF;
    -- Pass 1, without any lock, only when a service has a fleet-wide cap or a service-wide rate: a
    -- limit full now stays full for this claim (claims only fill it; a finish or the passing window
    -- frees room for the next claim), so a claimer that finds no room does not queue behind all the
    -- others for the lock, and the services without room are left out of it. (Whether a key has
    -- room is for the claim statement to find.) Pass 2, under the locks: the counts are exact.
    FOR v_pass IN 1..2 LOOP
        IF v_pass = 2 THEN
            -- The node's lock and each fleet-limited service's (a cap, a rate, a per-key limit),
            -- shared with every claimer of it, waited for as jobs.locks.advisory_locks takes them.
            PERFORM pg_advisory_xact_lock(k.h) FROM (SELECT DISTINCT hashtext(x.key) AS h FROM unnest(ARRAY['accs:node:' || p_node] || ARRAY(SELECT 'accs:service:' || s.id FROM accs_service s WHERE s.id = ANY(v_ids) AND (s.max_concurrent > 0 OR s.rate_limit > 0 OR s.rate_key_limit > 0 OR s.concurrency_key_limit > 0))) AS x(key) ORDER BY 1) k;
        ELSIF NOT EXISTS (SELECT 1 FROM accs_service s
                           WHERE s.id = ANY(v_ids) AND (s.max_concurrent > 0 OR s.rate_limit > 0)) THEN
            CONTINUE;
        END IF;
        v_stamp := coalesce(p_now, clock_timestamp());
        SELECT count(*), count(*) FILTER (WHERE h.status = 'ok'),
               coalesce(array_agg(h.id) FILTER (WHERE h.status = 'ok' AND h.id <> ALL(p_blocked)), '{}')
          INTO v_hosts_all, v_hosts_ok, v_hosts
          FROM accs_host h WHERE h.node_id = p_node;
        -- Held tasks on this node (task_held_node_idx), as HELD_SQL counts them.
        SELECT count(*), coalesce(sum(s.cpu_weight), 0) INTO v_held, v_held_cpu
          FROM accs_task t JOIN accs_service s ON s.id = t.service_id
         WHERE t.status IN ('starting', 'running') AND t.node = p_node;
        v_slots := least(p_free,
                         CASE WHEN v_hosts_all > 0 THEN least(p_slot_cap, v_hosts_ok) ELSE p_slot_cap END - v_held);
        v_cpu := p_cpu_budget - v_held_cpu;
        IF v_slots <= 0 THEN
            RETURN;
        END IF;
        SELECT array_agg(r.id ORDER BY r.ord), array_agg(r.room ORDER BY r.ord),
               array_agg(r.weight ORDER BY r.ord), array_agg(r.adjust ORDER BY r.ord),
               array_agg(CASE WHEN r.climit > 0 OR r.rlimit > 0 THEN least(r.room * 4 + 16, 1000) ELSE r.room END
                         ORDER BY r.ord),
               array_agg(r.rpath ORDER BY r.ord), array_agg(r.rlimit ORDER BY r.ord),
               array_agg(r.cpath ORDER BY r.ord), array_agg(r.climit ORDER BY r.ord),
               array_agg(r.period ORDER BY r.ord), array_agg(r.rate > 0 OR r.rlimit > 0 ORDER BY r.ord),
               coalesce(jsonb_object_agg(r.id::text, r.lease::float8) FILTER (WHERE r.lease > 0), '{}'),
               coalesce(array_agg(r.id ORDER BY r.ord) FILTER (WHERE r.climit > 0 OR r.rlimit > 0), '{}')
          INTO v_ids, v_rooms, v_weights, v_adjust, v_scans, v_rpaths, v_rlimits, v_cpaths, v_climits, v_periods,
               v_rated, v_leases, v_keyed
          FROM (SELECT u.id, u.ord, greatest(u.weight, 1) AS weight, u.adjust, s.lease_seconds AS lease,
                       s.rate_key AS rpath, s.rate_key_limit AS rlimit, s.concurrency_key AS cpath,
                       s.concurrency_key_limit AS climit, s.rate_period_seconds AS period, s.rate_limit AS rate,
                       least(v_slots, v_cpu / greatest(u.weight, 1),
                             CASE WHEN u.cap > 0 THEN u.cap - (SELECT count(*) FROM accs_task t
                                                                WHERE t.status IN ('starting', 'running')
                                                                  AND t.node = p_node AND t.service_id = u.id)
                             END,
                             CASE WHEN s.max_concurrent > 0 THEN s.max_concurrent - (
                                 SELECT count(*) FROM accs_task t
                                  WHERE t.status IN ('starting', 'running') AND t.service_id = u.id)
                             END,
                             CASE WHEN s.rate_limit > 0 THEN s.rate_limit - (
                                 SELECT count(*) FROM accs_rate_start r
                                  WHERE r.service_id = u.id
                                    AND r.at > v_stamp - make_interval(secs => s.rate_period_seconds))
                             END) AS room
                  FROM unnest(p_svc_ids, p_weights, p_adjust, p_node_caps) WITH ORDINALITY
                       AS u(id, weight, adjust, cap, ord)
                  JOIN accs_service s ON s.id = u.id
                 WHERE u.id = ANY(v_ids)
                OFFSET 0) r  -- each count once (the filter below would repeat them)
         WHERE r.room > 0;
        IF v_ids IS NULL THEN
            RETURN;
        END IF;
    END LOOP;
    IF cardinality(v_keyed) > 0 THEN
        -- Rate blocks that have run out: their keys are walked again (limit_key_head_rate_until_idx).
        UPDATE accs_limit_key_head h SET rate_until = NULL
         WHERE h.service_id = ANY(v_keyed) AND h.rate_until IS NOT NULL AND h.rate_until <= v_stamp;
    END IF;
    v_kinds := CASE WHEN 0 < ANY(v_climits) THEN 'c' ELSE '' END || CASE WHEN 0 < ANY(v_rlimits) THEN 'r' ELSE '' END;
    v_any_rated := true = ANY(v_rated) OR v_kinds IN ('r', 'cr');
    IF v_kinds = 'cr' AND v_any_rated = true THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    )
    , cused AS MATERIALIZED (
        SELECT k.service_id, k.key, k.held AS used
          FROM svc JOIN accs_limit_key_held k ON k.service_id = svc.id AND k.held > 0
         WHERE svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
        UNION ALL
        SELECT h.service_id, coalesce(h.params #>> svc.cparts, '') AS key, count(*) AS used
          FROM svc JOIN accs_task h ON h.service_id = svc.id AND h.status IN ('starting', 'running')
         WHERE svc.climit > 0
           AND svc.cpath IS DISTINCT FROM accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
         GROUP BY 1, 2
    ), cfull AS MATERIALIZED (
        SELECT u.service_id, u.key FROM cused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.climit
    )
    , rused AS MATERIALIZED (
        SELECT r.service_id, r.key, count(*) AS used
          FROM svc JOIN accs_rate_start r ON r.service_id = svc.id
                                         AND r.at > v_stamp - make_interval(secs => svc.period)
         WHERE svc.rlimit > 0 AND r.key IS NOT NULL
         GROUP BY 1, 2
    ), rfull AS MATERIALIZED (
        SELECT u.service_id, u.key FROM rused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.rlimit
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    )
    , kheads AS MATERIALIZED (
        SELECT q.service_id, q.tenant_id, h.id AS hid, h.key, h.priority, h.order_seq, h.created_at, h.task_id
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT h.id, h.service_id, h.key, h.priority, h.order_seq, h.created_at, h.task_id
              FROM accs_limit_key_head h
             WHERE h.service_id = svc.id AND h.tenant_id = q.tenant_id AND NOT h.emptied
               AND NOT h.cap_full AND h.rate_until IS NULL
             ORDER BY h.priority DESC, h.order_seq, h.created_at, h.task_id
             LIMIT svc.room + 8) h
         WHERE q.tenant_id IS NOT NULL AND (svc.climit > 0 OR svc.rlimit > 0)
    ), kkeys AS MATERIALIZED (
        -- Each key's room under its cap (cleft) and its rate (rleft), and the nearer of the two (kleft).
        SELECT r.*, least(r.cleft, r.rleft) AS kleft
          FROM (SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key,
                       CASE WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.climit - coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (h.key COLLATE "C")), 0) END AS cleft, CASE WHEN svc.rlimit > 0 AND svc.rpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.rlimit - (SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = (h.key COLLATE "default") AND r.at > v_stamp - make_interval(secs => svc.period))::int END AS rleft
                  FROM kheads h JOIN svc ON svc.id = h.service_id
                 ORDER BY h.service_id, h.tenant_id, h.key) r
    ), ktasks AS (
        SELECT k.service_id, k.tenant_id, k.key, f.*
          FROM kkeys k JOIN svc ON svc.id = k.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key
               AND t.next_attempt_at <= v_stamp AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
               AND (svc.rlimit = 0 OR svc.rpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) OR (t.service_id, coalesce(t.params #>> svc.rparts, '')) NOT IN (SELECT * FROM rfull))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT least(k.kleft, svc.room)) f
         WHERE k.kleft > 0
    ), kpicked AS (
        SELECT x.id FROM (SELECT ktasks.*, row_number() OVER (PARTITION BY service_id, tenant_id
                                                              ORDER BY priority DESC, order_seq, created_at, id) AS r
                            FROM ktasks) x
          JOIN svc ON svc.id = x.service_id
         WHERE x.r <= svc.room
    ), free AS (
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM (SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                       t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
                  FROM accs_task t JOIN svc ON svc.id = t.service_id
                 WHERE t.id = ANY(ARRAY(SELECT id FROM kpicked)) AND t.status = 'queued' AND t.host_id IS NULL
                 ORDER BY t.id
                   FOR UPDATE OF t SKIP LOCKED) c JOIN svc ON svc.id = c.service_id
        UNION ALL
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
         WHERE svc.climit = 0 AND svc.rlimit = 0
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
               AND (svc.rlimit = 0 OR (t.service_id, coalesce(t.params #>> svc.rparts, '')) NOT IN (SELECT * FROM rfull))
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), keyed AS (
        SELECT cand.*,
               svc.climit - CASE WHEN svc.climit = 0 THEN 0 WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (cand.ckey COLLATE "C")), 0) ELSE coalesce((SELECT u.used FROM cused u WHERE u.service_id = cand.service_id AND u.key = cand.ckey), 0) END AS cleft,
               row_number() OVER (PARTITION BY cand.service_id, cand.ckey
                                  ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS crank,
               svc.rlimit - coalesce((SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = (cand.rkey COLLATE "default") AND r.at > v_stamp - make_interval(secs => svc.period))::int, 0) AS rleft,
               row_number() OVER (PARTITION BY cand.service_id, cand.rkey
                                  ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS rrank
          FROM cand JOIN svc ON svc.id = cand.service_id
    ), keyed_cand AS (
        SELECT id, service_id, host_id, exclusive, tenant_id, priority, order_seq, created_at, weight, eff_priority
          FROM keyed WHERE (ckey IS NULL OR crank <= cleft) AND (rkey IS NULL OR rrank <= rleft)
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM keyed_cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    ), starts AS (
        INSERT INTO accs_rate_start (service_id, key, at)
        SELECT upd.service_id, CASE WHEN svc.rlimit > 0 THEN coalesce(upd.params #>> string_to_array(svc.rpath, '.'), '') END,
               v_stamp
          FROM upd JOIN svc ON svc.id = upd.service_id WHERE svc.rated
    ), kfirst AS (
        SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at,
               k.cleft <= x.taken AS cfilled, k.rleft IS NOT NULL AND svc.rlimit <= x.taken AS rfilled, svc.period
          FROM kkeys k JOIN svc ON svc.id = k.service_id LEFT JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
          CROSS JOIN LATERAL (
            -- The key's tasks this claim took, of every tenant (the held count is the key's, not a tenant's).
            SELECT count(*) AS taken FROM ktasks c
             WHERE c.service_id = k.service_id AND c.key = k.key AND c.id = ANY(ARRAY(SELECT id FROM upd))) x
    ), kstale AS (
        SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at,
               f.cfilled, f.rfilled, f.period
          FROM accs_limit_key_head h
          JOIN kfirst f ON f.service_id = h.service_id AND f.tenant_id = h.tenant_id AND f.key = h.key
         WHERE h.id = ANY(ARRAY(SELECT hid FROM kheads))
           AND (f.id IS NULL OR (h.priority > f.priority OR (h.priority = f.priority AND (h.order_seq, h.created_at, h.task_id) < (f.order_seq, f.created_at, f.id))))
         ORDER BY h.id
           FOR UPDATE OF h SKIP LOCKED
    ), kkeep AS (
        SELECT min(id) AS id FROM kstale GROUP BY service_id, tenant_id, key
    ), kmoved AS (
        UPDATE accs_limit_key_head h
           SET priority = coalesce(s.priority, h.priority), order_seq = coalesce(s.order_seq, h.order_seq),
               created_at = coalesce(s.created_at, h.created_at), task_id = coalesce(s.first_id, h.task_id),
               emptied = s.first_id IS NULL,
               cap_full = h.cap_full OR coalesce(s.cfilled, false),
               rate_until = CASE WHEN s.rfilled THEN v_stamp + make_interval(secs => s.period)
                                 ELSE h.rate_until END
          FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
    ), kdropped AS (
        DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    ELSIF v_kinds = 'c' AND v_any_rated = true THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    )
    , cused AS MATERIALIZED (
        SELECT k.service_id, k.key, k.held AS used
          FROM svc JOIN accs_limit_key_held k ON k.service_id = svc.id AND k.held > 0
         WHERE svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
        UNION ALL
        SELECT h.service_id, coalesce(h.params #>> svc.cparts, '') AS key, count(*) AS used
          FROM svc JOIN accs_task h ON h.service_id = svc.id AND h.status IN ('starting', 'running')
         WHERE svc.climit > 0
           AND svc.cpath IS DISTINCT FROM accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
         GROUP BY 1, 2
    ), cfull AS MATERIALIZED (
        SELECT u.service_id, u.key FROM cused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.climit
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    )
    , kheads AS MATERIALIZED (
        SELECT q.service_id, q.tenant_id, h.id AS hid, h.key, h.priority, h.order_seq, h.created_at, h.task_id
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT h.id, h.service_id, h.key, h.priority, h.order_seq, h.created_at, h.task_id
              FROM accs_limit_key_head h
             WHERE h.service_id = svc.id AND h.tenant_id = q.tenant_id AND NOT h.emptied
               AND NOT h.cap_full AND h.rate_until IS NULL
             ORDER BY h.priority DESC, h.order_seq, h.created_at, h.task_id
             LIMIT svc.room + 8) h
         WHERE q.tenant_id IS NOT NULL AND (svc.climit > 0 OR svc.rlimit > 0)
    ), kkeys AS MATERIALIZED (
        -- Each key's room under its cap (cleft) and its rate (rleft), and the nearer of the two (kleft).
        SELECT r.*, least(r.cleft, r.rleft) AS kleft
          FROM (SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key,
                       CASE WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.climit - coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (h.key COLLATE "C")), 0) END AS cleft, NULL::int AS rleft
                  FROM kheads h JOIN svc ON svc.id = h.service_id
                 ORDER BY h.service_id, h.tenant_id, h.key) r
    ), ktasks AS (
        SELECT k.service_id, k.tenant_id, k.key, f.*
          FROM kkeys k JOIN svc ON svc.id = k.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key
               AND t.next_attempt_at <= v_stamp AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT least(k.kleft, svc.room)) f
         WHERE k.kleft > 0
    ), kpicked AS (
        SELECT x.id FROM (SELECT ktasks.*, row_number() OVER (PARTITION BY service_id, tenant_id
                                                              ORDER BY priority DESC, order_seq, created_at, id) AS r
                            FROM ktasks) x
          JOIN svc ON svc.id = x.service_id
         WHERE x.r <= svc.room
    ), free AS (
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM (SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                       t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
                  FROM accs_task t JOIN svc ON svc.id = t.service_id
                 WHERE t.id = ANY(ARRAY(SELECT id FROM kpicked)) AND t.status = 'queued' AND t.host_id IS NULL
                 ORDER BY t.id
                   FOR UPDATE OF t SKIP LOCKED) c JOIN svc ON svc.id = c.service_id
        UNION ALL
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
         WHERE svc.climit = 0 AND svc.rlimit = 0
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), keyed AS (
        SELECT cand.*,
               svc.climit - CASE WHEN svc.climit = 0 THEN 0 WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (cand.ckey COLLATE "C")), 0) ELSE coalesce((SELECT u.used FROM cused u WHERE u.service_id = cand.service_id AND u.key = cand.ckey), 0) END AS cleft,
               row_number() OVER (PARTITION BY cand.service_id, cand.ckey
                                  ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS crank
          FROM cand JOIN svc ON svc.id = cand.service_id
    ), keyed_cand AS (
        SELECT id, service_id, host_id, exclusive, tenant_id, priority, order_seq, created_at, weight, eff_priority
          FROM keyed WHERE (ckey IS NULL OR crank <= cleft)
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM keyed_cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    ), starts AS (
        INSERT INTO accs_rate_start (service_id, key, at)
        SELECT upd.service_id, CASE WHEN svc.rlimit > 0 THEN coalesce(upd.params #>> string_to_array(svc.rpath, '.'), '') END,
               v_stamp
          FROM upd JOIN svc ON svc.id = upd.service_id WHERE svc.rated
    ), kfirst AS (
        SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at,
               k.cleft <= x.taken AS cfilled, k.rleft IS NOT NULL AND svc.rlimit <= x.taken AS rfilled, svc.period
          FROM kkeys k JOIN svc ON svc.id = k.service_id LEFT JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
          CROSS JOIN LATERAL (
            -- The key's tasks this claim took, of every tenant (the held count is the key's, not a tenant's).
            SELECT count(*) AS taken FROM ktasks c
             WHERE c.service_id = k.service_id AND c.key = k.key AND c.id = ANY(ARRAY(SELECT id FROM upd))) x
    ), kstale AS (
        SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at,
               f.cfilled, f.rfilled, f.period
          FROM accs_limit_key_head h
          JOIN kfirst f ON f.service_id = h.service_id AND f.tenant_id = h.tenant_id AND f.key = h.key
         WHERE h.id = ANY(ARRAY(SELECT hid FROM kheads))
           AND (f.id IS NULL OR (h.priority > f.priority OR (h.priority = f.priority AND (h.order_seq, h.created_at, h.task_id) < (f.order_seq, f.created_at, f.id))))
         ORDER BY h.id
           FOR UPDATE OF h SKIP LOCKED
    ), kkeep AS (
        SELECT min(id) AS id FROM kstale GROUP BY service_id, tenant_id, key
    ), kmoved AS (
        UPDATE accs_limit_key_head h
           SET priority = coalesce(s.priority, h.priority), order_seq = coalesce(s.order_seq, h.order_seq),
               created_at = coalesce(s.created_at, h.created_at), task_id = coalesce(s.first_id, h.task_id),
               emptied = s.first_id IS NULL,
               cap_full = h.cap_full OR coalesce(s.cfilled, false),
               rate_until = CASE WHEN s.rfilled THEN v_stamp + make_interval(secs => s.period)
                                 ELSE h.rate_until END
          FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
    ), kdropped AS (
        DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    ELSIF v_kinds = 'c' AND v_any_rated = false THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    )
    , cused AS MATERIALIZED (
        SELECT k.service_id, k.key, k.held AS used
          FROM svc JOIN accs_limit_key_held k ON k.service_id = svc.id AND k.held > 0
         WHERE svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
        UNION ALL
        SELECT h.service_id, coalesce(h.params #>> svc.cparts, '') AS key, count(*) AS used
          FROM svc JOIN accs_task h ON h.service_id = svc.id AND h.status IN ('starting', 'running')
         WHERE svc.climit > 0
           AND svc.cpath IS DISTINCT FROM accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
         GROUP BY 1, 2
    ), cfull AS MATERIALIZED (
        SELECT u.service_id, u.key FROM cused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.climit
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    )
    , kheads AS MATERIALIZED (
        SELECT q.service_id, q.tenant_id, h.id AS hid, h.key, h.priority, h.order_seq, h.created_at, h.task_id
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT h.id, h.service_id, h.key, h.priority, h.order_seq, h.created_at, h.task_id
              FROM accs_limit_key_head h
             WHERE h.service_id = svc.id AND h.tenant_id = q.tenant_id AND NOT h.emptied
               AND NOT h.cap_full AND h.rate_until IS NULL
             ORDER BY h.priority DESC, h.order_seq, h.created_at, h.task_id
             LIMIT svc.room + 8) h
         WHERE q.tenant_id IS NOT NULL AND (svc.climit > 0 OR svc.rlimit > 0)
    ), kkeys AS MATERIALIZED (
        -- Each key's room under its cap (cleft) and its rate (rleft), and the nearer of the two (kleft).
        SELECT r.*, least(r.cleft, r.rleft) AS kleft
          FROM (SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key,
                       CASE WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.climit - coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (h.key COLLATE "C")), 0) END AS cleft, NULL::int AS rleft
                  FROM kheads h JOIN svc ON svc.id = h.service_id
                 ORDER BY h.service_id, h.tenant_id, h.key) r
    ), ktasks AS (
        SELECT k.service_id, k.tenant_id, k.key, f.*
          FROM kkeys k JOIN svc ON svc.id = k.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key
               AND t.next_attempt_at <= v_stamp AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT least(k.kleft, svc.room)) f
         WHERE k.kleft > 0
    ), kpicked AS (
        SELECT x.id FROM (SELECT ktasks.*, row_number() OVER (PARTITION BY service_id, tenant_id
                                                              ORDER BY priority DESC, order_seq, created_at, id) AS r
                            FROM ktasks) x
          JOIN svc ON svc.id = x.service_id
         WHERE x.r <= svc.room
    ), free AS (
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM (SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                       t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
                  FROM accs_task t JOIN svc ON svc.id = t.service_id
                 WHERE t.id = ANY(ARRAY(SELECT id FROM kpicked)) AND t.status = 'queued' AND t.host_id IS NULL
                 ORDER BY t.id
                   FOR UPDATE OF t SKIP LOCKED) c JOIN svc ON svc.id = c.service_id
        UNION ALL
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
         WHERE svc.climit = 0 AND svc.rlimit = 0
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at,
                   NULL::text AS rkey,
                   CASE WHEN svc.climit > 0 THEN coalesce(t.params #>> svc.cparts, '') END AS ckey
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.climit = 0 OR (t.service_id, coalesce(t.params #>> svc.cparts, '')) NOT IN (SELECT * FROM cfull))
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), keyed AS (
        SELECT cand.*,
               svc.climit - CASE WHEN svc.climit = 0 THEN 0 WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (cand.ckey COLLATE "C")), 0) ELSE coalesce((SELECT u.used FROM cused u WHERE u.service_id = cand.service_id AND u.key = cand.ckey), 0) END AS cleft,
               row_number() OVER (PARTITION BY cand.service_id, cand.ckey
                                  ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS crank
          FROM cand JOIN svc ON svc.id = cand.service_id
    ), keyed_cand AS (
        SELECT id, service_id, host_id, exclusive, tenant_id, priority, order_seq, created_at, weight, eff_priority
          FROM keyed WHERE (ckey IS NULL OR crank <= cleft)
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM keyed_cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    ), kfirst AS (
        SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at,
               k.cleft <= x.taken AS cfilled, k.rleft IS NOT NULL AND svc.rlimit <= x.taken AS rfilled, svc.period
          FROM kkeys k JOIN svc ON svc.id = k.service_id LEFT JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
          CROSS JOIN LATERAL (
            -- The key's tasks this claim took, of every tenant (the held count is the key's, not a tenant's).
            SELECT count(*) AS taken FROM ktasks c
             WHERE c.service_id = k.service_id AND c.key = k.key AND c.id = ANY(ARRAY(SELECT id FROM upd))) x
    ), kstale AS (
        SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at,
               f.cfilled, f.rfilled, f.period
          FROM accs_limit_key_head h
          JOIN kfirst f ON f.service_id = h.service_id AND f.tenant_id = h.tenant_id AND f.key = h.key
         WHERE h.id = ANY(ARRAY(SELECT hid FROM kheads))
           AND (f.id IS NULL OR (h.priority > f.priority OR (h.priority = f.priority AND (h.order_seq, h.created_at, h.task_id) < (f.order_seq, f.created_at, f.id))))
         ORDER BY h.id
           FOR UPDATE OF h SKIP LOCKED
    ), kkeep AS (
        SELECT min(id) AS id FROM kstale GROUP BY service_id, tenant_id, key
    ), kmoved AS (
        UPDATE accs_limit_key_head h
           SET priority = coalesce(s.priority, h.priority), order_seq = coalesce(s.order_seq, h.order_seq),
               created_at = coalesce(s.created_at, h.created_at), task_id = coalesce(s.first_id, h.task_id),
               emptied = s.first_id IS NULL,
               cap_full = h.cap_full OR coalesce(s.cfilled, false),
               rate_until = CASE WHEN s.rfilled THEN v_stamp + make_interval(secs => s.period)
                                 ELSE h.rate_until END
          FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
    ), kdropped AS (
        DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    ELSIF v_kinds = 'r' AND v_any_rated = true THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    )
    , rused AS MATERIALIZED (
        SELECT r.service_id, r.key, count(*) AS used
          FROM svc JOIN accs_rate_start r ON r.service_id = svc.id
                                         AND r.at > v_stamp - make_interval(secs => svc.period)
         WHERE svc.rlimit > 0 AND r.key IS NOT NULL
         GROUP BY 1, 2
    ), rfull AS MATERIALIZED (
        SELECT u.service_id, u.key FROM rused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.rlimit
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    )
    , kheads AS MATERIALIZED (
        SELECT q.service_id, q.tenant_id, h.id AS hid, h.key, h.priority, h.order_seq, h.created_at, h.task_id
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT h.id, h.service_id, h.key, h.priority, h.order_seq, h.created_at, h.task_id
              FROM accs_limit_key_head h
             WHERE h.service_id = svc.id AND h.tenant_id = q.tenant_id AND NOT h.emptied
               AND NOT h.cap_full AND h.rate_until IS NULL
             ORDER BY h.priority DESC, h.order_seq, h.created_at, h.task_id
             LIMIT svc.room + 8) h
         WHERE q.tenant_id IS NOT NULL AND (svc.climit > 0 OR svc.rlimit > 0)
    ), kkeys AS MATERIALIZED (
        -- Each key's room under its cap (cleft) and its rate (rleft), and the nearer of the two (kleft).
        SELECT r.*, least(r.cleft, r.rleft) AS kleft
          FROM (SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key,
                       NULL::int AS cleft, CASE WHEN svc.rlimit > 0 AND svc.rpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.rlimit - (SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = (h.key COLLATE "default") AND r.at > v_stamp - make_interval(secs => svc.period))::int END AS rleft
                  FROM kheads h JOIN svc ON svc.id = h.service_id
                 ORDER BY h.service_id, h.tenant_id, h.key) r
    ), ktasks AS (
        SELECT k.service_id, k.tenant_id, k.key, f.*
          FROM kkeys k JOIN svc ON svc.id = k.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key
               AND t.next_attempt_at <= v_stamp AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.rlimit = 0 OR svc.rpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) OR (t.service_id, coalesce(t.params #>> svc.rparts, '')) NOT IN (SELECT * FROM rfull))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT least(k.kleft, svc.room)) f
         WHERE k.kleft > 0
    ), kpicked AS (
        SELECT x.id FROM (SELECT ktasks.*, row_number() OVER (PARTITION BY service_id, tenant_id
                                                              ORDER BY priority DESC, order_seq, created_at, id) AS r
                            FROM ktasks) x
          JOIN svc ON svc.id = x.service_id
         WHERE x.r <= svc.room
    ), free AS (
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM (SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                       t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   NULL::text AS ckey
                  FROM accs_task t JOIN svc ON svc.id = t.service_id
                 WHERE t.id = ANY(ARRAY(SELECT id FROM kpicked)) AND t.status = 'queued' AND t.host_id IS NULL
                 ORDER BY t.id
                   FOR UPDATE OF t SKIP LOCKED) c JOIN svc ON svc.id = c.service_id
        UNION ALL
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   NULL::text AS ckey
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
         WHERE svc.climit = 0 AND svc.rlimit = 0
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at,
                   CASE WHEN svc.rlimit > 0 THEN coalesce(t.params #>> svc.rparts, '') END AS rkey,
                   NULL::text AS ckey
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               AND (svc.rlimit = 0 OR (t.service_id, coalesce(t.params #>> svc.rparts, '')) NOT IN (SELECT * FROM rfull))
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), keyed AS (
        SELECT cand.*,
               svc.rlimit - coalesce((SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = (cand.rkey COLLATE "default") AND r.at > v_stamp - make_interval(secs => svc.period))::int, 0) AS rleft,
               row_number() OVER (PARTITION BY cand.service_id, cand.rkey
                                  ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS rrank
          FROM cand JOIN svc ON svc.id = cand.service_id
    ), keyed_cand AS (
        SELECT id, service_id, host_id, exclusive, tenant_id, priority, order_seq, created_at, weight, eff_priority
          FROM keyed WHERE (rkey IS NULL OR rrank <= rleft)
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM keyed_cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    ), starts AS (
        INSERT INTO accs_rate_start (service_id, key, at)
        SELECT upd.service_id, CASE WHEN svc.rlimit > 0 THEN coalesce(upd.params #>> string_to_array(svc.rpath, '.'), '') END,
               v_stamp
          FROM upd JOIN svc ON svc.id = upd.service_id WHERE svc.rated
    ), kfirst AS (
        SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at,
               k.cleft <= x.taken AS cfilled, k.rleft IS NOT NULL AND svc.rlimit <= x.taken AS rfilled, svc.period
          FROM kkeys k JOIN svc ON svc.id = k.service_id LEFT JOIN LATERAL (
            SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
             WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
               AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
          CROSS JOIN LATERAL (
            -- The key's tasks this claim took, of every tenant (the held count is the key's, not a tenant's).
            SELECT count(*) AS taken FROM ktasks c
             WHERE c.service_id = k.service_id AND c.key = k.key AND c.id = ANY(ARRAY(SELECT id FROM upd))) x
    ), kstale AS (
        SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at,
               f.cfilled, f.rfilled, f.period
          FROM accs_limit_key_head h
          JOIN kfirst f ON f.service_id = h.service_id AND f.tenant_id = h.tenant_id AND f.key = h.key
         WHERE h.id = ANY(ARRAY(SELECT hid FROM kheads))
           AND (f.id IS NULL OR (h.priority > f.priority OR (h.priority = f.priority AND (h.order_seq, h.created_at, h.task_id) < (f.order_seq, f.created_at, f.id))))
         ORDER BY h.id
           FOR UPDATE OF h SKIP LOCKED
    ), kkeep AS (
        SELECT min(id) AS id FROM kstale GROUP BY service_id, tenant_id, key
    ), kmoved AS (
        UPDATE accs_limit_key_head h
           SET priority = coalesce(s.priority, h.priority), order_seq = coalesce(s.order_seq, h.order_seq),
               created_at = coalesce(s.created_at, h.created_at), task_id = coalesce(s.first_id, h.task_id),
               emptied = s.first_id IS NULL,
               cap_full = h.cap_full OR coalesce(s.cfilled, false),
               rate_until = CASE WHEN s.rfilled THEN v_stamp + make_interval(secs => s.period)
                                 ELSE h.rate_until END
          FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
    ), kdropped AS (
        DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    ELSIF v_kinds = '' AND v_any_rated = true THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    ), free AS (
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    ), starts AS (
        INSERT INTO accs_rate_start (service_id, key, at)
        SELECT upd.service_id, CASE WHEN svc.rlimit > 0 THEN coalesce(upd.params #>> string_to_array(svc.rpath, '.'), '') END,
               v_stamp
          FROM upd JOIN svc ON svc.id = upd.service_id WHERE svc.rated
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    ELSIF v_kinds = '' AND v_any_rated = false THEN
        RETURN QUERY
    WITH RECURSIVE svc AS (
        -- (A key path as an array once, not once per task a scan passes over.)
        SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
          FROM unnest(v_ids::bigint[], v_rooms::int[], v_weights::int[], v_adjust::int[],
                             v_scans::int[], v_rpaths::text[], v_rlimits::int[], v_cpaths::text[],
                             v_climits::int[], v_periods::int[], v_rated::bool[])
                 AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
    ), tenant_heads AS (
        -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
        -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
        -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
        SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                       WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                       ORDER BY t.tenant_id LIMIT 1) AS tenant_id
          FROM svc
        UNION ALL
        SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                               WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                                 AND t.tenant_id > q.tenant_id
                               ORDER BY t.tenant_id LIMIT 1)
          FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
    ), paused_tenants AS MATERIALIZED (
        -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
        -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
        -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
        -- tenant) passes over its tasks bound to this node's hosts one by one.
        SELECT substr(g.name, 14) FROM accs_governor_condition g WHERE starts_with(g.name, 'tenant-pause-') AND g.raised_at IS NOT NULL AND (g.cleared_at IS NULL OR g.cleared_at < g.raised_at) AND (g.expires_at IS NULL OR g.expires_at > v_stamp)
    ), queued_tenants AS (
        SELECT q.service_id, q.tenant_id FROM tenant_heads q
         WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
    ), free AS (
        -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
        -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
        -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
        -- take the same row.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at
              FROM accs_task t
             WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
               AND t.next_attempt_at <= v_stamp
               -- Tasks this agent still runs (an older attempt it has not finished) are never
               -- claimed by it again: its own late finish would otherwise race the new attempt.
               AND t.id <> ALL(p_exclude::uuid[])
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan
               FOR UPDATE OF t SKIP LOCKED) c
    ), bound_seen AS (
        -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
        -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
        -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
        SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
          FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
            SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at
              FROM accs_task t
             WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
               AND t.next_attempt_at <= v_stamp
               AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
               AND t.id <> ALL(p_exclude::uuid[])
               -- Exclusive work: not while another exclusive task is held on the host (served by
               -- the partial unique index task_one_held_per_exclusive_host).
               AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                                   AND x.status IN ('starting', 'running')))
             ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
             LIMIT svc.scan) c
    ), bound AS (
        -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
        -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
        -- locked (a row another claimer took since it was read is passed over).
        SELECT b.* FROM bound_seen b JOIN (
            SELECT t.id FROM accs_task t
             WHERE t.id = ANY(ARRAY(SELECT r.id
                                      FROM (SELECT s.id, s.service_id,
                                                   row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                      ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                               s.id) AS nth
                                              FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                     WHERE r.nth <= svc.scan))
               AND t.status = 'queued'
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
    ), cand AS (
        SELECT * FROM free UNION ALL SELECT * FROM bound
    ), turns AS (
        -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
        -- then each one's second...), and within a turn the tenant served least recently goes first.
        SELECT src.*, tn.served_at, svc.room,
               row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                                  ORDER BY src.order_seq, src.created_at, src.id) AS turn
          FROM cand src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
    ), fair AS (
        -- Each tenant's scan read up to the service's room, so no more than the room per service,
        -- taken in the fair order.
        SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                           ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                    created_at, id) AS srank
          FROM turns
    ), ranked AS (
        SELECT src.*,
               row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                                  ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
                   AS host_rank,
               row_number() OVER w AS n, sum(weight) OVER w AS cpu
          FROM fair src
         WHERE srank <= room
        WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
    ), pick AS (
        -- One global order across the services; the node's slot and CPU room taken in that order;
        -- an exclusive host gets one task per claim.
        SELECT id FROM ranked
         WHERE n <= v_slots AND cpu <= v_cpu AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
    ), upd AS (
        UPDATE accs_task t
           SET status = 'starting', attempt = t.attempt + 1, claimed_by = p_agent, node = p_node,
               claimed_at = v_stamp,
               -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
               -- lease_expires_at - heartbeat_at).
               lease_expires_at = v_stamp + make_interval(
                   secs => coalesce((v_leases::jsonb ->> t.service_id::text)::float8, p_lease)),
               heartbeat_at = v_stamp, updated_at = v_stamp,
               cancel_requested_at = NULL, started_at = NULL
         -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
         -- read the whole task table.
         WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
        RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
                  t.priority, t.order_seq, t.created_at, t.tenant_id
    ), served AS (
        -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
        -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
        -- skipped, never waited for (its mark is as recent).
        UPDATE accs_tenant tn SET served_at = v_stamp
         WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                     ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
           AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
    ), att AS (
        INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                                  stderr_tail, error_text)
        SELECT id, attempt, p_node, p_agent, p_pid, 'running', v_stamp, '', '', ''
          FROM upd
    ), ev AS (
        -- One row per task claimed. A task whose job this claim's call made of a narrow start (v_created,
        -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
        -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
        -- start to claim.
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, upd.job_id, upd.id, upd.attempt, p_source, 'info', 'status',
               CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN 'job created waiting, task queued → starting'
                    ELSE 'task queued → starting' END,
               jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
               || CASE WHEN upd.job_id = ANY(v_created::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                      'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                      'task_key', upd.task_key))
                  ELSE '{}'::jsonb END
          FROM upd
    )
    SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
           coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
      FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
     ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
    END IF;
    IF cardinality(v_keyed) > 0 THEN
        -- The key rows this claim found empty, seen again now that it holds them (jobs.limit_keys).
        WITH e AS (
            SELECT h.id, f.id AS task_id, f.priority, f.order_seq, f.created_at
              FROM accs_limit_key_head h LEFT JOIN LATERAL (
                SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
                 WHERE t.service_id = h.service_id AND t.tenant_id = h.tenant_id AND t.status = 'queued'
                   AND t.host_id IS NULL AND t.limit_key = h.key
                 ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) f ON true
             WHERE h.emptied AND h.service_id = ANY(v_keyed::bigint[])
        ), back AS (
            UPDATE accs_limit_key_head h SET emptied = false, priority = e.priority, order_seq = e.order_seq,
                   created_at = e.created_at, task_id = e.task_id
              FROM e WHERE h.id = e.id AND e.task_id IS NOT NULL
        )
        DELETE FROM accs_limit_key_head h USING e WHERE h.id = e.id AND e.task_id IS NULL;
    END IF;
END
$claim$;"""

WIDEN = r"""CREATE OR REPLACE FUNCTION accs_widen_starts(
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
        RETURN '{}';
    END IF;
WITH gone AS (
    DELETE FROM accs_start s WHERE s.id = ANY(v_ids)
    RETURNING s.id, s.task_id, s.tenant_id, s.service_id, s.priority, s.job_priority, s.order_seq, s.params,
              s.source, s.source_ref, s.correlation_id, s.created_by_id, s.created_at
), g AS (
    SELECT gone.*, sv.key::text AS svc_key, sv.exclusive_per_host, sv.max_attempts, sv.timeout_seconds
      FROM gone JOIN accs_service sv ON sv.id = gone.service_id
), j AS (
INSERT INTO accs_job (id, tenant_id, workflow_id, service_id, status, progress, current_task_key, priority, options,
                      step_params, scheduled_at, error_code, error_message, source, source_ref, external_id,
                      dedupe_key, correlation_id, approval_state, approved_by, created_by_id, created_at,
                      updated_at, started_at, approval_barred, order_seq)
SELECT g.id, g.tenant_id, NULL::uuid, g.service_id, 'waiting', 0, g.svc_key, g.job_priority, coalesce('{}'::jsonb,
       '{}'), jsonb_build_object(g.svc_key, g.params), coalesce(g.created_at, now()), '', '', g.source,
       g.source_ref, NULL::text, NULL::text, g.correlation_id, 'not_required', '', g.created_by_id, g.created_at,
       now(), g.created_at, NULL::int[], g.order_seq
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
SELECT coalesce(array_agg(g.id), '{}') INTO v_widened FROM g;
    IF p_events THEN
        INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
        SELECT j.created_at, j.id, 'api:' || j.source, 'info', 'status', 'job created waiting, 1 task queued',
               jsonb_build_object('from', 'created', 'to', 'waiting', 'approval', 'not_required',
                                  'tasks', jsonb_build_array(jsonb_build_object('id', t.id::text, 'task_key', t.task_key,
                                                                                'to', 'queued')))
          FROM accs_job j JOIN accs_task t ON t.job_id = j.id
         -- (The tasks by their jobs too: joined alone, a plan made while the task table was nearly empty read
         -- all of task_job_key_unique for them, at every claim that widened a start it did not take.)
         WHERE j.id = ANY(v_widened) AND t.job_id = ANY(v_widened) AND t.attempt = 0
         ORDER BY j.id;
    END IF;
    RETURN v_widened;
END
$widen$;"""


_before = import_module("jobs.migrations.0047_timeline_row_per_task_moved")
_claims_before = import_module("jobs.migrations.0048_narrow_starts")
_trigger_before = import_module("jobs.migrations.0040_attempt_claimable_at")

# An attempt's service, tenant and claimable time are its task's (jobs.0040), read by primary key.
COPY_TASK_REFS = """
CREATE OR REPLACE FUNCTION accs_attempt_copy_task_refs() RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    -- An attempt's service and tenant are its task's, whatever the writer said; the time it became
    -- claimable is the task's next_attempt_at (which the claim leaves as it was).
    SELECT t.service_id, t.tenant_id, t.next_attempt_at INTO NEW.service_id, NEW.tenant_id, NEW.claimable_at
      FROM accs_task t WHERE t.id = NEW.task_id;
    RETURN NEW;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("jobs", "0048_narrow_starts")]

    operations = [
        migrations.RunSQL(FINALIZE, _before.FINALIZE),
        migrations.RunSQL(REPORT, _before.REPORT),
        migrations.RunSQL(CLAIM, _claims_before.CLAIM),
        migrations.RunSQL(KEYED_CLAIM, _claims_before.KEYED_CLAIM),
        migrations.RunSQL(WIDEN, _claims_before.WIDEN),
        migrations.RunSQL(COPY_TASK_REFS, _trigger_before.COPY_TASK_REFS),
    ]
