from django.conf import settings
from django.db import migrations, models

# Bloat control for the tables every task churns through: each task is inserted, updated a few
# times and, with retention, deleted. The default autovacuum triggers (20 % of the table dead)
# let a table of millions of rows carry hundreds of thousands of dead versions before a vacuum,
# and the claim's index scans walk past them; a lower scale factor with a fixed floor vacuums
# in small, frequent rounds instead, and analyze keeps the planner's counts of the status
# values (which the partial indexes depend on) current. The insert-driven trigger lets vacuum
# set the visibility map on freshly inserted pages of append-heavy tables (attempts, steps).
#
# fillfactor leaves room on each page for the row's next version:
# * accs_job_step: the trigger's count updates change no indexed column (its one index is
#   (job_id, step_key)), so with free room on the page every one is a HOT update: no index
#   entry, no new page.
# * accs_attempt: finishing an attempt changes status, times and tails, none indexed (the only
#   index is (task_id, attempt_no)): HOT with room on the page.
# * accs_task: most updates change status, which the partial claim/lease/held indexes name in
#   their predicates, so they cannot be HOT; progress reports (progress, updated_at) can. The
#   room still keeps a claim's or report's new version on the same page, so it dirties one heap
#   page instead of two and the table does not spread while old versions wait for vacuum.
# * accs_job: status is indexed (tenant/status/created), progress and current_task_key are not.
# fillfactor applies to pages written from now on; existing pages fill up as before.
# table: (fillfactor, autovacuum_analyze_scale_factor); the claim reads task and job statistics.
TUNING = {"accs_task": (85, 0.02), "accs_job": (90, 0.02), "accs_job_step": (70, 0.05), "accs_attempt": (90, 0.05)}
VACUUM = ("autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, "
          "autovacuum_vacuum_insert_scale_factor = 0.05")
OPTIONS = ("fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
           "autovacuum_vacuum_insert_scale_factor, autovacuum_analyze_scale_factor")
TUNE_SQL = "".join(f"ALTER TABLE {table} SET (fillfactor = {fill}, {VACUUM}, autovacuum_analyze_scale_factor = {analyze});\n"
                   for table, (fill, analyze) in TUNING.items())
UNTUNE_SQL = "".join(f"ALTER TABLE {table} RESET ({OPTIONS});\n" for table in TUNING)


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0007_step_failure_policy'),
        ('workflows', '0001_initial'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='retention_days',
            field=models.PositiveIntegerField(blank=True, help_text='Days finished jobs are kept before they are pruned; 0 = for ever, empty = ACC_RETENTION_DAYS.', null=True),
        ),
        migrations.AddField(
            model_name='tenant',
            name='retention_dead_days',
            field=models.PositiveIntegerField(blank=True, help_text='Days jobs that ended in error (dead letters) are kept; 0 = for ever, empty = ACC_RETENTION_DEAD_DAYS.', null=True),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('status__in', ('done', 'partial', 'canceled'))), fields=['tenant', 'finished_at'], name='job_prune_idx'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('status', 'error')), fields=['tenant', 'finished_at'], name='job_prune_dead_idx'),
        ),
        migrations.RunSQL(TUNE_SQL, UNTUNE_SQL),
    ]
