"""The claim, report and settlement functions run without JIT, and the claim promotes retries with the builder's statement.

A generic plan cannot see the claim's limits, so with a large backlog (100k queued tasks) its
estimated cost passes jit_above_cost and every call compiled its expressions first: 1.4 s for a
claim that runs in milliseconds. Each function now sets ``jit = off`` for itself. The claim
function's promotion of due retries is built from the builder's own statement
(jobs.reports.PROMOTE_DUE_SQL) instead of a hand-made copy, so the test that compares the database's
functions with the code covers it; it promotes the same tasks. Frozen copies of the text the
modules build.
"""

from importlib import import_module

from django.db import migrations

CLAIM = r"""CREATE OR REPLACE FUNCTION accs_claim_plain(
    p_svc_ids bigint[], p_weights int[], p_adjust int[], p_node_caps int[], p_channels text[],
    p_node text, p_agent text, p_pid int, p_source text, p_now timestamptz, p_free int, p_slot_cap int,
    p_cpu_budget int, p_lease float8, p_blocked bigint[], p_exclude uuid[], p_promote_limit int)
RETURNS TABLE (id uuid, job_id uuid, task_key text, attempt int, params jsonb, timeout_seconds int,
               host text, service_id bigint, lease float8)
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
AS $claim$
#variable_conflict use_column
DECLARE
    v_stamp timestamptz;
    v_promoted bigint[];
    v_limited bigint[];
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
        UPDATE accs_task t SET status = 'queued', updated_at = now() FROM due WHERE t.id = due.id
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
    -- The services as the database holds them now: one with a fleet-wide limit is not claimed here.
    SELECT coalesce(array_agg(s.id), '{}') INTO v_limited FROM accs_service s
     WHERE s.id = ANY(p_svc_ids) AND (s.max_concurrent > 0 OR s.rate_limit > 0 OR s.rate_key_limit > 0
                                      OR s.concurrency_key_limit > 0);
    -- The node's lock (jobs.locks.advisory_locks takes the same one for the key 'accs:node:<name>').
    PERFORM pg_advisory_xact_lock(hashtext('accs:node:' || p_node));
    v_stamp := coalesce(p_now, clock_timestamp());
    SELECT count(*), count(*) FILTER (WHERE h.status = 'ok'),
           coalesce(array_agg(h.id) FILTER (WHERE h.status = 'ok' AND h.id <> ALL(p_blocked)), '{}')
      INTO v_hosts_all, v_hosts_ok, v_hosts
      FROM accs_host h WHERE h.node_id = p_node;
    -- Held tasks on this node (task_held_node_idx), as HELD_SQL counts them.
    SELECT count(*), coalesce(sum(s.cpu_weight), 0) INTO v_held, v_held_cpu
      FROM accs_task t JOIN accs_service s ON s.id = t.service_id
     WHERE t.status IN ('starting', 'running') AND t.node = p_node;
    v_slots := least(p_free, CASE WHEN v_hosts_all > 0 THEN least(p_slot_cap, v_hosts_ok) ELSE p_slot_cap END - v_held);
    v_cpu := p_cpu_budget - v_held_cpu;
    IF v_slots > 0 THEN
        -- Each service's room (service_room): the node's slots and CPU, and its per-node cap.
        SELECT array_agg(r.id ORDER BY r.ord), array_agg(r.room ORDER BY r.ord), array_agg(r.weight ORDER BY r.ord),
               array_agg(r.adjust ORDER BY r.ord),
               coalesce(jsonb_object_agg(r.id::text, r.lease::float8) FILTER (WHERE r.lease > 0), '{}')
          INTO v_ids, v_rooms, v_weights, v_adjust, v_leases
          FROM (SELECT u.id, u.ord, greatest(u.weight, 1) AS weight, u.adjust, s.lease_seconds AS lease,
                       least(v_slots, v_cpu / greatest(u.weight, 1),
                             CASE WHEN u.cap > 0 THEN u.cap - (SELECT count(*) FROM accs_task t
                                                                WHERE t.status IN ('starting', 'running')
                                                                  AND t.node = p_node AND t.service_id = u.id)
                             END) AS room
                  FROM unnest(p_svc_ids, p_weights, p_adjust, p_node_caps) WITH ORDINALITY
                       AS u(id, weight, adjust, cap, ord)
                  JOIN accs_service s ON s.id = u.id
                 WHERE u.id <> ALL(v_limited)) r
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
), queued_tenants AS (
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
      FROM queued_tenants q WHERE q.tenant_id IS NOT NULL
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
), bound AS (
    -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
    -- nodes' host-bound work is never scanned.
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM svc CROSS JOIN unnest(v_hosts::bigint[]) AS h(id) CROSS JOIN LATERAL (
        SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
               t.created_at
          FROM accs_task t
         WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
           AND t.next_attempt_at <= v_stamp
           AND t.id <> ALL(p_exclude::uuid[])
           -- Exclusive work: not while another exclusive task is held on the host (served by
           -- the partial unique index task_one_held_per_exclusive_host).
           AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                               AND x.status IN ('starting', 'running')))
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT svc.scan
           FOR UPDATE OF t SKIP LOCKED) c
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
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
           'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
      FROM upd
)
SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
       coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
        END IF;
    END IF;
    -- The services left out, each as a row without a task.
    RETURN QUERY SELECT NULL::uuid, NULL::uuid, NULL::text, NULL::int, NULL::jsonb, NULL::int, NULL::text, l.id,
                        NULL::float8
                   FROM unnest(v_limited) AS l(id);
END
$claim$"""

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
$finalize$"""

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
$report$"""

# Going back restores the functions as the earlier migrations created them.
_claim = import_module("jobs.migrations.0019_claim_function")
_reports = import_module("jobs.migrations.0020_report_functions")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0022_lean_indexes")]

    operations = [migrations.RunSQL(CLAIM, _claim.CREATE), migrations.RunSQL(FINALIZE, _reports.FINALIZE),
                  migrations.RunSQL(REPORT, _reports.REPORT)]
