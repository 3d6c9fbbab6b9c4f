"""The keyed claim's map of the queue: each queued task's key, and where each key's queue begins.

A service with a per-key limit (``concurrency_key`` / ``rate_key``) limits the tasks of each value of
a params path, and its claim has to pass over the keys at their limit. Reading each queued task's
params to learn its key made that cost grow with every queued task of a full key (40,000 such
tasks ahead of the first key with room cost 16 times an unkeyed claim). Two structures make it
follow the number of full keys instead (each passed over in one small row, however many tasks it
has queued):

* ``accs_task.limit_key``: a queued task's key, read by ``task_limit_key_idx`` (a tenant's queue by
  key, then in the claim order): a key's first tasks in one index descent;
* ``accs_limit_key_head`` (:class:`jobs.models.LimitKeyHead`): per service, tenant and key, a row
  whose position in the claim order is at or before the key's first queued task. The claim reads
  these rows in order, skips the keys at their limit, and takes the first tasks of the others.

The database keeps both, so every writer agrees, the previous release's daemons included (they
know nothing of either):

* ``accs_limit_key_path``: the path a service's tasks are keyed by: its ``concurrency_key`` when it
  has a per-key cap, else its ``rate_key`` when it has a per-key rate, else whichever path it names;
  NULL for a service that names none (its tasks are not keyed and get no rows).
* ``accs_task_limit_key`` (BEFORE INSERT, and BEFORE UPDATE of status, params or service): a task
  that becomes queued, or a queued task whose params change, gets its key from the service's path
  as the service row holds it now, read ``FOR SHARE``: a change of the path in flight and the tasks
  being queued wait for each other, so none is keyed by a path already replaced. A host-free task
  is then covered: a row of its key at or before it is locked ``FOR KEY SHARE`` (so no claim moves
  it past the task before this transaction commits), or a row at the task is added. Queueing tasks
  never wait for each other (shared locks, inserts).
* ``accs_service_rekey`` (AFTER UPDATE of a service's key fields, when its path changes): its queued
  tasks are keyed again and its rows rebuilt, in the same transaction.

Only the claim (under the service's claim lock) moves rows later or removes them: a row it read
whose key's first task now lies later is moved there, and a key it found empty is marked and
settled by a second statement of the same transaction (:data:`SETTLE_SQL`), which sees every task
committed before the claim locked the row, so a task queued meanwhile is never left without a row.
A row locked by a transaction queueing a task is skipped, never waited for.

A key's rows are also marked while the key is at its limit, so the claim's walk (an index that
leaves marked rows out) never visits a full key: ``cap_full`` follows the key's held count
(``accs_key_held_move``, called by the count's trigger once per statement: the count rows in
(service, key) order, so two statements never take them in opposite orders, then the marks that
flip, which only the holder of their key's count row writes), ``rate_until`` its starts
(``accs_rate_start_block``, on each start: until the earliest of the newest ``rate_key_limit``
starts leaves the window, the key has no room); a claim clears the rate marks that ran out before
it walks, and a change of a service's limits rewrites its rows' marks (``accs_service_key_limits``)
under an advisory lock per service that the other two share, so no mark is computed from a
replaced limit. A mark can only be late in the safe direction (a full key not yet marked is
visited and found full); a key with room is never left marked.

Neither structure is the limit itself: the claim reads each task's key from its params again where
it picks it, so a wrong key or row could delay a task, never let a key exceed its limit.

A migration holds a copy of :data:`LIMIT_KEY_SQL` (0039); a test compares them.
"""

from __future__ import annotations

# The SQL expression of a task's key at the path {path} (NULL: the service names no path).
# The same value as jobs.claim.params_key_sql reads from a task's params.
KEY_AT_PATH = "CASE WHEN {path} IS NULL THEN NULL ELSE coalesce({params} #>> string_to_array({path}, '.'), '') END"


# Each statement's starts of keys under a rate (a claim records all of its starts in one): once a
# key's starts fill its window, its rows are passed over until the earliest of them leaves the window
# (a claim clears the blocks that ran out before it walks). Kept from the starts themselves, so every
# writer of a start is followed; one trigger call per statement, each key looked at once, each
# service's lock (shared) taken in id order.
RATE_START_BLOCK_SQL = """
CREATE OR REPLACE FUNCTION accs_rate_start_block() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('accs:key-limits:' || n.service_id))
       FROM (SELECT DISTINCT service_id FROM accs_rate_started WHERE key IS NOT NULL ORDER BY 1) n;
    -- The start that leaves the window last among the newest rate_key_limit: until then the window
    -- is full (for a key whose earliest start of this statement is still inside it).
    UPDATE accs_limit_key_head h SET rate_until = b.until
      FROM (SELECT n.service_id, n.key, n.at,
                   (SELECT r.at + make_interval(secs => s.rate_period_seconds) FROM accs_rate_start r
                     WHERE r.service_id = n.service_id AND r.key = n.key
                     ORDER BY r.service_id DESC, r.key DESC, r.at DESC OFFSET s.rate_key_limit - 1 LIMIT 1) AS until
              FROM (SELECT service_id, key, min(at) AS at FROM accs_rate_started WHERE key IS NOT NULL
                     GROUP BY 1, 2) n
              JOIN accs_service s ON s.id = n.service_id AND s.rate_key_limit > 0
                                 AND s.rate_key = accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key,
                                                                      s.rate_key_limit, s.rate_key)) b
     WHERE b.until > b.at AND h.service_id = b.service_id AND h.key = b.key COLLATE "C"
       AND h.rate_until IS DISTINCT FROM b.until;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS accs_rate_start_block ON accs_rate_start;
CREATE TRIGGER accs_rate_start_block AFTER INSERT ON accs_rate_start REFERENCING NEW TABLE AS accs_rate_started
    FOR EACH STATEMENT EXECUTE FUNCTION accs_rate_start_block();
"""

# The held count per key and the marks of the keys at their cap, kept per statement (jobs.0045; jobs.0039
# kept them per task, and two statements whose keys interleave could wait for each other in a cycle).
KEY_HELD_SQL = """-- Held tasks per key (the per-key cap's count), kept by the database on each task's way into and
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

KEY_HELD_TRIGGERS_SQL = """-- Per statement (jobs.0045); jobs.0039's per-row triggers go.
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

# A change of a service's per-key limits (jobs.0046; jobs.0039 counted every keyed service's held tasks).
KEY_LIMITS_SQL = """-- A change of a service's per-key limits: every row of it follows the new cap and the new rate at
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

LIMIT_KEY_SQL = f"""
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
    NEW.limit_key := {KEY_AT_PATH.format(path="v_path", params="NEW.params")};
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
    UPDATE accs_task t SET limit_key = {KEY_AT_PATH.format(path="v_path", params="t.params")}
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
    UPDATE accs_task t SET limit_key = {KEY_AT_PATH.format(path="v_path", params="t.params")}
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

{KEY_HELD_SQL}{RATE_START_BLOCK_SQL.strip()}

{KEY_LIMITS_SQL}{KEY_HELD_TRIGGERS_SQL}
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

DROP_LIMIT_KEY_SQL = """
DROP TRIGGER IF EXISTS accs_service_relimit ON accs_service;
DROP TRIGGER IF EXISTS accs_rate_start_block ON accs_rate_start;
DROP FUNCTION IF EXISTS accs_service_key_limits();
DROP FUNCTION IF EXISTS accs_rate_start_block();
DROP TRIGGER IF EXISTS accs_service_rekey ON accs_service;
DROP TRIGGER IF EXISTS accs_task_limit_key_update ON accs_task;
DROP TRIGGER IF EXISTS accs_task_limit_key_insert ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_delete ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_moves ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_out ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
DROP FUNCTION IF EXISTS accs_task_key_held();
DROP FUNCTION IF EXISTS accs_key_held_move(bigint[], text[], int[]);
DROP FUNCTION IF EXISTS accs_key_cap_follow(bigint, text, int);
DROP FUNCTION IF EXISTS accs_service_rekey();
DROP FUNCTION IF EXISTS accs_task_limit_key();
DROP FUNCTION IF EXISTS accs_limit_key_path(int, text, int, text);
"""

# The rows a claim found empty (its own: it holds the claim lock of these services), seen again
# after the claim statement: its transaction holds their row locks, so every task queued before it
# took them is visible now, and every later one waits for this transaction and then adds its own
# row. A key with a queued task gets its row back at that task; the others' rows go.
SETTLE_SQL = """
WITH e AS (
    SELECT h.id, f.id AS task_id, f.priority, f.order_seq, f.created_at
      FROM accs_limit_key_head h LEFT JOIN LATERAL (
        SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
         WHERE t.service_id = h.service_id AND t.tenant_id = h.tenant_id AND t.status = 'queued'
           AND t.host_id IS NULL AND t.limit_key = h.key
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) f ON true
     WHERE h.emptied AND h.service_id = ANY(%(svc_ids)s::bigint[])
), back AS (
    UPDATE accs_limit_key_head h SET emptied = false, priority = e.priority, order_seq = e.order_seq,
           created_at = e.created_at, task_id = e.task_id
      FROM e WHERE h.id = e.id AND e.task_id IS NOT NULL
)
DELETE FROM accs_limit_key_head h USING e WHERE h.id = e.id AND e.task_id IS NULL
"""

# The keys of queued tasks written before the triggers existed (migration 0039 runs a copy): a batch
# in id order after ``after`` (keyset pagination, so each batch is one short transaction), returning
# the batch's last id.
BACKFILL_KEYS_SQL = f"""
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
    UPDATE accs_task t SET limit_key = {KEY_AT_PATH.format(path="l.path", params="l.params")}
      FROM locked l WHERE t.id = l.id AND l.path IS NOT NULL
)
SELECT max(id::text) FROM batch
"""

# Then a row for each key of those tasks (a key that has one already gets a second: harmless, the
# claim merges a key's rows as it reads them).
BACKFILL_HEADS_SQL = """
INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id, emptied)
SELECT DISTINCT ON (t.service_id, t.tenant_id, t.limit_key) t.service_id, t.tenant_id, t.limit_key, t.priority,
       t.order_seq, t.created_at, t.id, false
  FROM accs_task t
 WHERE t.status = 'queued' AND t.host_id IS NULL AND t.limit_key IS NOT NULL
 ORDER BY t.service_id, t.tenant_id, t.limit_key, t.priority DESC, t.order_seq, t.created_at, t.id
"""


# The held tasks of keyed services held before the triggers existed (migration 0039 runs a copy):
# each gets its key and is counted in the same transaction, while locked (a task leaving held work
# after this is uncounted by the trigger; one that left before was never counted). A batch in id
# order after ``after``, returning the batch's last id.
BACKFILL_HELD_SQL = f"""
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
    UPDATE accs_task t SET limit_key = {KEY_AT_PATH.format(path="l.path", params="l.params")}
      FROM locked l WHERE t.id = l.id AND l.path IS NOT NULL
    RETURNING t.service_id, t.limit_key
), counted AS (
    INSERT INTO accs_limit_key_held AS k (service_id, key, held)
    SELECT service_id, limit_key, count(*) FROM upd GROUP BY 1, 2
    ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + excluded.held
)
SELECT max(id::text) FROM batch
"""
