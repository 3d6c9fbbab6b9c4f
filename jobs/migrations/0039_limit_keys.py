"""The keyed claim's map of the queue: each queued task's key, and where each key's queue begins.

The keyed claim passes over the keys at their limit one small row each (accs_limit_key_head),
and finds a key's first tasks by an index by key (task_limit_key_idx), instead of reading the
params of every queued task of those keys. jobs.limit_keys says how the database keeps both,
jobs.claim how the claim reads them.

Safe while the previous release's daemons run:

* the new tables are read and written only by the triggers below and the new release's claim; the
  held counts (accs_limit_key_held) are kept by triggers on every task's way into and out of held
  work, so the previous release's claims and reports keep them exact too, and the tasks held
  before the triggers are counted by a backfill that locks each while it keys and counts it;
* the column is nullable without a default: adding it changes the catalogue only (a brief lock,
  bounded by ``lock_timeout``: the migration fails rather than queue the daemons behind it);
* the triggers are created in one short transaction (SHARE ROW EXCLUSIVE on accs_task and
  accs_service, bounded the same way); from then on every task that becomes queued is keyed and
  covered by the database, whichever release wrote it, so the previous release's writers need not
  know of either;
* the tasks queued before are keyed in short batches (one transaction each, rows locked in id
  order), then each of their keys gets its row;
* the index on accs_task is built CONCURRENTLY (the migration is not atomic for that reason).

The previous release's claim never reads the column nor the table. The functions and triggers are
a copy of jobs.limit_keys.LIMIT_KEY_SQL (a test compares them).

Last, the keyed claim as one server-side function (jobs.claim.KEYED_CLAIM_FUNCTION: the general
path's reads, locks, claim statement and settling in one round trip, its plans cached per server
connection): a new function, which the previous release never calls; a frozen copy of
jobs.claim.keyed_claim_function_sql() (a test compares the database's function with the code).
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

LIMIT_KEY_SQL = r"""
CREATE OR REPLACE FUNCTION accs_limit_key_path(p_climit int, p_cpath text, p_rlimit int, p_rpath text)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_climit > 0 AND p_cpath <> '' THEN p_cpath
                WHEN p_rlimit > 0 AND p_rpath <> '' THEN p_rpath
                ELSE coalesce(nullif(p_cpath, ''), nullif(p_rpath, '')) END
$$;

CREATE OR REPLACE FUNCTION accs_task_limit_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_path text;
    v_cap int;
    v_full boolean;
BEGIN
    SELECT accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key),
           CASE WHEN s.concurrency_key_limit > 0 AND s.concurrency_key = accs_limit_key_path(
                    s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
                THEN s.concurrency_key_limit END
      INTO v_path, v_cap FROM accs_service s WHERE s.id = NEW.service_id FOR SHARE;
    NEW.limit_key := CASE WHEN v_path IS NULL THEN NULL ELSE coalesce(NEW.params #>> string_to_array(v_path, '.'), '') END;
    IF NEW.limit_key IS NOT NULL AND NEW.host_id IS NULL THEN
        PERFORM 1 FROM accs_limit_key_head h
         WHERE h.service_id = NEW.service_id AND h.tenant_id = NEW.tenant_id AND h.key = NEW.limit_key
           AND NOT h.emptied
           AND (h.priority > NEW.priority OR (h.priority = NEW.priority
                AND (h.order_seq, h.created_at, h.task_id) <= (NEW.order_seq, NEW.created_at, NEW.id)))
         LIMIT 1 FOR KEY SHARE;
        IF NOT FOUND THEN
            -- A new row of a key whose held tasks fill its cap starts passed over. The count is read
            -- locked, so a finish in flight is waited for (and seen), and a later one waits for this
            -- row and then clears it.
            SELECT k.held >= v_cap INTO v_full FROM accs_limit_key_held k
             WHERE v_cap IS NOT NULL AND k.service_id = NEW.service_id AND k.key = NEW.limit_key FOR SHARE;
            INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id,
                                             emptied, cap_full)
            VALUES (NEW.service_id, NEW.tenant_id, NEW.limit_key, NEW.priority, NEW.order_seq, NEW.created_at,
                    NEW.id, false, coalesce(v_full, false));
        END IF;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS accs_task_limit_key_insert ON accs_task;
CREATE TRIGGER accs_task_limit_key_insert BEFORE INSERT ON accs_task
    FOR EACH ROW WHEN (NEW.status = 'queued') EXECUTE FUNCTION accs_task_limit_key();

DROP TRIGGER IF EXISTS accs_task_limit_key_update ON accs_task;
CREATE TRIGGER accs_task_limit_key_update BEFORE UPDATE OF status, params, service_id ON accs_task
    FOR EACH ROW WHEN (NEW.status = 'queued' AND (OLD.status <> 'queued' OR OLD.params IS DISTINCT FROM NEW.params
                                                  OR OLD.service_id <> NEW.service_id))
    EXECUTE FUNCTION accs_task_limit_key();

CREATE OR REPLACE FUNCTION accs_service_rekey() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_path text := accs_limit_key_path(NEW.concurrency_key_limit, NEW.concurrency_key, NEW.rate_key_limit,
                                       NEW.rate_key);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('accs:key-limits:' || NEW.id));
    UPDATE accs_task t SET limit_key = CASE WHEN v_path IS NULL THEN NULL ELSE coalesce(t.params #>> string_to_array(v_path, '.'), '') END
     WHERE t.id = ANY(ARRAY(SELECT x.id FROM accs_task x WHERE x.service_id = NEW.id AND x.status = 'queued'
                             ORDER BY x.id FOR UPDATE));
    DELETE FROM accs_limit_key_head h WHERE h.service_id = NEW.id;
    INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id, emptied)
    SELECT DISTINCT ON (t.tenant_id, t.limit_key) t.service_id, t.tenant_id, t.limit_key, t.priority, t.order_seq,
           t.created_at, t.id, false
      FROM accs_task t
     WHERE t.service_id = NEW.id AND t.status = 'queued' AND t.host_id IS NULL AND t.limit_key IS NOT NULL
     ORDER BY t.tenant_id, t.limit_key, t.priority DESC, t.order_seq, t.created_at, t.id;
    -- Its held tasks too, and their counts afresh: every task that could move in or out of held work
    -- is locked now (the queued ones above, the held ones here), so the count is exact.
    UPDATE accs_task t SET limit_key = CASE WHEN v_path IS NULL THEN NULL ELSE coalesce(t.params #>> string_to_array(v_path, '.'), '') END
     WHERE t.id = ANY(ARRAY(SELECT x.id FROM accs_task x WHERE x.service_id = NEW.id
                                AND x.status IN ('starting', 'running') ORDER BY x.id FOR UPDATE));
    DELETE FROM accs_limit_key_held k WHERE k.service_id = NEW.id;
    INSERT INTO accs_limit_key_held (service_id, key, held)
    SELECT t.service_id, t.limit_key, count(*) FROM accs_task t
     WHERE t.service_id = NEW.id AND t.status IN ('starting', 'running') AND t.limit_key IS NOT NULL
     GROUP BY 1, 2;
    RETURN NULL;
END
$$;

-- Held tasks per key (the per-key cap's count), kept by the database on each task's way into and
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

-- Each start of a key under a rate: once the key's starts fill its window, its rows are passed over
-- until the earliest of them leaves the window (a claim clears the blocks that ran out before it
-- walks). Kept from the starts themselves, so every writer of a start is followed.
CREATE OR REPLACE FUNCTION accs_rate_start_block() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_limit int;
    v_period int;
    v_until timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('accs:key-limits:' || NEW.service_id));
    SELECT s.rate_key_limit, s.rate_period_seconds INTO v_limit, v_period FROM accs_service s
     WHERE s.id = NEW.service_id AND s.rate_key_limit > 0
       AND s.rate_key = accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                            s.rate_key);
    IF v_limit IS NULL THEN
        RETURN NULL;
    END IF;
    -- The start that leaves the window last among the newest v_limit: until then the window is full.
    SELECT r.at + make_interval(secs => v_period) INTO v_until FROM accs_rate_start r
     WHERE r.service_id = NEW.service_id AND r.key = NEW.key
     ORDER BY r.service_id DESC, r.key DESC, r.at DESC OFFSET v_limit - 1 LIMIT 1;
    IF v_until > NEW.at THEN
        UPDATE accs_limit_key_head h SET rate_until = v_until
         WHERE h.service_id = NEW.service_id AND h.key = NEW.key COLLATE "C"
           AND h.rate_until IS DISTINCT FROM v_until;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS accs_rate_start_block ON accs_rate_start;
CREATE TRIGGER accs_rate_start_block AFTER INSERT ON accs_rate_start
    FOR EACH ROW WHEN (NEW.key IS NOT NULL) EXECUTE FUNCTION accs_rate_start_block();

-- A change of a service's per-key limits: every row of it follows the new cap and the new rate at
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

DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
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

-- After accs_service_rekey (triggers of one event fire in name order), so rows it rebuilt are covered.
DROP TRIGGER IF EXISTS accs_service_relimit ON accs_service;
CREATE TRIGGER accs_service_relimit
    AFTER UPDATE OF concurrency_key, concurrency_key_limit, rate_key, rate_key_limit, rate_period_seconds
    ON accs_service
    FOR EACH ROW WHEN ((OLD.concurrency_key, OLD.concurrency_key_limit, OLD.rate_key, OLD.rate_key_limit,
                        OLD.rate_period_seconds)
                       IS DISTINCT FROM (NEW.concurrency_key, NEW.concurrency_key_limit, NEW.rate_key,
                                         NEW.rate_key_limit, NEW.rate_period_seconds))
    EXECUTE FUNCTION accs_service_key_limits();

DROP TRIGGER IF EXISTS accs_service_rekey ON accs_service;
CREATE TRIGGER accs_service_rekey
    AFTER UPDATE OF concurrency_key, concurrency_key_limit, rate_key, rate_key_limit ON accs_service
    FOR EACH ROW WHEN (accs_limit_key_path(OLD.concurrency_key_limit, OLD.concurrency_key, OLD.rate_key_limit,
                                           OLD.rate_key)
                       IS DISTINCT FROM accs_limit_key_path(NEW.concurrency_key_limit, NEW.concurrency_key,
                                                            NEW.rate_key_limit, NEW.rate_key))
    EXECUTE FUNCTION accs_service_rekey();
"""

DROP_LIMIT_KEY_SQL = r"""
DROP TRIGGER IF EXISTS accs_service_relimit ON accs_service;
DROP TRIGGER IF EXISTS accs_rate_start_block ON accs_rate_start;
DROP FUNCTION IF EXISTS accs_service_key_limits();
DROP FUNCTION IF EXISTS accs_rate_start_block();
DROP TRIGGER IF EXISTS accs_service_rekey ON accs_service;
DROP TRIGGER IF EXISTS accs_task_limit_key_update ON accs_task;
DROP TRIGGER IF EXISTS accs_task_limit_key_insert ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_delete ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_out ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
DROP FUNCTION IF EXISTS accs_task_key_held();
DROP FUNCTION IF EXISTS accs_key_cap_follow(bigint, text, int);
DROP FUNCTION IF EXISTS accs_service_rekey();
DROP FUNCTION IF EXISTS accs_task_limit_key();
DROP FUNCTION IF EXISTS accs_limit_key_path(int, text, int, text);
"""

BACKFILL_KEYS_SQL = r"""
WITH batch AS (
    SELECT t.id FROM accs_task t
     WHERE t.status = 'queued' AND t.id > %(after)s::uuid
       AND t.service_id IN (SELECT s.id FROM accs_service s
                             WHERE accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                                       s.rate_key) IS NOT NULL)
     ORDER BY t.id LIMIT %(limit)s
), locked AS (
    SELECT t.id, accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                     s.rate_key) AS path, t.params
      FROM accs_task t JOIN accs_service s ON s.id = t.service_id
     WHERE t.id IN (SELECT id FROM batch) AND t.status = 'queued'
     ORDER BY t.id FOR UPDATE OF t
), upd AS (
    UPDATE accs_task t SET limit_key = CASE WHEN l.path IS NULL THEN NULL ELSE coalesce(l.params #>> string_to_array(l.path, '.'), '') END
      FROM locked l WHERE t.id = l.id AND l.path IS NOT NULL
)
SELECT max(id::text) FROM batch
"""

BACKFILL_HELD_SQL = r"""
WITH batch AS (
    SELECT t.id FROM accs_task t
     WHERE t.status IN ('starting', 'running') AND t.limit_key IS NULL AND t.id > %(after)s::uuid
       AND t.service_id IN (SELECT s.id FROM accs_service s
                             WHERE accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                                       s.rate_key) IS NOT NULL)
     ORDER BY t.id LIMIT %(limit)s
), locked AS (
    SELECT t.id, accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit,
                                     s.rate_key) AS path, t.params
      FROM accs_task t JOIN accs_service s ON s.id = t.service_id
     WHERE t.id IN (SELECT id FROM batch) AND t.status IN ('starting', 'running') AND t.limit_key IS NULL
     ORDER BY t.id FOR UPDATE OF t
), upd AS (
    UPDATE accs_task t SET limit_key = CASE WHEN l.path IS NULL THEN NULL ELSE coalesce(l.params #>> string_to_array(l.path, '.'), '') END
      FROM locked l WHERE t.id = l.id AND l.path IS NOT NULL
    RETURNING t.service_id, t.limit_key
), counted AS (
    INSERT INTO accs_limit_key_held AS k (service_id, key, held)
    SELECT service_id, limit_key, count(*) FROM upd GROUP BY 1, 2
    ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + excluded.held
)
SELECT max(id::text) FROM batch
"""

BACKFILL_HEADS_SQL = r"""
INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id, emptied)
SELECT DISTINCT ON (t.service_id, t.tenant_id, t.limit_key) t.service_id, t.tenant_id, t.limit_key, t.priority,
       t.order_seq, t.created_at, t.id, false
  FROM accs_task t
 WHERE t.status = 'queued' AND t.host_id IS NULL AND t.limit_key IS NOT NULL
 ORDER BY t.service_id, t.tenant_id, t.limit_key, t.priority DESC, t.order_seq, t.created_at, t.id
"""

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
    SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key, least(CASE WHEN svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.climit - coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id AND k.key = (h.key COLLATE "C")), 0) END, CASE WHEN svc.rlimit > 0 AND svc.rpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath) THEN svc.rlimit - (SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = (h.key COLLATE "default") AND r.at > v_stamp - make_interval(secs => svc.period))::int END) AS kleft
      FROM kheads h JOIN svc ON svc.id = h.service_id
     ORDER BY h.service_id, h.tenant_id, h.key
), ktasks AS (
    SELECT k.service_id, k.tenant_id, f.*
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
    SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at
      FROM kkeys k LEFT JOIN LATERAL (
        SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
         WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
           AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
), kstale AS (
    SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at
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
           emptied = s.first_id IS NULL
      FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
), kdropped AS (
    DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
)
SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params, upd.timeout_seconds, h.name::text, upd.service_id,
       coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id;
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

DROP_KEYED_CLAIM = ("DROP FUNCTION IF EXISTS accs_claim_keyed(bigint[], int[], int[], int[], text[], text, text, int,"
                    " text, timestamptz, int, int, int, float8, bigint[], uuid[], int)")


def backfill(apps, schema_editor):
    """Key the tasks queued before the triggers existed, a short batch at a time; then their keys' rows; then
    key and count the tasks held before them."""
    after = "00000000-0000-0000-0000-000000000000"
    with schema_editor.connection.cursor() as cur:
        while True:
            cur.execute(BACKFILL_KEYS_SQL, {"after": after, "limit": 2000})
            last = cur.fetchone()[0]
            if last is None:
                break
            after = last
        cur.execute(BACKFILL_HEADS_SQL)
        after = "00000000-0000-0000-0000-000000000000"
        while True:
            cur.execute(BACKFILL_HELD_SQL, {"after": after, "limit": 2000})
            last = cur.fetchone()[0]
            if last is None:
                break
            after = last


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction; each step is its own

    dependencies = [
        ("jobs", "0038_attempt_task_refs"),
        ("workflows", "0005_code_definitions"),
    ]

    operations = [
        migrations.CreateModel(
            name='LimitKeyHead',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('service_id', models.BigIntegerField()),
                ('tenant_id', models.UUIDField()),
                ('key', models.TextField(db_collation='C')),
                ('priority', models.IntegerField()),
                ('order_seq', models.BigIntegerField()),
                ('created_at', models.DateTimeField()),
                ('task_id', models.UUIDField(help_text="The task this position was taken from (the order's last tie-break).")),
                ('emptied', models.BooleanField(default=False, help_text="Set by a claim that found the key's queue empty; settled before that claim commits.")),
                ('cap_full', models.BooleanField(db_default=False, help_text="The key's held tasks fill its cap (kept by the held counts' trigger): the claim passes it over.")),
                ('rate_until', models.DateTimeField(blank=True, null=True, help_text='The key\'s starts fill its rate window until then: the claim passes it over.')),
            ],
            options={
                'db_table': 'accs_limit_key_head',
            },
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(models.F('service_id'), models.F('tenant_id'), models.OrderBy(models.F('priority'), descending=True), models.F('order_seq'), models.F('created_at'), models.F('task_id'), condition=models.Q(('cap_full', False), ('rate_until__isnull', True)), name='limit_key_head_order_idx'),
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(fields=['service_id', 'key', 'tenant_id'], name='limit_key_head_key_idx'),
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(condition=models.Q(('rate_until__isnull', False)), fields=['service_id', 'rate_until'], name='limit_key_head_rate_until_idx'),
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(condition=models.Q(('emptied', True)), fields=['service_id'], name='limit_key_head_emptied_idx'),
        ),
        migrations.CreateModel(
            name='LimitKeyHeld',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('service_id', models.BigIntegerField()),
                ('key', models.TextField(db_collation='C')),
                ('held', models.IntegerField()),
            ],
            options={
                'db_table': 'accs_limit_key_held',
                'constraints': [models.UniqueConstraint(fields=('service_id', 'key'), name='limit_key_held_key_uniq')],
            },
        ),
        migrations.RunSQL("SET lock_timeout = '5s'", "RESET lock_timeout"),
        migrations.AddField(
            model_name="task",
            name="limit_key",
            field=models.TextField(blank=True, db_collation="C", editable=False, null=True,
                                   help_text="The key under the service's per-key limit (kept by a trigger)."),
        ),
        migrations.RunSQL("BEGIN;" + LIMIT_KEY_SQL + "COMMIT;", DROP_LIMIT_KEY_SQL),
        migrations.RunSQL("RESET lock_timeout", "SET lock_timeout = '5s'"),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(models.F("service"), models.F("tenant"), models.F("limit_key"),
                               models.OrderBy(models.F("priority"), descending=True), models.F("order_seq"),
                               models.F("created_at"), models.F("id"),
                               condition=models.Q(("host__isnull", True), ("limit_key__isnull", False),
                                                  ("status", "queued")),
                               name="task_limit_key_idx"),
        ),
        migrations.RunSQL(KEYED_CLAIM, DROP_KEYED_CLAIM),
    ]
