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

Neither structure is the limit itself: the claim reads each task's key from its params again where
it picks it, so a wrong key or row could delay a task, never let a key exceed its limit.

A migration holds a copy of :data:`LIMIT_KEY_SQL` (0032); a test compares them.
"""

from __future__ import annotations

# The SQL expression of a task's key at the path {path} (NULL: the service names no path).
# The same value as jobs.claim.params_key_sql reads from a task's params.
KEY_AT_PATH = "CASE WHEN {path} IS NULL THEN NULL ELSE coalesce({params} #>> string_to_array({path}, '.'), '') END"


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
BEGIN
    SELECT accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
      INTO v_path FROM accs_service s WHERE s.id = NEW.service_id FOR SHARE;
    NEW.limit_key := {KEY_AT_PATH.format(path="v_path", params="NEW.params")};
    IF NEW.limit_key IS NOT NULL AND NEW.host_id IS NULL THEN
        PERFORM 1 FROM accs_limit_key_head h
         WHERE h.service_id = NEW.service_id AND h.tenant_id = NEW.tenant_id AND h.key = NEW.limit_key
           AND NOT h.emptied
           AND (h.priority > NEW.priority OR (h.priority = NEW.priority
                AND (h.order_seq, h.created_at, h.task_id) <= (NEW.order_seq, NEW.created_at, NEW.id)))
         LIMIT 1 FOR KEY SHARE;
        IF NOT FOUND THEN
            INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id,
                                             emptied)
            VALUES (NEW.service_id, NEW.tenant_id, NEW.limit_key, NEW.priority, NEW.order_seq, NEW.created_at,
                    NEW.id, false);
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

-- Held tasks per key (the per-key cap's count), kept by the database on each task's way into and
-- out of held work, in the transaction that moves it, whichever release's daemon moves it
-- (accs_limit_key_held: jobs.models.LimitKeyHeld).
CREATE OR REPLACE FUNCTION accs_task_key_held() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_ARGV[0] = 'in' THEN
        INSERT INTO accs_limit_key_held AS k (service_id, key, held) VALUES (NEW.service_id, NEW.limit_key, 1)
        ON CONFLICT (service_id, key) DO UPDATE SET held = k.held + 1;
    ELSE
        UPDATE accs_limit_key_held k SET held = k.held - 1
         WHERE k.service_id = OLD.service_id AND k.key = OLD.limit_key;
    END IF;
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
DROP TRIGGER IF EXISTS accs_service_rekey ON accs_service;
DROP TRIGGER IF EXISTS accs_task_limit_key_update ON accs_task;
DROP TRIGGER IF EXISTS accs_task_limit_key_insert ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_delete ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_out ON accs_task;
DROP TRIGGER IF EXISTS accs_task_key_held_in ON accs_task;
DROP FUNCTION IF EXISTS accs_task_key_held();
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

# The keys of queued tasks written before the triggers existed (migration 0032 runs a copy): a batch
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


# The held tasks of keyed services held before the triggers existed (migration 0032 runs a copy):
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
