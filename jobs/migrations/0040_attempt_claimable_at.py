"""Attempts carry the time their task became claimable for them (the task's ``next_attempt_at`` when the
attempt is written: the claim does not move it), so the dashboard's charts read a queue's wait from
attempts alone, not one task lookup per sampled attempt (at ten million events the dashboard took
over 300 ms p95, its seven-day range 1.4 s).

Safe under the previous release's daemons: the column is nullable without a default (a catalog change;
ACCESS EXCLUSIVE held for milliseconds once granted, in its own transaction, the wait bounded by
accs_site.migrate_locks); the insert trigger of jobs.0038 gets a new body (CREATE OR REPLACE FUNCTION:
the same trigger, no lock on the table) that also fills it, whoever inserts. No index: the column is
read only with the rows the charts sample. Attempts written before are filled by
``manage.py accs_attempt_refs`` (jobs.attempt_refs).
"""

from django.db import migrations, models

COPY_TASK_REFS = """
CREATE OR REPLACE FUNCTION accs_attempt_copy_task_refs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- An attempt's service and tenant are its task's, whatever the writer said; the time it became
    -- claimable is the task's next_attempt_at (which the claim leaves as it was).
    SELECT t.service_id, t.tenant_id, t.next_attempt_at INTO NEW.service_id, NEW.tenant_id, NEW.claimable_at
      FROM accs_task t WHERE t.id = NEW.task_id;
    RETURN NEW;
END
$$;
"""

# jobs.0038's body, for a migration back.
COPY_TASK_REFS_0038 = """
CREATE OR REPLACE FUNCTION accs_attempt_copy_task_refs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- An attempt's service and tenant are its task's, whatever the writer said.
    SELECT t.service_id, t.tenant_id INTO NEW.service_id, NEW.tenant_id FROM accs_task t WHERE t.id = NEW.task_id;
    RETURN NEW;
END
$$;
"""


class Migration(migrations.Migration):
    atomic = False  # the column, then the function, each in its own short transaction

    dependencies = [
        ("jobs", "0039_limit_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="claimable_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        # Back: the old body first (it no longer names the column), then the column goes.
        migrations.RunSQL(COPY_TASK_REFS, COPY_TASK_REFS_0038),
    ]
