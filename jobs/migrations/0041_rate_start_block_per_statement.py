"""A key's rate marks are kept by one trigger call per statement of starts instead of one per start.

A claim records all of its starts in one statement; the trigger that marks a key whose starts fill
its window ran once per start (a lock, a look at the service, a look at the key's starts: three
statements each), about a twentieth of a keyed claim's time for a claim of ten. It now runs once per
statement over the statement's new starts (a transition table): each service's lock taken once, in
id order, and each key looked at once. The marks it writes are the same.

Safe under the previous release's daemons: the function and the trigger are replaced in one short
transaction (SHARE ROW EXCLUSIVE on accs_rate_start for the trigger, the wait bounded by
``lock_timeout``: the migration fails rather than queue claims behind it); the previous release's
claims insert starts as before and the new trigger follows them. The body is a copy of
jobs.limit_keys.RATE_START_BLOCK_SQL (a test compares them); back, jobs.0039's trigger per start.
"""

from django.db import migrations

RATE_START_BLOCK_SQL = r"""
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

# jobs.0039's trigger, one call per start, for a migration back.
RATE_START_BLOCK_0039 = r"""
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
"""


class Migration(migrations.Migration):
    atomic = False  # its own short transaction, with a bounded wait for the table's lock

    dependencies = [
        ("jobs", "0040_attempt_claimable_at"),
    ]

    operations = [
        migrations.RunSQL("SET lock_timeout = '5s'", "RESET lock_timeout"),
        migrations.RunSQL("BEGIN;" + RATE_START_BLOCK_SQL + "COMMIT;", "BEGIN;" + RATE_START_BLOCK_0039 + "COMMIT;"),
        migrations.RunSQL("RESET lock_timeout", "SET lock_timeout = '5s'"),
    ]
