"""Tenants, memberships, API tokens and their throttle rows, moved here from ``jobs``.

Only Django's picture of the models moves: the tables (accs_tenant, accs_tenant_membership,
accs_api_token, accs_api_throttle) and their rows stay as they are, so nothing is copied or
locked. ``jobs`` 0014 then drops the models from its own picture and points its foreign keys here.
"""

import uuid

import django.contrib.postgres.fields
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

import tenants.models


class Migration(migrations.Migration):

    initial = True

    # The tables were created by jobs' migrations when these models lived there; every later
    # migration of this app must find them, so this one comes after the last that changed them.
    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("jobs", "0013_tenant_fairness"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name='ApiThrottle',
                    fields=[
                        ('digest', models.CharField(help_text='SHA-256 of the token, as ApiToken.digest.', max_length=64, primary_key=True, serialize=False)),
                        ('window_start', models.DateTimeField()),
                        ('hits', models.PositiveIntegerField(default=0)),
                    ],
                    options={
                        'db_table': 'accs_api_throttle',
                    },
                ),
                migrations.CreateModel(
                    name='ApiToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100)),
                        ('prefix', models.CharField(help_text='First characters of the token, to recognise it.', max_length=12)),
                        ('digest', models.CharField(max_length=64, unique=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('expires_at', models.DateTimeField(blank=True, help_text='The API refuses the token from then on.', null=True)),
                        ('scopes', django.contrib.postgres.fields.ArrayField(base_field=models.CharField(choices=[('read', 'Read jobs, tasks, triggers and (superusers) definitions'), ('run', 'Start, cancel, retry and redrive jobs; manage triggers; emit events'), ('approve', 'Approve or reject jobs waiting for approval'), ('definitions', 'Create and change services and workflows (superusers only)')], max_length=20), default=tenants.models.default_token_scopes, help_text='What the token may do: read, run, approve, definitions.', size=None)),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'accs_api_token',
                    },
                ),
                migrations.CreateModel(
                    name='Tenant',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('slug', models.SlugField(max_length=100, unique=True)),
                        ('name', models.CharField(max_length=200)),
                        ('timezone', models.CharField(default='UTC', help_text='IANA name, default for schedules.', max_length=64)),
                        ('max_in_flight', models.PositiveIntegerField(default=tenants.models.default_max_in_flight, help_text='Running jobs at once; 0 = unlimited (new tenants: ACC_TENANT_MAX_IN_FLIGHT).')),
                        ('min_priority', models.IntegerField(db_default=-1000, default=-1000, help_text='Lowest priority a job of this tenant gets.')),
                        ('max_priority', models.IntegerField(db_default=1000, default=1000, help_text='Highest priority a job of this tenant gets.')),
                        ('served_at', models.DateTimeField(blank=True, editable=False, help_text='When an agent last claimed a task of this tenant among others.', null=True)),
                        ('retention_days', models.PositiveIntegerField(blank=True, help_text='Days finished jobs are kept before they are pruned; 0 = for ever, empty = ACC_RETENTION_DAYS.', null=True)),
                        ('retention_dead_days', models.PositiveIntegerField(blank=True, help_text='Days jobs that ended in error (dead letters) are kept; 0 = for ever, empty = ACC_RETENTION_DEAD_DAYS.', null=True)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                    ],
                    options={
                        'db_table': 'accs_tenant',
                        'ordering': ['slug'],
                        'constraints': [models.CheckConstraint(condition=models.Q(('min_priority__lte', models.F('max_priority'))), name='tenant_priority_band_valid')],
                    },
                ),
                migrations.CreateModel(
                    name='TenantMembership',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('role', models.CharField(choices=[('admin', 'Tenant admin (read and act)'), ('viewer', 'Viewer (read only)')], default='admin', max_length=16)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='memberships', to='tenants.tenant')),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='tenant_memberships', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'accs_tenant_membership',
                        'constraints': [models.UniqueConstraint(fields=('user', 'tenant'), name='membership_user_tenant_unique'), models.CheckConstraint(condition=models.Q(('role__in', ['admin', 'viewer'])), name='membership_role_valid')],
                    },
                ),
            ],
        ),
    ]
