"""The attempts rolled up per time bucket (jobs.attempt_rollup): the dashboard's charts and rates read
closed buckets from here and the attempts themselves only for the tail the builder has not folded yet (at
ten million events the seven-day dashboard sampled 2 x 50,000 attempts and took about 300 ms p95).

Safe under the previous release's daemons: three new tables, nothing else; the previous release neither
reads nor writes them, and nothing is added to the claim or the report (the builder's leader of this
release folds finished attempts in, off their path). Until the first folds catch up (``manage.py
accs_attempt_rollup``, or the builder's duty in bounded batches) the readers count the attempts as before.
"""

import django.contrib.postgres.fields
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0042_step_inputs'),
    ]

    operations = [
        migrations.CreateModel(
            name='AttemptRollupMark',
            fields=[
                ('name', models.TextField(primary_key=True, serialize=False)),
                ('folded_until', models.DateTimeField(null=True)),
                ('folded_at', models.DateTimeField(help_text="When the last fold committed (PostgreSQL's clock).", null=True)),
                ('pending', django.contrib.postgres.fields.ArrayField(base_field=models.BigIntegerField(), default=list, size=None)),
            ],
            options={
                'db_table': 'accs_attempt_rollup_mark',
            },
        ),
        migrations.CreateModel(
            name='AttemptNodeRollup',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('bucket', models.DateTimeField(help_text='The start of the hour (UTC).')),
                ('node', models.CharField(max_length=200)),
                ('service_id', models.BigIntegerField(null=True)),
                ('tenant_id', models.UUIDField(null=True)),
                ('attempts', models.IntegerField()),
                ('succeeded', models.IntegerField()),
                ('failed', models.IntegerField(help_text='Failed or timed out.')),
            ],
            options={
                'db_table': 'accs_attempt_node_rollup',
                'constraints': [models.UniqueConstraint(fields=('bucket', 'node', 'service_id', 'tenant_id'), name='attempt_node_rollup_key', nulls_distinct=False)],
            },
        ),
        migrations.CreateModel(
            name='AttemptRollup',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('bucket', models.DateTimeField(help_text='The start of the 20 minutes (from the Unix epoch, UTC).')),
                ('service_id', models.BigIntegerField(null=True)),
                ('tenant_id', models.UUIDField(null=True)),
                ('attempts', models.IntegerField(help_text='Attempts started in the bucket, finished when folded.')),
                ('succeeded', models.IntegerField()),
                ('failed', models.IntegerField(help_text='Failed or timed out.')),
                ('wait_0', models.IntegerField(default=0)),
                ('wait_1', models.IntegerField(default=0)),
                ('wait_2', models.IntegerField(default=0)),
                ('wait_3', models.IntegerField(default=0)),
                ('wait_4', models.IntegerField(default=0)),
                ('wait_5', models.IntegerField(default=0)),
                ('wait_6', models.IntegerField(default=0)),
                ('wait_7', models.IntegerField(default=0)),
                ('wait_8', models.IntegerField(default=0)),
                ('wait_9', models.IntegerField(default=0)),
                ('wait_10', models.IntegerField(default=0)),
                ('wait_11', models.IntegerField(default=0)),
                ('wait_12', models.IntegerField(default=0)),
                ('wait_13', models.IntegerField(default=0)),
                ('wait_14', models.IntegerField(default=0)),
                ('wait_15', models.IntegerField(default=0)),
                ('wait_16', models.IntegerField(default=0)),
                ('wait_17', models.IntegerField(default=0)),
                ('wait_18', models.IntegerField(default=0)),
                ('wait_19', models.IntegerField(default=0)),
            ],
            options={
                'db_table': 'accs_attempt_rollup',
                'constraints': [models.UniqueConstraint(fields=('bucket', 'service_id', 'tenant_id'), name='attempt_rollup_key', nulls_distinct=False)],
            },
        ),
    ]
