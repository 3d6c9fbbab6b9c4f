"""Indexes that no query reads are dropped, and finished work leaves the ones the hot path reads.

* ``job_order_seq_idx`` (every job, by order): the capped due-job scan reads ``job_due_idx`` (queued
  jobs only) and sorts the due rows; nothing else orders jobs by ``order_seq``.
* The foreign-key indexes on ``accs_job.workflow_id`` and ``service_id`` held every job twice (the
  unset column as a NULL entry); ``job_workflow_idx`` / ``job_service_idx`` hold only the set one.
* ``task_job_status_idx`` (every task, by job and status) becomes ``task_job_open_idx``: the tasks
  not final yet. A job's tasks of any status are read through ``task_job_key_unique``.

The new indexes are built first and concurrently, so each reader always has one.
"""

import django.db.models.deletion
from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE / DROP INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("jobs", "0021_step_counts_linear"),
        ("workflows", "0004_service_lease_seconds"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(condition=models.Q(("workflow__isnull", False)), fields=["workflow"],
                               name="job_workflow_idx"),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(condition=models.Q(("service__isnull", False)), fields=["service"],
                               name="job_service_idx"),
        ),
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(condition=models.Q(("status__in", ("waiting", "queued", "scheduled", "starting",
                                                                  "running"))),
                               fields=["job", "status"], name="task_job_open_idx"),
        ),
        RemoveIndexConcurrently(model_name="job", name="job_order_seq_idx"),
        RemoveIndexConcurrently(model_name="task", name="task_job_status_idx"),
        migrations.AlterField(
            model_name="job",
            name="service",
            field=models.ForeignKey(blank=True, db_index=False,
                                    help_text="Set for a one-task job that targets a service directly.", null=True,
                                    on_delete=django.db.models.deletion.PROTECT, related_name="jobs",
                                    to="workflows.service"),
        ),
        migrations.AlterField(
            model_name="job",
            name="workflow",
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT,
                                    related_name="jobs", to="workflows.workflow"),
        ),
    ]
