"""A database default for API token scopes, so the previous release's code can create tokens again.

jobs 0011 added ``scopes`` NOT NULL and dropped its default, so an INSERT that leaves it out (the
previous release's ``accs_token create``) failed. ``SET DEFAULT`` only changes the catalog: it holds
ACCESS EXCLUSIVE on ``accs_api_token`` (not a hot table) for milliseconds and rewrites nothing, so it
is safe while the previous release's daemons run.
"""

import django.contrib.postgres.fields
import tenants.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0001_initial'),
    ]

    operations = [
        migrations.AlterField(
            model_name='apitoken',
            name='scopes',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.CharField(choices=[('read', 'Read jobs, tasks, triggers and (superusers) definitions'), ('run', 'Start, cancel, retry and redrive jobs; manage triggers; emit events'), ('approve', 'Approve or reject jobs waiting for approval'), ('definitions', 'Create and change services and workflows (superusers only)')], max_length=20), db_default=('read', 'run', 'approve'), default=tenants.models.default_token_scopes, help_text='What the token may do: read, run, approve, definitions.', size=None),
        ),
    ]
