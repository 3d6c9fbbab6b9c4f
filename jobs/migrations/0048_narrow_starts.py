"""Narrow starts: a start that needs nothing decided before it runs may be one row, widened when taken.

``accs_start`` holds such starts (jobs.narrow): a one-task service job due now, with no idempotency key,
approval, options or tenant cap, of a service without a rate or per-key limit, on a site that set
``ACC_NARROW_STARTS``. ``accs_start_narrow`` writes one and wakes the service's agents;
``accs_widen_starts`` makes starts their job, task, step and creation event (the claim functions widen
the head of their services' queues first, the builder the starts no claim took within a second, a read by
id the starts it names).

Safe under the previous release's daemons: a new table and new functions, and the claim functions keep
their names, arguments and results (a previous release's agent calls them as before, and widens what it
would claim). Nothing writes narrow starts until the site turns them on, which it does once every agent
and builder runs this release. ``CREATE OR REPLACE FUNCTION`` takes no lock on a table; creating the
table's references takes a brief lock on the service, tenant and user tables. Frozen copies of the
code's function texts (a test compares the database's functions with the code); going back restores
jobs.0046's claim functions and drops the new ones (after the table's starts were widened: going back
refuses while any start is left).
"""

from importlib import import_module

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

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
         WHERE j.id = ANY(v_widened) AND t.attempt = 0
         ORDER BY j.id;
    END IF;
    RETURN v_widened;
END
$widen$;"""

NARROW_START = r"""CREATE OR REPLACE FUNCTION accs_start_narrow(
    p_id uuid, p_task_id uuid, p_tenant uuid, p_svc bigint, p_priority int, p_job_priority int, p_params jsonb,
    p_src text, p_sref text, p_corr text, p_cby int, p_channels text[])
RETURNS TABLE (order_seq bigint, created_at timestamptz, notified bigint)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $start$
#variable_conflict use_column
BEGIN
    RETURN QUERY
WITH s AS (
    INSERT INTO accs_start (id, task_id, tenant_id, service_id, priority, job_priority, params, source, source_ref,
                            correlation_id, created_by_id, created_at)
    VALUES (p_id, p_task_id, p_tenant, p_svc, p_priority, p_job_priority, p_params, p_src,
            p_sref, p_corr, p_cby, now())
    RETURNING order_seq, created_at
), n AS (
    SELECT pg_notify(c, '') FROM unnest(p_channels::text[]) AS c
)
SELECT s.order_seq, s.created_at, (SELECT count(*) FROM n) FROM s;
END
$start$;"""

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
         WHERE j.id = ANY(v_created) AND t.attempt = 0
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
-- function (jobs.claim).
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_sort = off
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

_claims_before = import_module("jobs.migrations.0046_claims_probe_and_mark_what_they_fill")

DROP_NARROW = "DROP FUNCTION IF EXISTS accs_start_narrow(uuid, uuid, uuid, bigint, int, int, jsonb, text, text, text, int, text[])"
DROP_WIDEN = "DROP FUNCTION IF EXISTS accs_widen_starts(uuid[], bigint[], int, timestamptz, int)"
# Going back with starts left would lose them: widen them first (a builder of this release does).
REFUSE_LEFT = """DO $left$ BEGIN
    IF EXISTS (SELECT 1 FROM accs_start) THEN
        RAISE EXCEPTION 'accs_start still holds narrow starts: widen them first (SELECT accs_widen_starts(NULL, NULL, NULL, now(), 100000)) or turn ACC_NARROW_STARTS off and let the builder widen them';
    END IF;
END $left$"""


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0047_timeline_row_per_task_moved"),
        ("tenants", "0002_token_scopes_db_default"),
        ("workflows", "0005_code_definitions"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Start",
            fields=[
                ("id", models.UUIDField(editable=False, help_text="The job's id.", primary_key=True, serialize=False)),
                ("task_id", models.UUIDField(editable=False, help_text="The id its one task gets.")),
                ("priority", models.IntegerField(
                    help_text="The task's: the job's priority plus the service's base priority.")),
                ("job_priority", models.IntegerField()),
                ("order_seq", models.BigIntegerField(
                    db_default=models.Func(models.Value("accs_job_order_seq"), function="nextval",
                                           output_field=models.BigIntegerField()),
                    editable=False, help_text="The job's place in the global order, taken when it started.")),
                ("params", models.JSONField(default=dict)),
                ("source", models.CharField(max_length=20)),
                ("source_ref", models.CharField(blank=True, default="", max_length=200)),
                ("correlation_id", models.CharField(blank=True, default="", max_length=200)),
                ("created_at", models.DateTimeField(db_default=models.Func(function="now"), editable=False)),
                ("created_by", models.ForeignKey(blank=True, db_index=False, null=True,
                                                 on_delete=django.db.models.deletion.SET_NULL, related_name="+",
                                                 to=settings.AUTH_USER_MODEL)),
                ("service", models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT,
                                              related_name="+", to="workflows.service")),
                ("tenant", models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT,
                                             related_name="+", to="tenants.tenant")),
            ],
            options={
                "db_table": "accs_start",
                "indexes": [models.Index(models.F("service"), models.F("tenant"),
                                         models.OrderBy(models.F("priority"), descending=True), models.F("order_seq"),
                                         models.F("id"), name="start_claim_idx")],
            },
        ),
        migrations.RunSQL(WIDEN, [REFUSE_LEFT, DROP_WIDEN]),
        migrations.RunSQL(NARROW_START, DROP_NARROW),
        migrations.RunSQL(CLAIM, _claims_before.CLAIM),
        migrations.RunSQL(KEYED_CLAIM, _claims_before.KEYED_CLAIM),
    ]
