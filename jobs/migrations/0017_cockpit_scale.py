"""The cockpit at scale: an index for the dashboard's dead-letter count (see Task.Meta)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0016_retention_mark")]

    operations = [
        # ops.overview.DEAD_LETTER_SQL: dead letters counted per tenant and service, index-only.
        migrations.AddIndex(
            model_name="task",
            index=models.Index(condition=models.Q(("status", "error")), fields=["tenant", "service"],
                               name="task_dead_letter_count_idx"),
        ),
    ]
