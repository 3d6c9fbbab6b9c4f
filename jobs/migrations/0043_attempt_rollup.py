"""The attempts rolled up per time bucket (jobs.attempt_rollup): the dashboard's charts and rates read
closed buckets from here and the attempts themselves only for the tail the builder has not folded yet (at
ten million events the seven-day dashboard sampled 2 x 50,000 attempts and took about 300 ms p95).

Safe under the previous release's daemons: three new tables, nothing else; the previous release neither
reads nor writes them, and nothing is added to the claim or the report (the builder's leader of this
release folds finished attempts in, off their path). Until the first folds catch up (``manage.py
accs_attempt_rollup``, or the builder's duty in bounded batches) the readers count the attempts as before.
"""

from django.db import migrations

# The queue wait's histogram columns (jobs.attempt_rollup.WAIT_BOUNDS: 19 bounds, 20 bins).
CREATE = """
CREATE TABLE accs_attempt_rollup (
    bucket timestamptz NOT NULL,
    service_id bigint,
    tenant_id uuid,
    attempts integer NOT NULL,
    succeeded integer NOT NULL,
    failed integer NOT NULL,
    wait_0 integer NOT NULL DEFAULT 0,
    wait_1 integer NOT NULL DEFAULT 0,
    wait_2 integer NOT NULL DEFAULT 0,
    wait_3 integer NOT NULL DEFAULT 0,
    wait_4 integer NOT NULL DEFAULT 0,
    wait_5 integer NOT NULL DEFAULT 0,
    wait_6 integer NOT NULL DEFAULT 0,
    wait_7 integer NOT NULL DEFAULT 0,
    wait_8 integer NOT NULL DEFAULT 0,
    wait_9 integer NOT NULL DEFAULT 0,
    wait_10 integer NOT NULL DEFAULT 0,
    wait_11 integer NOT NULL DEFAULT 0,
    wait_12 integer NOT NULL DEFAULT 0,
    wait_13 integer NOT NULL DEFAULT 0,
    wait_14 integer NOT NULL DEFAULT 0,
    wait_15 integer NOT NULL DEFAULT 0,
    wait_16 integer NOT NULL DEFAULT 0,
    wait_17 integer NOT NULL DEFAULT 0,
    wait_18 integer NOT NULL DEFAULT 0,
    wait_19 integer NOT NULL DEFAULT 0
);
-- The fold's ON CONFLICT key, and the readers' range by bucket; an attempt without a service or tenant
-- (none is written since jobs.0038) is one key too.
CREATE UNIQUE INDEX attempt_rollup_key ON accs_attempt_rollup (bucket, service_id, tenant_id) NULLS NOT DISTINCT;

CREATE TABLE accs_attempt_node_rollup (
    bucket timestamptz NOT NULL,
    node varchar(200) NOT NULL,
    service_id bigint,
    tenant_id uuid,
    attempts integer NOT NULL,
    succeeded integer NOT NULL,
    failed integer NOT NULL
);
CREATE UNIQUE INDEX attempt_node_rollup_key
    ON accs_attempt_node_rollup (bucket, node, service_id, tenant_id) NULLS NOT DISTINCT;

-- How far the fold has come: attempts started before folded_until are in the rollups, but for those
-- still running when they were folded (pending, counted once they finish).
CREATE TABLE accs_attempt_rollup_mark (
    name text PRIMARY KEY,
    folded_until timestamptz,
    folded_at timestamptz,
    pending bigint[] NOT NULL DEFAULT '{}'
);
INSERT INTO accs_attempt_rollup_mark (name) VALUES ('attempts');
"""

DROP = """
DROP TABLE accs_attempt_rollup_mark;
DROP TABLE accs_attempt_node_rollup;
DROP TABLE accs_attempt_rollup;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0042_step_inputs"),
    ]

    operations = [
        migrations.RunSQL(CREATE, DROP),
    ]
