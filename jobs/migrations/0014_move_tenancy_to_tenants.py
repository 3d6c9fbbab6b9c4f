"""Tenants, memberships, API tokens and their throttle rows now belong to the ``tenants`` app.

State only: ``tenants`` 0001 took the models into its picture; this drops them from ``jobs``'s
and points the foreign keys of jobs, tasks, triggers and event receipts at ``tenants.Tenant``.
The tables, their rows and the foreign-key constraints in PostgreSQL do not change.

The models' content types are renamed to the new app, so the permissions granted on them (and
the admin's history of them) stay with them instead of being left behind on stale rows.
"""

import django.db.models.deletion
from django.db import migrations, models

MOVED = ("tenant", "tenantmembership", "apitoken", "apithrottle")


def _relabel(apps, *, old: str, new: str) -> None:
    content_type = apps.get_model("contenttypes", "ContentType")
    taken = set(content_type.objects.filter(app_label=new, model__in=MOVED).values_list("model", flat=True))
    # A content type already made for the new app (by a migrate that stopped between the two
    # apps' migrations) is left as it is; the old one then stays with its permissions.
    content_type.objects.filter(app_label=old, model__in=[m for m in MOVED if m not in taken]).update(app_label=new)


def forwards(apps, schema_editor) -> None:
    _relabel(apps, old="jobs", new="tenants")


def backwards(apps, schema_editor) -> None:
    _relabel(apps, old="tenants", new="jobs")


class Migration(migrations.Migration):

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("jobs", "0013_tenant_fairness"),
        ("tenants", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="tenant",
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT,
                                            related_name="jobs", to="tenants.tenant"),
                ),
                migrations.AlterField(
                    model_name="task",
                    name="tenant",
                    field=models.ForeignKey(db_index=False, help_text="Copied from the job.",
                                            on_delete=django.db.models.deletion.PROTECT, related_name="+",
                                            to="tenants.tenant"),
                ),
                migrations.AlterField(
                    model_name="trigger",
                    name="tenant",
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="triggers",
                                            to="tenants.tenant"),
                ),
                migrations.AlterField(
                    model_name="eventreceipt",
                    name="tenant",
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="+",
                                            to="tenants.tenant"),
                ),
                migrations.DeleteModel(name="TenantMembership"),
                migrations.DeleteModel(name="ApiToken"),
                migrations.DeleteModel(name="ApiThrottle"),
                migrations.DeleteModel(name="Tenant"),
            ],
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
