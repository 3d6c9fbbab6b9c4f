"""The to-do of object deletions: retention deletes artifact objects only after its transaction committed.

A new table, read and written only by the new release: the previous release's daemons never see
it, so the migration is safe while they run.
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('events', '0002_metric_totals'),
    ]

    operations = [
        migrations.CreateModel(
            name='ObjectDeletion',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('bucket', models.CharField(max_length=200)),
                ('key', models.CharField(max_length=1000)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'db_table': 'accs_object_deletion',
                'constraints': [models.UniqueConstraint(fields=('bucket', 'key'), name='object_deletion_bucket_key_unique')],
            },
        ),
    ]
