"""The metrics' counters kept in the database (ops.metrics), so a scrape never recounts the timeline.

The row starts at the newest event: on an existing site the counters count from the upgrade on
(Prometheus takes the drop to zero as a counter reset), instead of a new web process reading
the whole history.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("events", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="MetricTotals",
            fields=[
                ("id", models.SmallIntegerField(default=1, primary_key=True, serialize=False)),
                ("watermark", models.BigIntegerField(default=0)),
                ("totals", models.JSONField(default=dict)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={
                "db_table": "accs_metric_totals",
                "constraints": [models.CheckConstraint(condition=models.Q(id=1), name="metric_totals_one_row")],
            },
        ),
        migrations.RunSQL(
            "INSERT INTO accs_metric_totals (id, watermark, totals, updated_at)"
            " SELECT 1, coalesce(max(id), 0), '{}', now() FROM accs_event",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]
