"""Partial indexes for bulk redrive: dead-lettered tasks and failed jobs in id order."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0008_retention"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(condition=models.Q(("status__in", ("error", "partial", "canceled"))), fields=["id"],
                               name="job_failed_idx"),
        ),
        migrations.AddIndex(
            model_name="task",
            index=models.Index(condition=models.Q(("status", "error")), fields=["id"], name="task_dead_letter_idx"),
        ),
    ]
