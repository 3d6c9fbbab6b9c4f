"""Two claim functions replaced: the look for queued work probes its index, and a keyed claim marks the keys it fills.

* ``accs_claim_plain`` looked for a service's queued tasks with an EXISTS, which its generic plan (made
  from the statistics at a connection's first call) read as a scan of the task table from its start
  where most tasks were that service's queued ones: behind another service's 50,000 tasks, 11 ms a
  claim instead of a probe (the keyed claim benchmark's services). It now reads the first row of
  task_claim_idx (and of task_claim_host_idx per host of the node), in the index's order.
* ``accs_claim_keyed`` sets a key's cap or rate mark in the same update that moves its row, when the
  claim took all the room the key had left; the triggers that keep the marks (jobs.limit_keys) then
  find them set and write nothing, where each row was written twice per claim before. And it runs the
  claim statement built for the kinds of limit its services have (a per-key cap, a per-key rate, both
  or neither; starts recorded or not) instead of one with every part: a smaller plan to start at
  every call (0.4-0.5 ms of a claim of a per-key cap alone).
* The held counts per key (``accs_limit_key_held``) are kept only for a service with a per-key cap on the
  path its tasks are keyed by, the only ones a claim reads: a per-key rate alone, or a path without a
  limit, no longer pays an upsert per claimed and finished task (``accs_key_held_move``). A change of a
  service's limits counts its held tasks afresh when it gains such a cap, and forgets them when it loses
  it (``accs_service_key_limits``); the counts of services without one are deleted here.

Safe under the previous release's daemons: both functions keep their names, arguments and results, so
its agents call them as before (a connection plans a replaced function again at its next call), and
``CREATE OR REPLACE FUNCTION`` takes no lock on a table. Frozen copies of
jobs.claim.plain_claim_function_sql() and keyed_claim_function_sql() (a test compares the database's
functions with the code); going back restores jobs.0035's plain function with jobs.0036's setting,
and jobs.0039's keyed function; jobs.0045's count function and jobs.0039's change of limits, with the
counts of every keyed service's held tasks restored.
"""

from importlib import import_module

from django.db import migrations

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
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
           'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
      FROM upd
)
SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
       coalesce((v_leases ->> upd.service_id::text)::float8, p_lease), NULL::text
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
            END IF;
        END IF;
    END claiming;
    -- The services left out for the caller to handle, each as a row without a task: those with a
    -- rate or per-key limit ('limited': the general path claims them) and the capped ones whose lock
    -- was busy ('busy': claim them again soon).
    RETURN QUERY SELECT NULL::uuid, NULL::uuid, NULL::text, NULL::int, NULL::jsonb, NULL::int, NULL::text, l.id,
                        NULL::float8, l.why
                   FROM (SELECT x, 'limited' FROM unnest(v_limited) AS x
                         UNION ALL SELECT x, 'busy' FROM unnest(v_busy) AS x) AS l(id, why);
END
$claim$"""

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
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
               'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
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
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
               'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
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
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
               'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
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
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
               'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
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
        INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
        SELECT v_stamp, job_id, id, attempt, p_source, 'info', 'status',
               'task queued → starting', jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', p_agent::text)
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
$claim$"""

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
-- key rows whose cap flag flips (held >= the cap: the claim's walk leaves them out). Only a service
-- with a per-key cap on the path its tasks are keyed by is counted (a per-key rate alone, or a path
-- without a limit, reads no count): its limits are read under the lock, which a change of them takes
-- before it counts the service's held tasks afresh (accs_service_key_limits), so a move is either
-- seen by that count or counted here.
CREATE OR REPLACE FUNCTION accs_key_held_move(p_services bigint[], p_keys text[], p_deltas int[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_services bigint[];
    v_keys text[];
    v_deltas int[];
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('accs:key-limits:' || s.id))
       FROM (SELECT DISTINCT x.id FROM unnest(p_services) AS x(id) ORDER BY 1) s;
    SELECT array_agg(m.service_id), array_agg(m.key), array_agg(m.delta) INTO v_services, v_keys, v_deltas
      FROM unnest(p_services, p_keys, p_deltas) AS m(service_id, key, delta)
      JOIN accs_service s ON s.id = m.service_id
     WHERE s.concurrency_key_limit > 0
       AND s.concurrency_key = accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                                   s.rate_key);
    IF v_services IS NULL THEN
        RETURN;
    END IF;
    -- A key without a row gets one on its way in; a move out of a key without a row changes nothing.
    INSERT INTO accs_limit_key_held AS k (service_id, key, held)
    SELECT d.service_id, d.key, d.delta
      FROM (SELECT m.service_id, m.key COLLATE "C" AS key, sum(m.delta)::int AS delta
              FROM unnest(v_services, v_keys, v_deltas) AS m(service_id, key, delta) GROUP BY 1, 2) d
     WHERE d.delta > 0 OR (d.delta < 0 AND EXISTS (SELECT 1 FROM accs_limit_key_held e
                                                     WHERE e.service_id = d.service_id AND e.key = d.key))
     ORDER BY d.service_id, d.key
    ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + excluded.held;
    -- Found by key, then locked in id order (a plan asked for key order walked every key row of the
    -- service). Any order does: a key's rows flip only under its count row's lock, taken above.
    WITH f AS MATERIALIZED (
        -- (The services here are those counted: each has a per-key cap on its key path.)
        SELECT h.id, h.cap_full, k.held >= s.concurrency_key_limit AS is_full
          FROM (SELECT DISTINCT m.service_id, m.key COLLATE "C" AS key
                  FROM unnest(v_services, v_keys) AS m(service_id, key)) d
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

KEY_LIMITS_SQL = r"""-- A change of a service's per-key limits: every row of it follows the new cap and the new rate at
-- once (one look at each key's held count and latest starts). The held counts are kept only while the
-- service has a per-key cap on the path its tasks are keyed by (accs_key_held_move): when it gains one
-- or the path changes they are counted afresh from its held tasks, when it loses it they go. The lock
-- waits for every move in flight (they share it), so the count sees each of them committed, and the
-- moves after it read the new limits and count themselves.
CREATE OR REPLACE FUNCTION accs_service_key_limits() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_path text := accs_limit_key_path(NEW.concurrency_key_limit, NEW.concurrency_key, NEW.rate_key_limit,
                                       NEW.rate_key);
    v_cap int := CASE WHEN NEW.concurrency_key_limit > 0 AND NEW.concurrency_key = v_path
                      THEN NEW.concurrency_key_limit END;
    v_rate int := CASE WHEN NEW.rate_key_limit > 0 AND NEW.rate_key = v_path THEN NEW.rate_key_limit END;
    v_was_counted text := CASE WHEN OLD.concurrency_key_limit > 0
                                    AND OLD.concurrency_key = accs_limit_key_path(
                                        OLD.concurrency_key_limit, OLD.concurrency_key, OLD.rate_key_limit,
                                        OLD.rate_key)
                               THEN OLD.concurrency_key END;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('accs:key-limits:' || NEW.id));
    IF v_cap IS NULL OR v_was_counted IS DISTINCT FROM v_path THEN
        DELETE FROM accs_limit_key_held k WHERE k.service_id = NEW.id;
        INSERT INTO accs_limit_key_held (service_id, key, held)
        SELECT t.service_id, t.limit_key, count(*) FROM accs_task t
         WHERE v_cap IS NOT NULL AND t.service_id = NEW.id AND t.status IN ('starting', 'running')
           AND t.limit_key IS NOT NULL
         GROUP BY 1, 2;
    END IF;
    UPDATE accs_limit_key_head h SET cap_full = x.full, rate_until = x.until
      FROM (SELECT h2.id, coalesce(k.held >= v_cap, false) AS full,
                   (SELECT nullif(greatest(r.at + make_interval(secs => NEW.rate_period_seconds), now()), now())
                      FROM accs_rate_start r
                     WHERE v_rate IS NOT NULL AND r.service_id = NEW.id AND r.key = (h2.key COLLATE "default")
                     ORDER BY r.service_id DESC, r.key DESC, r.at DESC OFFSET greatest(v_rate - 1, 0) LIMIT 1) AS until
              FROM accs_limit_key_head h2
              LEFT JOIN accs_limit_key_held k ON k.service_id = h2.service_id AND k.key = h2.key
             WHERE h2.service_id = NEW.id) x
     WHERE h.id = x.id AND (h.cap_full IS DISTINCT FROM x.full OR h.rate_until IS DISTINCT FROM x.until);
    RETURN NULL;
END
$$;

"""

KEY_LIMITS_0039 = r"""-- A change of a service's per-key limits: every row of it follows the new cap and the new rate at
-- once (one look at each key's held count and latest starts).
CREATE OR REPLACE FUNCTION accs_service_key_limits() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_path text := accs_limit_key_path(NEW.concurrency_key_limit, NEW.concurrency_key, NEW.rate_key_limit,
                                       NEW.rate_key);
    v_cap int := CASE WHEN NEW.concurrency_key_limit > 0 AND NEW.concurrency_key = v_path
                      THEN NEW.concurrency_key_limit END;
    v_rate int := CASE WHEN NEW.rate_key_limit > 0 AND NEW.rate_key = v_path THEN NEW.rate_key_limit END;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('accs:key-limits:' || NEW.id));
    UPDATE accs_limit_key_head h SET cap_full = x.full, rate_until = x.until
      FROM (SELECT h2.id, coalesce(k.held >= v_cap, false) AS full,
                   (SELECT nullif(greatest(r.at + make_interval(secs => NEW.rate_period_seconds), now()), now())
                      FROM accs_rate_start r
                     WHERE v_rate IS NOT NULL AND r.service_id = NEW.id AND r.key = (h2.key COLLATE "default")
                     ORDER BY r.service_id DESC, r.key DESC, r.at DESC OFFSET greatest(v_rate - 1, 0) LIMIT 1) AS until
              FROM accs_limit_key_head h2
              LEFT JOIN accs_limit_key_held k ON k.service_id = h2.service_id AND k.key = h2.key
             WHERE h2.service_id = NEW.id) x
     WHERE h.id = x.id AND (h.cap_full IS DISTINCT FROM x.full OR h.rate_until IS DISTINCT FROM x.until);
    RETURN NULL;
END
$$;

"""

# The counts of the services no longer counted (no per-key cap on their key path), and back.
CAPPED = ("s.concurrency_key_limit > 0 AND s.concurrency_key = accs_limit_key_path(s.concurrency_key_limit,"
          " s.concurrency_key, s.rate_key_limit, s.rate_key)")
FORGET_UNCOUNTED = f"""
DELETE FROM accs_limit_key_held k
 WHERE NOT EXISTS (SELECT 1 FROM accs_service s WHERE s.id = k.service_id AND {CAPPED});
"""
COUNT_ALL = f"""
INSERT INTO accs_limit_key_held AS k (service_id, key, held)
SELECT t.service_id, t.limit_key, count(*) FROM accs_task t JOIN accs_service s ON s.id = t.service_id
 WHERE t.status IN ('starting', 'running') AND t.limit_key IS NOT NULL AND NOT ({CAPPED})
 GROUP BY 1, 2
ON CONFLICT (service_id, key) DO UPDATE SET held = excluded.held;
"""

_plain_before = import_module("jobs.migrations.0035_host_claim_locks_what_it_takes")
_sort_off = import_module("jobs.migrations.0036_claim_plan_without_stale_statistics")
_keyed_before = import_module("jobs.migrations.0039_limit_keys")
_counts_before = import_module("jobs.migrations.0045_key_counts_in_order")


class Migration(migrations.Migration):
    atomic = False  # its own short transactions, the counts' with a bounded wait for their rows

    dependencies = [("jobs", "0045_key_counts_in_order")]

    operations = [
        migrations.RunSQL(CLAIM, [_plain_before.CLAIM,
                                  f"ALTER FUNCTION accs_claim_plain({_sort_off.ARGS}) SET enable_sort = off"]),
        migrations.RunSQL(KEYED_CLAIM, _keyed_before.KEYED_CLAIM),
        migrations.RunSQL("SET lock_timeout = '5s'", "RESET lock_timeout"),
        migrations.RunSQL("BEGIN;" + KEY_HELD_SQL + KEY_LIMITS_SQL + FORGET_UNCOUNTED + "COMMIT;",
                          "BEGIN;" + _counts_before.KEY_HELD_SQL + KEY_LIMITS_0039 + COUNT_ALL + "COMMIT;"),
        migrations.RunSQL("RESET lock_timeout", "SET lock_timeout = '5s'"),
    ]
