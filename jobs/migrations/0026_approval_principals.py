"""Four eyes for triggers' jobs: a job records who else may not approve it, a trigger its last editor.

Both columns are nullable with no default, so adding them is a catalogue change (no rewrite, a
moment's lock); daemons of the previous release neither read nor write them (their jobs have
``approval_barred`` NULL: only ``created_by`` is checked for those).
"""

import django.contrib.postgres.fields
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    # One transaction per statement: in one transaction, the lock on the first table (accs_job) would
    # be held while waiting for the second (accs_trigger), and a daemon reading the two in the
    # other order deadlocks with it (the upgrade drill met it). Each ALTER is catalogue-only and brief.
    atomic = False

    dependencies = [
        ('jobs', '0025_claim_tries_capped_locks'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='approval_barred',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField(), blank=True, editable=False, null=True, size=None),
        ),
        migrations.AddField(
            model_name='trigger',
            name='updated_by',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
    ]
