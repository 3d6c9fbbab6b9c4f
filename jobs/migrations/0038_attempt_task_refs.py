"""Attempts carry their task's service and tenant: the dashboard's rates and charts and the attempts
list by service read attempts alone, not one task lookup per attempt (at ten million events the
dashboard took over 300 ms, its seven-day range 1.4 s).

Safe under the previous release's daemons: the columns are nullable without a default (a catalog
change; ACCESS EXCLUSIVE held for milliseconds once granted, each in its own transaction, the wait
bounded by accs_site.migrate_locks); the trigger fills them on every insert, whoever inserts (the
previous release's claim function too); the indexes are built concurrently. The attempts written
before are filled afterwards, online in small batches, by ``manage.py accs_attempt_refs`` (until then
the readers count through the task, as before: jobs.attempt_refs.refs_complete).
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
import django.db.models.deletion

COPY_TASK_REFS = """
CREATE OR REPLACE FUNCTION accs_attempt_copy_task_refs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- An attempt's service and tenant are its task's, whatever the writer said.
    SELECT t.service_id, t.tenant_id INTO NEW.service_id, NEW.tenant_id FROM accs_task t WHERE t.id = NEW.task_id;
    RETURN NEW;
END
$$;
CREATE TRIGGER accs_attempt_copy_task_refs BEFORE INSERT ON accs_attempt
    FOR EACH ROW EXECUTE FUNCTION accs_attempt_copy_task_refs();
"""

DROP_COPY_TASK_REFS = """
DROP TRIGGER accs_attempt_copy_task_refs ON accs_attempt;
DROP FUNCTION accs_attempt_copy_task_refs();
"""


class Migration(migrations.Migration):
    atomic = False  # one statement per transaction; CREATE INDEX CONCURRENTLY cannot run inside one

    dependencies = [
        ("jobs", "0037_short_id_indexes"),
        ("tenants", "0001_initial"),
        ("workflows", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="service",
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, editable=False, null=True,
                                    on_delete=django.db.models.deletion.DO_NOTHING, related_name="+",
                                    to="workflows.service"),
        ),
        migrations.AddField(
            model_name="attempt",
            name="tenant",
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, editable=False, null=True,
                                    on_delete=django.db.models.deletion.DO_NOTHING, related_name="+",
                                    to="tenants.tenant"),
        ),
        migrations.RunSQL(COPY_TASK_REFS, DROP_COPY_TASK_REFS),
        AddIndexConcurrently(
            model_name="attempt",
            index=models.Index(fields=["id"], condition=models.Q(service__isnull=True),
                               name="attempt_refs_missing_idx"),
        ),
        AddIndexConcurrently(
            model_name="attempt",
            index=models.Index(fields=["service", "id"], name="attempt_service_idx"),
        ),
    ]
