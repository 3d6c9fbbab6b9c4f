"""Attempts are read by time window and by node: the operators' success and failure rates over a chosen
range (ops.rates), the attempts list filtered by node or by time range.

Both indexes hold columns an attempt is inserted with and never changes (``started_at``, ``node``), so a
report that finishes an attempt stays a HOT update. Built concurrently: no lock held against the running
daemons' inserts.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("jobs", "0028_finalize_conditions")]

    operations = [
        AddIndexConcurrently(model_name="attempt",
                             index=models.Index(fields=["started_at"], name="attempt_started_idx")),
        AddIndexConcurrently(model_name="attempt",
                             index=models.Index(fields=["node", "id"], name="attempt_node_idx")),
    ]
