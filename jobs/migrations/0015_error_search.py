"""Indexes for the admin's job search: the error text of jobs and tasks (pg_trgm) and the references
searched exactly (external id, dedupe key, correlation id), so no search term reads every job.

pg_trgm ships with PostgreSQL (the contrib package) and is a trusted extension, so the database's
owner may create it. The indexes are built concurrently: jobs and tasks keep being written meanwhile.
"""

import django.contrib.postgres.indexes
import django.db.models.functions.text
from django.contrib.postgres.operations import AddIndexConcurrently, TrigramExtension
from django.db import migrations, models


def error_index(model_name: str) -> AddIndexConcurrently:
    return AddIndexConcurrently(
        model_name=model_name,
        index=django.contrib.postgres.indexes.GinIndex(
            django.contrib.postgres.indexes.OpClass(django.db.models.functions.text.Upper("error_message"),
                                                    name="gin_trgm_ops"),
            condition=models.Q(("error_message", ""), _negated=True), name=f"{model_name}_error_trgm_idx"),
    )


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("jobs", "0014_move_tenancy_to_tenants"),
    ]

    operations = [
        TrigramExtension(),  # CREATE EXTENSION IF NOT EXISTS pg_trgm
        error_index("job"),
        error_index("task"),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(condition=models.Q(("external_id__isnull", False)), fields=["external_id"],
                               name="job_external_id_idx"),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(condition=models.Q(("dedupe_key__isnull", False)), fields=["dedupe_key"],
                               name="job_dedupe_key_idx"),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(condition=models.Q(("correlation_id", ""), _negated=True), fields=["correlation_id"],
                               name="job_correlation_id_idx"),
        ),
    ]
