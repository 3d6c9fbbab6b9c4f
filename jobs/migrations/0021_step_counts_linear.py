"""The step counts' trigger reads each transition table once instead of joining them.

The join of the old and new rows of an UPDATE had no statistics to plan with (a transition table
is estimated at one row), so it ran as a nested loop: n² comparisons for an UPDATE of n tasks
(4,096 for a report of 64, a million for a fan-out of 1,000). A task's job and step never change,
so each (job, step)'s delta is the count of final states among the new rows minus that among the
old rows: two scans, no join. A statement that changes no final state still touches no step row.
"""

from django.db import migrations

LINEAR = """
CREATE OR REPLACE FUNCTION accs_task_step_counts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accs_job_step s
       SET done = s.done + d.done, error = s.error + d.error, skipped = s.skipped + d.skipped,
           canceled = s.canceled + d.canceled, blocked = s.blocked + d.blocked
      FROM (SELECT x.job_id, x.step_key, sum(x.done) AS done, sum(x.error) AS error, sum(x.skipped) AS skipped,
                   sum(x.canceled) AS canceled, sum(x.blocked) AS blocked
              FROM (SELECT n.job_id, n.step_key, (n.status = 'done')::int AS done, (n.status = 'error')::int AS error,
                           (n.status = 'skipped')::int AS skipped, (n.status = 'canceled')::int AS canceled,
                           (n.status = 'blocked')::int AS blocked
                      FROM accs_task_new n WHERE n.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')
                    UNION ALL
                    SELECT o.job_id, o.step_key, -(o.status = 'done')::int, -(o.status = 'error')::int,
                           -(o.status = 'skipped')::int, -(o.status = 'canceled')::int, -(o.status = 'blocked')::int
                      FROM accs_task_old o WHERE o.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')) x
             GROUP BY x.job_id, x.step_key
            HAVING sum(x.done) <> 0 OR sum(x.error) <> 0 OR sum(x.skipped) <> 0 OR sum(x.canceled) <> 0
                OR sum(x.blocked) <> 0) d
     WHERE s.job_id = d.job_id AND s.step_key = d.step_key;
    RETURN NULL;
END
$$;
"""

JOINED = """
CREATE OR REPLACE FUNCTION accs_task_step_counts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE accs_job_step s
       SET done = s.done + d.done, error = s.error + d.error, skipped = s.skipped + d.skipped,
           canceled = s.canceled + d.canceled, blocked = s.blocked + d.blocked
      FROM (SELECT n.job_id, n.step_key,
                   sum((n.status = 'done')::int - (o.status = 'done')::int) AS done,
                   sum((n.status = 'error')::int - (o.status = 'error')::int) AS error,
                   sum((n.status = 'skipped')::int - (o.status = 'skipped')::int) AS skipped,
                   sum((n.status = 'canceled')::int - (o.status = 'canceled')::int) AS canceled,
                   sum((n.status = 'blocked')::int - (o.status = 'blocked')::int) AS blocked
              FROM accs_task_new n JOIN accs_task_old o ON o.id = n.id
             WHERE n.status IS DISTINCT FROM o.status
               AND (n.status IN ('done', 'error', 'skipped', 'canceled', 'blocked')
                    OR o.status IN ('done', 'error', 'skipped', 'canceled', 'blocked'))
             GROUP BY n.job_id, n.step_key) d
     WHERE s.job_id = d.job_id AND s.step_key = d.step_key;
    RETURN NULL;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("jobs", "0020_report_functions")]

    operations = [migrations.RunSQL(LINEAR, JOINED)]
