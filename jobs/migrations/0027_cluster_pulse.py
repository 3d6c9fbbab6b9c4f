"""The cluster's pulse and its outages: the engine's own record of when PostgreSQL was out of reach.

Two new tables, read and written only by the new release's builders, rescue and reports: the
previous release's daemons never see them, so the migration is safe while they run. (Numbered
0027: 0026 is another change of the same release.)
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0026_approval_principals'),
    ]

    operations = [
        migrations.CreateModel(
            name='ClusterPulse',
            fields=[
                ('name', models.TextField(primary_key=True, serialize=False)),
                ('seen_at', models.DateTimeField(help_text="The last stamp (PostgreSQL's clock).")),
            ],
            options={
                'db_table': 'accs_cluster_pulse',
            },
        ),
        migrations.CreateModel(
            name='Outage',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('began_at', models.DateTimeField(help_text='The last stamp before the outage.')),
                ('ended_at', models.DateTimeField(help_text='The first stamp after it.')),
                ('cause', models.CharField(choices=[('gap', "No builder reached PostgreSQL for longer than the pulse's gap"), ('restart', 'PostgreSQL restarted (a stop and start, or a crash restart) since the last stamp')], max_length=16)),
            ],
            options={
                'db_table': 'accs_outage',
                'indexes': [models.Index(fields=['ended_at'], name='outage_ended_idx')],
                'constraints': [models.CheckConstraint(condition=models.Q(('cause__in', ['gap', 'restart'])), name='outage_cause_valid'), models.CheckConstraint(condition=models.Q(('ended_at__gte', models.F('began_at'))), name='outage_ends_after_it_began')],
            },
        ),
    ]
