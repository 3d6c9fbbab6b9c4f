"""The builder leader's lease and its terms (jobs/leader.py), replacing the session advisory lock."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0011_token_scopes'),
    ]

    operations = [
        migrations.CreateModel(
            name='LeaderLease',
            fields=[
                ('name', models.TextField(help_text="What is led (one row: 'builder').", primary_key=True, serialize=False)),
                ('holder', models.TextField(help_text='The holding builder: host, process id and a random suffix.')),
                ('fence', models.BigIntegerField(help_text='The fencing number of the current term (strictly increasing).')),
                ('acquired_at', models.DateTimeField(help_text="When this term began (PostgreSQL's clock).")),
                ('expires_at', models.DateTimeField(help_text="When the lease ends unless renewed (PostgreSQL's clock).")),
            ],
            options={
                'db_table': 'accs_leader',
            },
        ),
        migrations.CreateModel(
            name='LeaderTerm',
            fields=[
                ('fence', models.BigIntegerField(primary_key=True, serialize=False)),
                ('holder', models.TextField()),
                ('acquired_at', models.DateTimeField(help_text="When the term began (PostgreSQL's clock, after the takeover).")),
                ('expires_at', models.DateTimeField(help_text="The lease's end as last renewed.")),
                ('first_write_at', models.DateTimeField(blank=True, help_text='First duty transaction that wrote.', null=True)),
                ('last_write_at', models.DateTimeField(blank=True, help_text='Last duty transaction that wrote.', null=True)),
                ('writes', models.BigIntegerField(default=0, help_text='Units of work the duties of this term did.')),
            ],
            options={
                'db_table': 'accs_leader_term',
            },
        ),
        # Fencing numbers come from a sequence, not from the row: they keep increasing even if the
        # lease row is deleted (a test database's flush, an operator's mistake).
        migrations.RunSQL("CREATE SEQUENCE accs_leader_fence_seq", reverse_sql="DROP SEQUENCE accs_leader_fence_seq"),
    ]
