"""The leadership terms by when they began: the system timeline lists the terms of a window (leader
changes, and a new release when a term's holder names another one). Built concurrently.

The attempt status "interrupted" is labelled for both its causes (a choices label: no SQL)."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("jobs", "0030_fan_out_over_items")]

    operations = [
        AddIndexConcurrently(
            model_name="leaderterm",
            index=models.Index(fields=["acquired_at"], name="leader_term_acquired_idx"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="status",
            field=models.CharField(choices=[("running", "Running"), ("succeeded", "Succeeded"), ("failed", "Failed"),
                                            ("timeout", "Timed out"), ("canceled", "Canceled"), ("blocked", "Blocked"),
                                            ("interrupted", "Interrupted (agent shutdown or database outage; retried)")],
                                   default="running", max_length=16),
        ),
    ]
