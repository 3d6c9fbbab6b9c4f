"""The keyed claim's map of the queue: each queued task's key, and where each key's queue begins.

The keyed claim passes over the keys at their limit one small row each (accs_limit_key_head),
and finds a key's first tasks by an index by key (task_limit_key_idx), instead of reading the
params of every queued task of those keys. jobs.limit_keys says how the database keeps both,
jobs.claim how the claim reads them.

Safe while the previous release's daemons run:

* the new table is read and written only by the triggers below and the new release's claim;
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
a copy of jobs.limit_keys.LIMIT_KEY_SQL (a test compares them). (Numbered 0032: 0026 to 0031 are
other changes of the same release.)
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
BEGIN
    SELECT accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key)
      INTO v_path FROM accs_service s WHERE s.id = NEW.service_id FOR SHARE;
    NEW.limit_key := CASE WHEN v_path IS NULL THEN NULL ELSE coalesce(NEW.params #>> string_to_array(v_path, '.'), '') END;
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
    RETURN NULL;
END
$$;

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
DROP TRIGGER IF EXISTS accs_service_rekey ON accs_service;
DROP TRIGGER IF EXISTS accs_task_limit_key_update ON accs_task;
DROP TRIGGER IF EXISTS accs_task_limit_key_insert ON accs_task;
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

BACKFILL_HEADS_SQL = r"""
INSERT INTO accs_limit_key_head (service_id, tenant_id, key, priority, order_seq, created_at, task_id, emptied)
SELECT DISTINCT ON (t.service_id, t.tenant_id, t.limit_key) t.service_id, t.tenant_id, t.limit_key, t.priority,
       t.order_seq, t.created_at, t.id, false
  FROM accs_task t
 WHERE t.status = 'queued' AND t.host_id IS NULL AND t.limit_key IS NOT NULL
 ORDER BY t.service_id, t.tenant_id, t.limit_key, t.priority DESC, t.order_seq, t.created_at, t.id
"""


def backfill(apps, schema_editor):
    """Key the tasks queued before the triggers existed, a short batch at a time; then their keys' rows."""
    after = "00000000-0000-0000-0000-000000000000"
    with schema_editor.connection.cursor() as cur:
        while True:
            cur.execute(BACKFILL_KEYS_SQL, {"after": after, "limit": 2000})
            last = cur.fetchone()[0]
            if last is None:
                break
            after = last
        cur.execute(BACKFILL_HEADS_SQL)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction; each step is its own

    dependencies = [
        ("jobs", "0031_leader_term_acquired_idx"),
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
            ],
            options={
                'db_table': 'accs_limit_key_head',
            },
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(models.F('service_id'), models.F('tenant_id'), models.OrderBy(models.F('priority'), descending=True), models.F('order_seq'), models.F('created_at'), models.F('task_id'), name='limit_key_head_order_idx'),
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(fields=['service_id', 'tenant_id', 'key'], name='limit_key_head_key_idx'),
        ),
        migrations.AddIndex(
            model_name='limitkeyhead',
            index=models.Index(condition=models.Q(('emptied', True)), fields=['service_id'], name='limit_key_head_emptied_idx'),
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
    ]
