"""Each statement that moves held tasks takes its keys' count rows in one order: the per-key cap no longer deadlocks.

The held count per key (accs_limit_key_held) and the key rows' cap marks were kept by a trigger per task,
in the order a statement moved its tasks (task id order). Two reports whose tasks' keys interleave (one
ends a task of key a, then one of key b; the other b, then a) took the count rows in opposite orders and
PostgreSQL aborted one of them after its deadlock timeout. The trigger now runs once per statement, over
the statement's moves (transition tables), and takes the count rows in (service, key) order, then the key
rows whose mark flips (only the holder of their key's count row writes them). The report of successes (accs_report_succeeded) also locks its
tasks' count rows first, in one sorted statement, because it ends tasks in up to two statements.

Safe under the previous release's daemons: the functions and triggers are replaced in one short transaction
(the wait for accs_task's lock bounded by ``lock_timeout``: the migration fails rather than queue the
daemons behind it). The previous release's claims and reports move tasks as before and the new triggers
count them; its report of successes runs the new function, which returns the same rows. Copies of
jobs.limit_keys.KEY_HELD_SQL, KEY_HELD_TRIGGERS_SQL and jobs.reports.report_function_sql() (tests compare
them); back, jobs.0039's triggers per task and the report function without the count lock.
"""

from django.db import migrations

KEY_HELD_SQL = r"""-- Held tasks per key (the per-key cap's count), kept by the database on each task's way into and
-- out of held work, in the transaction that moves it, whichever release's daemon moves it
-- (accs_limit_key_held: jobs.models.LimitKeyHeld). One call per statement, over the statement's
-- moves (transition tables), so a statement takes its keys' rows in (service, key) order whatever
-- order it moves its tasks in: two statements whose tasks' keys interleave (a, b and b, a) take the
-- rows in the same order and cannot wait for each other in a cycle. A transaction that moves held
-- tasks in more than one statement takes their count rows first, in one sorted statement
-- (jobs.locks.lock_key_counts; the report function takes the same).
CREATE OR REPLACE FUNCTION accs_task_key_held() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_services bigint[];
    v_keys text[];
    v_deltas int[];
BEGIN
    IF TG_OP = 'UPDATE' THEN
        -- Most statements move no keyed task (heartbeats, progress, unkeyed services): one look each.
        IF NOT EXISTS (SELECT 1 FROM accs_key_held_new n WHERE n.limit_key IS NOT NULL)
           AND NOT EXISTS (SELECT 1 FROM accs_key_held_old o WHERE o.limit_key IS NOT NULL) THEN
            RETURN NULL;
        END IF;
        SELECT array_agg(m.service_id), array_agg(m.key), array_agg(m.delta) INTO v_services, v_keys, v_deltas
          FROM (SELECT o.service_id, o.limit_key AS key, -1 AS delta
                  FROM accs_key_held_old o JOIN accs_key_held_new n ON n.id = o.id
                 WHERE o.limit_key IS NOT NULL AND o.status IN ('starting', 'running')
                   AND n.status NOT IN ('starting', 'running')
                UNION ALL
                SELECT n.service_id, n.limit_key, 1
                  FROM accs_key_held_old o JOIN accs_key_held_new n ON n.id = o.id
                 WHERE n.limit_key IS NOT NULL AND n.status IN ('starting', 'running')
                   AND o.status NOT IN ('starting', 'running')) m;
    ELSE
        SELECT array_agg(o.service_id), array_agg(o.limit_key), array_agg(-1) INTO v_services, v_keys, v_deltas
          FROM accs_key_held_old o WHERE o.limit_key IS NOT NULL AND o.status IN ('starting', 'running');
    END IF;
    IF v_services IS NOT NULL THEN
        PERFORM accs_key_held_move(v_services, v_keys, v_deltas);
    END IF;
    RETURN NULL;
END
$$;

-- One statement's moves of held tasks (a service, a key and +1 or -1 each): the services' limits
-- locks, shared, in id order (a change of the limits takes its service's alone and recomputes every
-- mark once the counts in flight have committed); the count rows in (service, key) order; then the
-- key rows whose cap flag flips (held >= the cap: the claim's walk leaves them out).
CREATE OR REPLACE FUNCTION accs_key_held_move(p_services bigint[], p_keys text[], p_deltas int[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('accs:key-limits:' || s.id))
       FROM (SELECT DISTINCT x.id FROM unnest(p_services) AS x(id) ORDER BY 1) s;
    -- A key without a row gets one on its way in; a move out of a key without a row changes nothing.
    INSERT INTO accs_limit_key_held AS k (service_id, key, held)
    SELECT d.service_id, d.key, d.delta
      FROM (SELECT m.service_id, m.key COLLATE "C" AS key, sum(m.delta)::int AS delta
              FROM unnest(p_services, p_keys, p_deltas) AS m(service_id, key, delta) GROUP BY 1, 2) d
     WHERE d.delta > 0 OR (d.delta < 0 AND EXISTS (SELECT 1 FROM accs_limit_key_held e
                                                     WHERE e.service_id = d.service_id AND e.key = d.key))
     ORDER BY d.service_id, d.key
    ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + excluded.held;
    -- Found by key, then locked in id order (a plan asked for key order walked every key row of the
    -- service). Any order does: a key's rows flip only under its count row's lock, taken above.
    WITH f AS MATERIALIZED (
        SELECT h.id, h.cap_full, coalesce(k.held >= CASE WHEN s.concurrency_key_limit > 0 AND s.concurrency_key
                                                              = accs_limit_key_path(s.concurrency_key_limit,
                                                                                    s.concurrency_key,
                                                                                    s.rate_key_limit, s.rate_key)
                                                         THEN s.concurrency_key_limit END, false) AS is_full
          FROM (SELECT DISTINCT m.service_id, m.key COLLATE "C" AS key
                  FROM unnest(p_services, p_keys) AS m(service_id, key)) d
          JOIN accs_service s ON s.id = d.service_id
          JOIN accs_limit_key_held k ON k.service_id = d.service_id AND k.key = d.key
          JOIN accs_limit_key_head h ON h.service_id = d.service_id AND h.key = d.key
    )
    UPDATE accs_limit_key_head h SET cap_full = f.is_full
      FROM f
     WHERE h.id = f.id AND h.cap_full IS DISTINCT FROM f.is_full
       AND h.id = ANY(ARRAY(SELECT x.id FROM accs_limit_key_head x
                             WHERE x.id = ANY(ARRAY(SELECT f2.id FROM f f2
                                                     WHERE f2.cap_full IS DISTINCT FROM f2.is_full))
                             ORDER BY x.id FOR NO KEY UPDATE));
END
$$;

"""

KEY_HELD_TRIGGERS_SQL = r"""-- Per statement (jobs.0045); jobs.0039's per-row triggers go.
DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_out ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_moves ON accs_task;
CREATE TRIGGER accs_task_key_held_moves AFTER UPDATE ON accs_task
    REFERENCING OLD TABLE AS accs_key_held_old NEW TABLE AS accs_key_held_new
    FOR EACH STATEMENT EXECUTE FUNCTION accs_task_key_held();

DROP TRIGGER IF EXISTS accs_task_key_held_delete ON accs_task;
CREATE TRIGGER accs_task_key_held_delete AFTER DELETE ON accs_task REFERENCING OLD TABLE AS accs_key_held_old
    FOR EACH STATEMENT EXECUTE FUNCTION accs_task_key_held();
DROP FUNCTION IF EXISTS accs_key_cap_follow(bigint, text, int);
"""

REPORT = r"""CREATE OR REPLACE FUNCTION accs_report_succeeded(
    p_start_ids uuid[], p_start_attempts int[], p_start_pids int[],
    p_ids uuid[], p_attempts int[], p_results text[], p_codes int[], p_outs text[], p_errs text[], p_pids int[],
    p_started bool[], p_agent text, p_source text, p_now timestamptz)
RETURNS TABLE (kind text, value text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
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
    -- Then the held counts of their keys, sorted: up to two statements below end tasks.
    PERFORM 1 FROM accs_limit_key_held k WHERE (k.service_id, k.key) IN (SELECT t.service_id, t.limit_key FROM accs_task t WHERE t.id = ANY(p_ids) AND t.limit_key IS NOT NULL AND t.status IN ('starting', 'running')) ORDER BY k.service_id, k.key FOR UPDATE;
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
$report$;"""

# Back: jobs.0039's count per task, and the report function of jobs.0020/0023.
KEY_HELD_0039 = r"""-- Held tasks per key (the per-key cap's count), kept by the database on each task's way into and
-- out of held work, in the transaction that moves it, whichever release's daemon moves it
-- (accs_limit_key_held: jobs.models.LimitKeyHeld).
CREATE OR REPLACE FUNCTION accs_task_key_held() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_held int;
BEGIN
    IF TG_ARGV[0] = 'in' THEN
        INSERT INTO accs_limit_key_held AS k (service_id, key, held) VALUES (NEW.service_id, NEW.limit_key, 1)
        ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + 1
        RETURNING k.held INTO v_held;
        PERFORM accs_key_cap_follow(NEW.service_id, NEW.limit_key, v_held);
    ELSE
        UPDATE accs_limit_key_held k SET held = k.held - 1
         WHERE k.service_id = OLD.service_id AND k.key = OLD.limit_key
        RETURNING k.held INTO v_held;
        PERFORM accs_key_cap_follow(OLD.service_id, OLD.limit_key, v_held);
    END IF;
    RETURN NULL;
END
$$;

-- Whether a key's held tasks (now p_held, its count row locked by the caller's update) fill its cap,
-- written on the key's rows: the walk's index leaves out the full ones, so a claim never visits
-- them. Under the service's limits lock, shared (a change of the limits takes it alone and
-- recomputes every row after the counts in flight have committed).
CREATE OR REPLACE FUNCTION accs_key_cap_follow(p_service bigint, p_key text, p_held int)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_cap int;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('accs:key-limits:' || p_service));
    SELECT CASE WHEN s.concurrency_key_limit > 0 AND s.concurrency_key = accs_limit_key_path(
                    s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
                THEN s.concurrency_key_limit END
      INTO v_cap FROM accs_service s WHERE s.id = p_service;
    UPDATE accs_limit_key_head h SET cap_full = coalesce(p_held >= v_cap, false)
     WHERE h.service_id = p_service AND h.key = p_key
       AND h.cap_full IS DISTINCT FROM coalesce(p_held >= v_cap, false);
END
$$;

"""

KEY_HELD_TRIGGERS_0039 = r"""DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
CREATE TRIGGER accs_task_key_held_in AFTER UPDATE OF status ON accs_task
    FOR EACH ROW WHEN (NEW.limit_key IS NOT NULL AND NEW.status IN ('starting', 'running')
                       AND OLD.status NOT IN ('starting', 'running'))
    EXECUTE FUNCTION accs_task_key_held('in');

DROP TRIGGER IF EXISTS accs_task_key_held_out ON accs_task;
CREATE TRIGGER accs_task_key_held_out AFTER UPDATE OF status ON accs_task
    FOR EACH ROW WHEN (OLD.limit_key IS NOT NULL AND OLD.status IN ('starting', 'running')
                       AND NEW.status NOT IN ('starting', 'running'))
    EXECUTE FUNCTION accs_task_key_held('out');

DROP TRIGGER IF EXISTS accs_task_key_held_delete ON accs_task;
CREATE TRIGGER accs_task_key_held_delete AFTER DELETE ON accs_task
    FOR EACH ROW WHEN (OLD.limit_key IS NOT NULL AND OLD.status IN ('starting', 'running'))
    EXECUTE FUNCTION accs_task_key_held('out');
"""

REPORT_0023 = r"""CREATE OR REPLACE FUNCTION accs_report_succeeded(
    p_start_ids uuid[], p_start_attempts int[], p_start_pids int[],
    p_ids uuid[], p_attempts int[], p_results text[], p_codes int[], p_outs text[], p_errs text[], p_pids int[],
    p_started bool[], p_agent text, p_source text, p_now timestamptz)
RETURNS TABLE (kind text, value text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
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
$report$;"""


class Migration(migrations.Migration):
    atomic = False  # its own short transaction, with a bounded wait for the table's lock

    dependencies = [
        ("jobs", "0044_start_function"),
    ]

    operations = [
        migrations.RunSQL("SET lock_timeout = '5s'", "RESET lock_timeout"),
        migrations.RunSQL("BEGIN;" + KEY_HELD_SQL + KEY_HELD_TRIGGERS_SQL + REPORT + "COMMIT;",
                          "BEGIN; DROP TRIGGER IF EXISTS accs_task_key_held_moves ON accs_task;" + KEY_HELD_0039
                          + KEY_HELD_TRIGGERS_0039 + "DROP FUNCTION IF EXISTS accs_key_held_move(bigint[], text[], int[]);"
                          + REPORT_0023 + "COMMIT;"),
        migrations.RunSQL("RESET lock_timeout", "SET lock_timeout = '5s'"),
    ]
