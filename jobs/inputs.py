"""What a task receives from the steps it depends on: their outputs, and the schema its own output must meet.

A step's output is its task's ``results`` (what the attempt returned, already size-limited and cleaned
by the agent). A task of a workflow is given ``{parent step key: output}`` for each step in its
``depends_on``; a parent step that fanned out (several tasks) gives the list of its tasks' outputs in
task order (a gather). A parent that never ran (skipped, for a step that runs ``always``) gives null.
The same expression (:func:`parent_outputs`) is what a step's condition (``when``) is evaluated over
when its tasks are promoted (:mod:`jobs.finalize`).

A task of a step that fans out over a list a parent returned (``fan_out: {"over": path}``) also gets its
item of that list as ``item`` and the item's place in it (from 0) as ``index``.

The agent reads this once per attempt, in the attempt's worker thread, just before the executor runs
(:func:`step_context`), rather than when the task is promoted: promotion is set-based SQL in every
report's transaction, and copying each parent's output (up to a megabyte, times the fan-out) into each
dependent row there would make reports heavy and store every output twice. The read is one statement,
always within the task's own job, so no task can see another job's outputs:

* a task with no dependency reads no parent at all;
* a parent step's output is gathered once, when its tasks are all final (job finalisation's release,
  :data:`jobs.finalize.RELEASE_STEPS_SQL`), into its ``accs_job_step`` row, so each dependent task reads
  one row per parent step however wide the parent fanned out (the 1,000 tasks after a 1,000-host
  fan-out read 1,000 rows, not a million). Any later change of a parent task's final state (a retry, a
  redrive) clears that row's output (the step counts' trigger), and a parent without a gathered output
  (released by the previous release's code, or changed since) is read from its tasks as before, so the
  two reads give the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db import connection, transaction

from jobs.locks import bound_lock_waits
from jobs.sql import from_json

# One step's output from its tasks (aliased ``p``, grouped by step): a single task's results, or the list of
# a fanned-out step's results in task order.
GATHERED_OUTPUT = ("CASE WHEN bool_or(p.task_key <> p.step_key) THEN jsonb_agg(p.results ORDER BY p.id)\n"
                   "                            ELSE (array_agg(p.results))[1] END")


def parent_outputs(task: str) -> str:
    """Return SQL giving ``{parent step key: output}`` for the task aliased ``task``: one entry per step in
    its ``depends_on`` that has tasks, a fanned-out step's outputs as an array in task order (ids are
    time-ordered: the order the tasks were made in). The agent's read and the promotion's conditions
    both use it, so a step's condition sees exactly what its task would receive."""
    return f"""coalesce((SELECT jsonb_object_agg(g.step_key, g.output)
          FROM (SELECT p.step_key,
                       {GATHERED_OUTPUT} AS output
                  FROM accs_task p
                 WHERE p.job_id = {task}.job_id AND p.step_key = ANY ({task}.depends_on)
                 GROUP BY p.step_key) g), '{{}}'::jsonb)"""


def step_field(task: str, job: str, name: str) -> str:
    """Return SQL giving the field ``name`` (jsonb) of the workflow step of the task aliased ``task``, read
    from the workflow version its job (aliased ``job``) runs on; null for a service's job."""
    return f"""(SELECT s.value -> '{name}'
          FROM accs_workflow wf CROSS JOIN LATERAL jsonb_array_elements(wf.steps) AS s(value)
         WHERE wf.id = {job}.workflow_id AND s.value ->> 'key' = {task}.step_key
         LIMIT 1)"""


#: A jsonpath read from a stored workflow step (``when``, ``fan_out.over``) goes through this function: the
#: validator refuses an invalid one on every save path, but a row written by hand would otherwise make every
#: statement that reads it raise (a report settling its job, the agent's read), so an invalid one is NULL.
JSONPATH_FUNCTION = "accs_jsonpath"


def jsonpath_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`JSONPATH_FUNCTION` (a migration holds a copy)."""
    return f"""CREATE OR REPLACE FUNCTION {JSONPATH_FUNCTION}(p_text text)
RETURNS jsonpath
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $jsonpath$
BEGIN
    RETURN p_text::jsonpath;
EXCEPTION WHEN syntax_error OR invalid_parameter_value OR data_exception THEN
    RETURN NULL;  -- not a jsonpath
END
$jsonpath$"""


# A task of a step fanning out over a parent's list is "<step>[i]" (jobs.finalize): its item is element i of
# the list the step's path finds in the same parents' outputs, read again here rather than copied into it.
ITEM_INDEX = r"substring(t.task_key FROM '\[([0-9]+)\]$')::int"

STEP_CONTEXT_SQL = f"""
SELECT po.inputs || coalesce((SELECT jsonb_build_object(
                                  'item', jsonb_path_query_first(po.inputs, {JSONPATH_FUNCTION}(fo.over), '{{}}',
                                                                 true) -> ix.i,
                                  'index', ix.i)
                                FROM (SELECT {ITEM_INDEX} AS i) ix WHERE ix.i IS NOT NULL AND fo.over IS NOT NULL),
                              '{{}}'::jsonb) AS inputs,
       {step_field("t", "j", "output_schema")} AS output_schema
  FROM accs_task t JOIN accs_job j ON j.id = t.job_id
 CROSS JOIN LATERAL (SELECT CASE
            WHEN cardinality(t.depends_on) = 0 THEN '{{}}'::jsonb
            -- The parents' gathered outputs, one step row each (job_step_unique), when every parent has one.
            ELSE coalesce((SELECT CASE WHEN bool_and(s.output IS NOT NULL)
                                       THEN jsonb_object_agg(s.step_key, s.output) END
                             FROM accs_job_step s
                            WHERE s.job_id = t.job_id AND s.step_key = ANY (t.depends_on) AND s.total > 0),
                          {parent_outputs("t")})
            END AS inputs) po
 CROSS JOIN LATERAL (SELECT {step_field("t", "j", "fan_out")} ->> 'over' AS over) fo
 WHERE t.id = %(task)s
"""


#: The read as a server-side function (created by a migration, its text built by :func:`step_context_function_sql`):
#: its plan is made once per server connection instead of at every attempt, where planning this statement
#: cost more than running it (5 ms against under 1).
STEP_CONTEXT_FUNCTION = "accs_step_context"


def step_context_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`STEP_CONTEXT_FUNCTION`, built from STEP_CONTEXT_SQL.

    A migration holds a copy; a test compares the database's function with this text.
    """
    body = STEP_CONTEXT_SQL.replace("%(task)s", "p_task").strip()
    return f"""CREATE OR REPLACE FUNCTION {STEP_CONTEXT_FUNCTION}(p_task uuid)
RETURNS TABLE (inputs jsonb, output_schema jsonb)
LANGUAGE plpgsql STABLE
-- One plan per server connection (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $context$
#variable_conflict use_column
BEGIN
    RETURN QUERY
{body};
END
$context$"""


@dataclass(frozen=True)
class StepContext:
    """What one task gets from its workflow: its parents' outputs and its own output schema (or None)."""

    inputs: dict[str, Any]
    output_schema: dict[str, Any] | None


def step_context(task_id: UUID) -> StepContext:
    """Return the outputs of ``task_id``'s parents and its step's output schema (one statement)."""
    with connection.cursor() as cur:
        cur.execute(f"SELECT * FROM {STEP_CONTEXT_FUNCTION}(%s)", [task_id])
        row = cur.fetchone()
    if row is None:  # the task is gone (its job was deleted): nothing to give
        return StepContext(inputs={}, output_schema=None)
    return _as_context(row[0], row[1])


def step_contexts(task_ids: Sequence[UUID], *, lock_wait: float) -> dict[UUID, StepContext]:
    """Return the step contexts of ``task_ids`` (as :func:`step_context` gives each) in one statement.

    For an agent's batch of claimed tasks: one round trip instead of one per task, each in line for
    the agent's one pooled connection. No lock is waited for longer than ``lock_wait`` seconds (the
    lock timeout is the transaction's own): a lock wait that runs out raises, and the caller leaves
    each task to read its own. A task that is gone is left out.
    """
    if not task_ids:
        return {}
    with transaction.atomic(), connection.cursor() as cur:
        bound_lock_waits(cur, seconds=lock_wait)
        cur.execute(f"""SELECT t.id, c.inputs, c.output_schema
                          FROM unnest(%s::uuid[]) AS t(id) CROSS JOIN LATERAL {STEP_CONTEXT_FUNCTION}(t.id) AS c""",
                    [list(task_ids)])
        rows = cur.fetchall()
    return {row[0]: _as_context(row[1], row[2]) for row in rows}


def _as_context(inputs: Any, schema: Any) -> StepContext:
    inputs, schema = from_json(inputs), from_json(schema)
    return StepContext(inputs=inputs if isinstance(inputs, dict) else {},
                       output_schema=schema if isinstance(schema, dict) else None)
