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
  fan-out read 1,000 rows, not a million), and gets it as it is stored, never re-built into a new
  value (which copied the 1,000 outputs for each of the 1,000 tasks). Any later change of a parent
  task's final state (a retry, a redrive) clears that row's output (the step counts' trigger), and a
  parent without a gathered output (released by the previous release's code, or changed since) is
  read from its tasks as before, so the two reads give the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db import connection

from accs_site.redaction import SECRET_KEY_RE, secrets_in
from jobs.locks import LOCK_WAIT_SQL, lock_wait_ms
from jobs.sql import bind_params, from_json, query_function_sql

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

# A task's parents' outputs as two arrays (step keys, outputs), which the reader makes into
# ``{key: output}``. Nothing here builds a new JSON value out of an output (a jsonb_object_agg copies
# every node of it: about a millisecond per task for a 1,000-host gather, a million nodes copied for the
# 1,000 tasks after it). Only a task of a fan-out over a parent's list builds the object its path is
# evaluated over, to read its item.
STEP_INPUTS_SQL = f"""
SELECT coalesce(ps.keys, pt.keys, '{{}}') AS parent_keys, coalesce(ps.outputs, pt.outputs, '{{}}') AS parent_outputs,
       CASE WHEN fo.over IS NOT NULL AND ix.i IS NOT NULL
            THEN jsonb_path_query_first((SELECT jsonb_object_agg(x.k, x.v)
                                           FROM unnest(coalesce(ps.keys, pt.keys), coalesce(ps.outputs, pt.outputs))
                                                AS x(k, v)),
                                        {JSONPATH_FUNCTION}(fo.over), '{{}}', true) -> ix.i END AS item,
       CASE WHEN fo.over IS NOT NULL THEN ix.i END AS item_index,
       {step_field("t", "j", "output_schema")} AS output_schema
  FROM accs_task t JOIN accs_job j ON j.id = t.job_id
 -- The parents' gathered outputs, one step row each (job_step_unique), when every parent has one.
 CROSS JOIN LATERAL (SELECT CASE WHEN bool_and(s.output IS NOT NULL) THEN array_agg(s.step_key::text) END AS keys,
                            CASE WHEN bool_and(s.output IS NOT NULL) THEN array_agg(s.output) END AS outputs
                       FROM accs_job_step s
                      WHERE s.job_id = t.job_id AND s.step_key = ANY (t.depends_on) AND s.total > 0) ps
 -- Else from their tasks (a parent released by the previous release's code, or changed since); a task
 -- without parents reads none (a filter on the task alone, decided before any row is read).
 CROSS JOIN LATERAL (SELECT array_agg(g.step_key::text) AS keys, array_agg(g.output) AS outputs
                       FROM (SELECT p.step_key, {GATHERED_OUTPUT} AS output
                               FROM accs_task p
                              WHERE ps.keys IS NULL AND cardinality(t.depends_on) > 0
                                AND p.job_id = t.job_id AND p.step_key = ANY (t.depends_on)
                              GROUP BY p.step_key) g) pt
 CROSS JOIN LATERAL (SELECT {step_field("t", "j", "fan_out")} ->> 'over' AS over) fo
 CROSS JOIN LATERAL (SELECT {ITEM_INDEX} AS i) ix
 WHERE t.id = %(task)s
"""


#: The read as a server-side function (created by a migration, its text built by :func:`step_inputs_function_sql`):
#: its plan is made once per server connection instead of at every attempt, where planning this statement
#: cost more than running it (5 ms against under 1). (``accs_step_context``, which built the inputs' object in
#: the database, is left for the previous release's agents.)
STEP_INPUTS_FUNCTION = "accs_step_inputs"


def step_inputs_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`STEP_INPUTS_FUNCTION`, built from STEP_INPUTS_SQL.

    A migration holds a copy; a test compares the database's function with this text.
    """
    body = bind_params(STEP_INPUTS_SQL, {"task": "p_task"}).strip()
    return query_function_sql(
        STEP_INPUTS_FUNCTION, "p_task uuid",
        "TABLE (parent_keys text[], parent_outputs jsonb[], item jsonb, item_index int, output_schema jsonb)",
        body, volatility="STABLE", tag="inputs")


@dataclass(frozen=True)
class StepContext:
    """What one task gets from its workflow: its parents' outputs and its own output schema (or None)."""

    inputs: dict[str, Any]
    output_schema: dict[str, Any] | None
    #: The values among ``inputs`` under secret-looking names (accs_site.redaction.secrets_in), for the
    #: attempt's logs to redact.
    secrets: tuple[str, ...] = ()


def step_context(task_id: UUID) -> StepContext:
    """Return the outputs of ``task_id``'s parents and its step's output schema (one statement)."""
    with connection.cursor() as cur:
        cur.execute(f"SELECT * FROM {STEP_INPUTS_FUNCTION}(%s)", [task_id])
        row = cur.fetchone()
    if row is None:  # the task is gone (its job was deleted): nothing to give
        return StepContext(inputs={}, output_schema=None)
    return _as_context(*row)


def step_contexts(task_ids: Sequence[UUID], *, lock_wait: float) -> dict[UUID, StepContext]:
    """Return the step contexts of ``task_ids`` (as :func:`step_context` gives each) in one statement.

    For an agent's batch of claimed tasks: one round trip instead of one per task, each in line for
    the agent's one pooled connection. No lock is waited for longer than ``lock_wait`` seconds (the
    lock timeout is the transaction's own): a lock wait that runs out raises, and the caller leaves
    each task to read its own. A task that is gone is left out.
    """
    if not task_ids:
        return {}
    with connection.cursor() as cur:
        cur.execute(STEP_INPUTS_BATCH_SQL, [lock_wait_ms(lock_wait), list(task_ids)])
        rows = cur.fetchall()
    return {row[0]: _as_context(*row[1:]) for row in rows}


# The batch read as one statement, one round trip (no BEGIN, no COMMIT around it): the lock timeout is
# set for the statement's own transaction first, and each task's read takes its id through the setting's
# answer, so none runs before it (as the bounded claim call does).
STEP_INPUTS_BATCH_SQL = f"""
SELECT t.id, c.* FROM {LOCK_WAIT_SQL.format(ms="%s")} AS w(setting), unnest(%s::uuid[]) AS t(id)
 CROSS JOIN LATERAL {STEP_INPUTS_FUNCTION}(CASE WHEN w.setting IS NOT NULL THEN t.id END) AS c
"""


def _as_context(keys: list[str] | None, outputs: list[Any] | None, item: Any, item_index: int | None,
                schema: Any) -> StepContext:
    """The parents' outputs as ``{step key: output}`` (and a list fan-out's ``item`` and ``index``), with the
    secret values among them."""
    inputs: dict[str, Any] = {}
    secrets: list[str] = []
    pairs = list(zip(keys or [], outputs or [], strict=True))
    if item_index is not None:
        pairs.append(("item", item))
    for key, output in pairs:
        inputs[key] = from_json(output)
        # A secret-looking name appears as it is in the output's JSON text (letters are never escaped), so
        # an output whose text and key have none holds no secret: the walk of a wide gather is skipped.
        if not isinstance(output, str) or SECRET_KEY_RE.search(key) or SECRET_KEY_RE.search(output):
            secrets += secrets_in({key: inputs[key]})
    if item_index is not None:
        inputs["index"] = item_index
    schema = from_json(schema)
    return StepContext(inputs=inputs, output_schema=schema if isinstance(schema, dict) else None,
                       secrets=tuple(secrets))
