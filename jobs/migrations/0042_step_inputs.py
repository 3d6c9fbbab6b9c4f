"""Each task's read of its parents' outputs stops building them into a new JSON value in the database.

After a wide fan-out, each task of the next step read its parent's gathered output (a list of 1,000
outputs) re-built into ``{step key: output}`` by jsonb_object_agg, which copies every node of it: about
a millisecond per task, the 1,000 tasks after a 1,000-host fan-out a million nodes copied, and the whole
fan-out's run took seconds longer. The new read (``accs_step_inputs``, jobs.inputs.STEP_INPUTS_SQL)
returns the parents' step keys and outputs as two arrays, which the agent makes into the object.

Safe under the previous release's daemons: a new function, which they never call; their agents keep
calling ``accs_step_context`` (jobs.0034), which this leaves in place, to be dropped a release later.
The body is a copy of jobs.inputs.step_inputs_function_sql() (a test compares the database's function
with the code).
"""

from django.db import migrations

STEP_INPUTS = r"""CREATE OR REPLACE FUNCTION accs_step_inputs(p_task uuid)
RETURNS TABLE (parent_keys text[], parent_outputs jsonb[], item jsonb, item_index int, output_schema jsonb)
LANGUAGE plpgsql STABLE
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $inputs$
#variable_conflict use_column
BEGIN
    RETURN QUERY
SELECT coalesce(ps.keys, pt.keys, '{}') AS parent_keys, coalesce(ps.outputs, pt.outputs, '{}') AS parent_outputs,
       CASE WHEN fo.over IS NOT NULL AND ix.i IS NOT NULL
            THEN jsonb_path_query_first((SELECT jsonb_object_agg(x.k, x.v)
                                           FROM unnest(coalesce(ps.keys, pt.keys), coalesce(ps.outputs, pt.outputs))
                                                AS x(k, v)),
                                        accs_jsonpath(fo.over), '{}', true) -> ix.i END AS item,
       CASE WHEN fo.over IS NOT NULL THEN ix.i END AS item_index,
       (SELECT s.value -> 'output_schema'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = t.step_key
         LIMIT 1) AS output_schema
  FROM accs_task t JOIN accs_job j ON j.id = t.job_id
 -- The parents' gathered outputs, one step row each (job_step_unique), when every parent has one.
 CROSS JOIN LATERAL (SELECT CASE WHEN bool_and(s.output IS NOT NULL) THEN array_agg(s.step_key::text) END AS keys,
                            CASE WHEN bool_and(s.output IS NOT NULL) THEN array_agg(s.output) END AS outputs
                       FROM accs_job_step s
                      WHERE s.job_id = t.job_id AND s.step_key = ANY (t.depends_on) AND s.total > 0) ps
 -- Else from their tasks (a parent released by the previous release's code, or changed since); a task
 -- without parents reads none (a filter on the task alone, decided before any row is read).
 CROSS JOIN LATERAL (SELECT array_agg(g.step_key::text) AS keys, array_agg(g.output) AS outputs
                       FROM (SELECT p.step_key, CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)
                            ELSE (array_agg(p.results))[1] END AS output
                               FROM accs_task p
                              WHERE ps.keys IS NULL AND cardinality(t.depends_on) > 0
                                AND p.job_id = t.job_id AND p.step_key = ANY (t.depends_on)
                              GROUP BY p.step_key) g) pt
 CROSS JOIN LATERAL (SELECT (SELECT s.value -> 'fan_out'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = j.workflow_id AND s.value ->> 'key' = t.step_key
         LIMIT 1) ->> 'over' AS over) fo
 CROSS JOIN LATERAL (SELECT substring(t.task_key FROM '\[([0-9]+)\]$')::int AS i) ix
 WHERE t.id = p_task;
END
$inputs$"""


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0041_rate_start_block_per_statement"),
    ]

    operations = [
        migrations.RunSQL(STEP_INPUTS, "DROP FUNCTION IF EXISTS accs_step_inputs(uuid)"),
    ]
