"""Jobs and tasks by their short id: the admin's search for the short form shown (an id's last 10 hex
digits) read every id from the recent day, then from the whole table (half a second at a million jobs).

Expression indexes on the ids' last five bytes (``substring(uuid_send(id) FROM 12)``, jobs.models.IdEnd)
make it one index probe. Built concurrently: no lock held against the running daemons' inserts, and the
previous release's code never reads them (its search still works, at its old speed).
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

import jobs.models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("jobs", "0036_claim_plan_without_stale_statistics")]

    operations = [
        AddIndexConcurrently(model_name="job",
                             index=models.Index(jobs.models.IdEnd("id"), name="job_short_id_idx")),
        AddIndexConcurrently(model_name="task",
                             index=models.Index(jobs.models.IdEnd("id"), name="task_short_id_idx")),
    ]
