"""A claim reads the tasks bound to the node's hosts without locks, then locks only those it may take.

Before, the claim locked, for each of the node's hosts, the first queued tasks of each service (FOR UPDATE
SKIP LOCKED, up to the service's room per host), and then took a few: a node of 500 hosts in a 1,000-host
fan-out locked 500 rows at every claim (9-13 ms) to start 1-3 tasks as slots freed up. Now the heads are
read without locks (the same index probes), each service's and tenant's first ones (as many as the
service's room, what the scan of unbound tasks reads of each tenant) are locked by id with SKIP LOCKED, and
a row another claimer took meanwhile is passed over (still queued once locked). Claimers of one node
already take its lock before claiming, so no task is lost to that pass.

``accs_claim_plain`` (jobs.claim.plain_claim_function_sql, a frozen copy of its text) is replaced; its name,
arguments and result are unchanged, so the previous release's agents call it as before. Going back restores
the previous text.
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
                   (EXISTS (SELECT 1 FROM accs_task t
                     WHERE t.service_id = s.id AND t.status = 'queued' AND t.host_id IS NULL)
            OR EXISTS (SELECT 1 FROM accs_task t JOIN accs_host h ON h.id = t.host_id
                        WHERE h.node_id = p_node AND t.service_id = s.id AND t.status = 'queued'))
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
               || coalesce(array_agg(c.id) FILTER (WHERE NOT (EXISTS (SELECT 1 FROM accs_task t
                     WHERE t.service_id = c.id AND t.status = 'queued' AND t.host_id IS NULL)
            OR EXISTS (SELECT 1 FROM accs_task t JOIN accs_host h ON h.id = t.host_id
                        WHERE h.node_id = p_node AND t.service_id = c.id AND t.status = 'queued'))), '{}')
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

_before = import_module("jobs.migrations.0033_claim_skips_paused_tenants")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0034_step_outputs")]

    operations = [migrations.RunSQL(CLAIM, _before.CLAIM)]
