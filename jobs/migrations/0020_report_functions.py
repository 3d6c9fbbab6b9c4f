"""finalize_jobs and the report of successes as server-side functions (jobs.finalize.finalize_function_sql,
jobs.reports.report_function_sql).

Frozen copies of the texts those modules build: a test compares the database's functions with them, so
a change to one of their statements comes with a migration that replaces the function.
"""

from django.db import migrations

FINALIZE = r"""
CREATE OR REPLACE FUNCTION accs_finalize_jobs(p_jobs uuid[], p_now timestamptz, p_source text,
                                              p_roots bool)
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
AS $finalize$
#variable_conflict use_column
DECLARE
    v_job_ids uuid[];
    v_steps text[];
    v_roots uuid[];
    v_n bigint;
BEGIN
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
    v_roots := CASE WHEN p_roots THEN p_jobs ELSE '{}'::uuid[] END;
    IF cardinality(v_job_ids) > 0 OR p_roots THEN
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
$finalize$
"""

REPORT = r"""
CREATE OR REPLACE FUNCTION accs_report_succeeded(
    p_start_ids uuid[], p_start_attempts int[], p_start_pids int[],
    p_ids uuid[], p_attempts int[], p_results text[], p_codes int[], p_outs text[], p_errs text[], p_pids int[],
    p_started bool[], p_agent text, p_source text, p_now timestamptz)
RETURNS TABLE (kind text, value text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
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
    v_n bigint;
BEGIN
    -- The lock order (jobs.locks): the jobs of the reported tasks, then the tasks, each sorted by id.
    PERFORM 1 FROM accs_job WHERE id IN (SELECT t.job_id FROM accs_task t WHERE t.id = ANY(p_ids || p_start_ids))
     ORDER BY id FOR NO KEY UPDATE;
    PERFORM 1 FROM accs_task WHERE id = ANY(p_ids || p_start_ids) ORDER BY id FOR UPDATE;
    -- Starts of attempts still running (mark_running).
    IF cardinality(p_start_ids) > 0 THEN
        v_ids := p_start_ids;
        v_attempts := p_start_attempts;
        v_pids := p_start_pids;
        -- A job is running while a task of it is starting or running: the first start moves it from
-- waiting. Written just before the tasks' own start (same transaction, same fencing), so the
-- timeline reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[]) AS v(id, attempt)),
up AS (
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE status = 'waiting'
       AND id IN (SELECT t.job_id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
                   WHERE t.status = 'starting' AND t.claimed_by = p_agent)
    RETURNING id
)
INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
SELECT v_now, id, p_source, 'info', 'status', 'job waiting → running',
       '{"from": "waiting", "to": "running"}'::jsonb FROM up;
        WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[], v_pids::int[]) AS v(id, attempt, pid)),
run AS (
    UPDATE accs_task t SET status = 'running', started_at = v_now, updated_at = v_now
      FROM v WHERE t.id = v.id AND t.attempt = v.attempt AND t.status = 'starting' AND t.claimed_by = p_agent
    RETURNING t.id, t.job_id, t.attempt, v.pid
),
att AS (
    UPDATE accs_attempt a SET pid = run.pid FROM run WHERE a.task_id = run.id AND a.attempt_no = run.attempt
),
ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT v_now, job_id, id, attempt, p_source, 'info', 'status', 'task starting → running',
           jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid) FROM run
)
SELECT count(*) INTO v_n FROM run;
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
-- waiting. Written just before the tasks' own start (same transaction, same fencing), so the
-- timeline reads "job waiting → running", then "task starting → running".
WITH v AS (SELECT * FROM unnest(v_ids::uuid[], v_attempts::int[]) AS v(id, attempt)),
up AS (
    UPDATE accs_job SET status = 'running', updated_at = v_now
     WHERE status = 'waiting'
       AND id IN (SELECT t.job_id FROM accs_task t JOIN v ON v.id = t.id AND v.attempt = t.attempt
                   WHERE t.status = 'starting' AND t.claimed_by = p_agent)
    RETURNING id
)
INSERT INTO accs_event (ts, job_id, source, level, type, message, data)
SELECT v_now, id, p_source, 'info', 'status', 'job waiting → running',
       '{"from": "waiting", "to": "running"}'::jsonb FROM up;
        END IF;
        -- Fenced by attempt: a report from an attempt that is no longer current changes nothing.
-- v_from is 'running', or 'starting' when the agent reports an attempt's start and end
-- together: the task then goes starting → done in one UPDATE and BOTH transitions get their event
-- (the intermediate row version would be visible to no other transaction anyway). A task the
-- report finds already running (an earlier report of its start committed but its answer was lost)
-- goes running → done, with that one event. "was" is the row as the statement found it.
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
),
ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT v_now, job_id, id, attempt, p_source, 'info', 'status', 'task starting → running',
           jsonb_build_object('from', 'starting', 'to', 'running', 'pid', pid)
      FROM done WHERE was = 'starting'
    UNION ALL
    SELECT v_now, job_id, id, attempt, p_source, 'info', 'status', 'task running → done',
           '{"from": "running", "to": "done"}'::jsonb FROM done
)
SELECT coalesce(array_agg(id), '{}'), coalesce(array_agg(job_id), '{}') INTO v_done, v_jobs FROM done;
        v_all_done := v_all_done || v_done;
        v_all_jobs := v_all_jobs || v_jobs;
    END LOOP;
    RETURN QUERY SELECT 'done', d::text FROM unnest(v_all_done) AS d;
    IF cardinality(v_all_jobs) > 0 THEN
        RETURN QUERY SELECT 'notify', k FROM accs_finalize_jobs(
            ARRAY(SELECT DISTINCT j FROM unnest(v_all_jobs) AS j ORDER BY 1), v_now, p_source, false) AS k;
    END IF;
END
$report$
"""

DROP_FINALIZE = "DROP FUNCTION IF EXISTS accs_finalize_jobs(uuid[], timestamptz, text, bool)"

DROP_REPORT = """DROP FUNCTION IF EXISTS accs_report_succeeded(uuid[], int[], int[], uuid[], int[], text[], int[], text[],
    text[], int[], bool[], text, text, timestamptz)"""


class Migration(migrations.Migration):
    dependencies = [("jobs", "0019_claim_function")]

    operations = [migrations.RunSQL(FINALIZE, DROP_FINALIZE), migrations.RunSQL(REPORT, DROP_REPORT)]
