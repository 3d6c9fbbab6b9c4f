"""Promotion and completion: what follows when tasks of a job reach a final state.

Called by every verb that finishes tasks, with the job rows already locked (see
:mod:`jobs.locks`). It reads the per-step counts of ``accs_job_step`` (kept exact by a trigger
on ``accs_task``), so its cost per call follows the steps of the job, not its tasks:

* a step that can no longer succeed (a task of it failed, was skipped, canceled or blocked)
  skips its waiting dependents, once, except the dependents that are ``always`` steps;
* a step whose tasks are all final promotes, once, its waiting dependents (``waiting → queued``)
  whose dependencies are all done, and its waiting ``always`` dependents whose dependencies are
  all final, whatever their outcome;
* progress is the share of finished tasks, ``current_task_key`` the first unfinished step, and
  an admitted job is ``running`` while a task of it is starting or running, ``waiting``
  otherwise, and one whose tasks are all final ends ``error`` (a task of a ``fail_job`` step
  failed), ``canceled`` (a task was canceled), ``partial`` (tasks of ``continue`` steps failed, or
  some hosts were blocked) or ``done``.

Each step's failure policy (``on_failure``, ``always``) is copied from the workflow onto its
``accs_job_step`` row when the job is instantiated, so these statements read it from the rows they
already read.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from uuid import UUID

from events.timeline import EventRow
from jobs.inputs import GATHERED_OUTPUT, JSONPATH_FUNCTION, parent_outputs, step_field
from jobs.notify import notify, service_channel
from jobs.sql import bind_params
from jobs.states import JOB_ADMITTED, TASK_HELD, TASK_UNSTARTED, sql_in

MAX_DAG_DEPTH = 100  # skipping cascades one step level per pass


def finished(step: str) -> str:
    """Return SQL counting the tasks of a step row (aliased ``step``) that are in a final state."""
    return f"({step}.done + {step}.error + {step}.skipped + {step}.canceled + {step}.blocked)"


def is_always(task: str) -> str:
    """Return SQL telling whether a task (aliased ``task``) is of an ``always`` step (a job_step_unique probe)."""
    return (f"EXISTS (SELECT 1 FROM accs_job_step own WHERE own.job_id = {task}.job_id"
            f" AND own.step_key = {task}.step_key AND own.always)")


POISON_STEPS_SQL = """
UPDATE accs_job_step s SET poisoned = true
 WHERE s.job_id = ANY(%(jobs)s::uuid[]) AND NOT s.poisoned
   AND s.error + s.skipped + s.canceled + s.blocked > 0  -- the unsuccessful final states
RETURNING s.job_id, s.step_key
"""

SKIP_DEPENDENTS_SQL = f"""
-- Waiting tasks that depend on a step that can no longer succeed are skipped, unless their own
-- step is an "always" step (it runs once its dependencies are final).
WITH p AS (SELECT * FROM unnest(%(job_ids)s::uuid[], %(steps)s::text[]) AS p(job_id, step_key)),
sk AS (
    UPDATE accs_task w SET status = 'skipped', finished_at = %(now)s, updated_at = %(now)s,
           error_message = 'a dependency did not succeed'
      FROM p WHERE w.job_id = p.job_id AND w.status = 'waiting' AND p.step_key = ANY(w.depends_on)
       AND NOT {is_always("w")}
    RETURNING w.id, w.job_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT DISTINCT job_id, id, %(source)s, 'warn', 'status', 'task waiting → skipped (a dependency did not succeed)',
           '{{"from": "waiting", "to": "skipped"}}'::jsonb FROM sk
)
SELECT count(DISTINCT id) FROM sk
"""

RELEASE_STEPS_SQL = f"""
-- Steps whose tasks are all final, whatever their outcome: their waiting dependents are looked at
-- once (an unsuccessful step can only promote "always" dependents; the others were skipped).
-- Each such step's output is gathered once here, for its dependents' tasks to read from this row (see
-- jobs.inputs), when the job has another step that could read it.
UPDATE accs_job_step s
   SET released = true,
       output = CASE WHEN EXISTS (SELECT 1 FROM accs_job_step o WHERE o.job_id = s.job_id AND o.step_key <> s.step_key)
                     THEN (SELECT {GATHERED_OUTPUT} FROM accs_task p
                            WHERE p.job_id = s.job_id AND p.step_key = s.step_key) END
 WHERE s.job_id = ANY(%(jobs)s::uuid[]) AND NOT s.released AND {finished("s")} = s.total
   -- (The jobs read by id alone, then their status: OFFSET 0 keeps the status out of the read, where a plan
   -- made while few jobs were admitted read every admitted job through job_workflow_admitted_idx.)
   AND s.job_id = ANY(ARRAY(SELECT j.id FROM (SELECT id, status FROM accs_job WHERE id = ANY(%(jobs)s::uuid[])
                                               OFFSET 0) j
                             WHERE j.status IN {sql_in(JOB_ADMITTED)}))
RETURNING s.job_id, s.step_key
"""

# The waiting tasks (aliased ``w``) a promotion looks at: dependents of the steps just settled (or, with
# roots, tasks with no dependency at all) whose every dependency is done, or, for an "always" step's
# tasks, final whatever its outcome (its own step row says which).
PROMOTABLE = f"""w.status = 'waiting'
       -- (The jobs named first, so the waiting tasks are read by job, task_job_open_idx, and not every
       -- waiting task of every job: the alternatives below each name one of these jobs.)
       AND w.job_id = ANY(ARRAY(SELECT r.job_id FROM r) || %(roots)s::uuid[])
       AND (EXISTS (SELECT 1 FROM r WHERE r.job_id = w.job_id AND r.step_key = ANY(w.depends_on))
            OR (w.job_id = ANY(%(roots)s::uuid[]) AND cardinality(w.depends_on) = 0))
       AND NOT EXISTS (SELECT 1 FROM accs_job_step d WHERE d.job_id = w.job_id AND d.step_key = ANY(w.depends_on)
                          AND CASE WHEN {is_always("w")} THEN {finished("d")} ELSE d.done END < d.total)"""

CONDITION_SKIP_SQL = f"""
-- Tasks about to be promoted whose step runs only when a condition over its parents' outputs holds
-- ("when": a jsonpath predicate, read from the workflow version the job runs on) and it does not
-- (false, or no boolean at all) are skipped, the condition on the timeline; their dependents then
-- follow the skip rules. Only tasks of workflow steps that have a condition evaluate one. A stored
-- condition that is not a jsonpath at all (written past the validator) never holds, and says so.
WITH r AS (SELECT * FROM unnest(%(job_ids)s::uuid[], %(steps)s::text[]) AS r(job_id, step_key)),
c AS (
    SELECT w.id, w.job_id, cond.expr,
           CASE WHEN {JSONPATH_FUNCTION}(cond.expr) IS NULL THEN 'condition is not a valid jsonpath'
                ELSE 'condition did not hold' END AS why
      FROM accs_task w
     -- (The task's job by one probe of its primary key, LIMIT 1 keeping it a probe: joined, a plan made
     -- while the job table was nearly empty read all of it, and drove the tasks from it.)
     CROSS JOIN LATERAL (SELECT j.workflow_id FROM accs_job j WHERE j.id = w.job_id LIMIT 1) j
     CROSS JOIN LATERAL (SELECT {step_field("w", "j", "when")} #>> '{{}}' AS expr) cond
     WHERE {PROMOTABLE}
       AND cond.expr IS NOT NULL
       AND NOT coalesce(jsonb_path_match({parent_outputs("w")}, {JSONPATH_FUNCTION}(cond.expr), '{{}}'::jsonb, true),
                        false)
), sk AS (
    UPDATE accs_task t SET status = 'skipped', finished_at = %(now)s, updated_at = %(now)s,
           error_message = left(c.why || ': ' || c.expr, 2000)
      FROM c WHERE t.id = ANY(ARRAY(SELECT c.id FROM c)) AND t.id = c.id
    RETURNING t.id, t.job_id, c.expr, c.why
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, %(source)s, 'info', 'status', left('task waiting → skipped (' || why || ': ' || expr || ')',
                                                          2000),
           jsonb_build_object('from', 'waiting', 'to', 'skipped', 'reason', why, 'when', expr)
      FROM sk
)
SELECT count(*) FROM sk
"""

# The reason jobs.failure.apply gives the tasks it skips when a fail_job failure fails their job.
JOB_FAILED_REASON = "job failed"

#: The most tasks a step fanning out over a parent's list makes when its step row names no limit (a job made
#: by a release before the limit was recorded); the site's ACC_MAX_FAN_OUT_ITEMS is recorded otherwise.
DEFAULT_MAX_FAN_OUT_ITEMS = 1000


def item_task_id(task: str, index: str) -> str:
    """Return SQL making the id of item ``index`` of the fan-out of the task aliased ``task``: the layout of
    :func:`jobs.ids.uuid7` (48-bit milliseconds, version 7, a 42-bit counter, variant, 32 random bits) with
    the item's index as the counter and a time after the task's own id, so the step's tasks sort by id in
    the order of the list (the order its gatherers receive their outputs in)."""
    ms = (f"greatest((extract(epoch FROM clock_timestamp()) * 1000)::bigint,"
          f" ('x' || left(replace({task}.id::text, '-', ''), 12))::bit(48)::bigint + 1)")
    return (f"encode(int8send(({ms} << 16) | 28672 | (({index})::bigint >> 30 & 4095))"
            f" || int8send(x'8000000000000000'::bit(64)::bigint | ((({index})::bigint & 1073741823) << 32)"
            f" | floor(random() * 4294967296)::bigint), 'hex')::uuid")


FAN_OUT_SQL = f"""
-- Tasks about to be promoted whose step fans out over a list a parent returned ("fan_out": {{"over":
-- jsonpath}}, read from the workflow version the job runs on) become one task per item: the task itself
-- is item 0 (its key gains "[0]"), a copy is inserted for each further item (key "<step>[i]") and the
-- step's total grows to match, so its dependents wait for every item. Each item task reads its item
-- from the same list when it runs (jobs.inputs). An empty list skips the step's task; no list, or more
-- items than the step row's limit, fails it with the reason; either way no item task is made.
WITH r AS (SELECT * FROM unnest(%(job_ids)s::uuid[], %(steps)s::text[]) AS r(job_id, step_key)),
f AS (
    SELECT w.id, w.job_id, w.step_key, fo.over, coalesce(js.max_items, {DEFAULT_MAX_FAN_OUT_ITEMS}) AS max_items,
           jsonb_path_query_first({parent_outputs("w")}, {JSONPATH_FUNCTION}(fo.over), '{{}}'::jsonb, true) AS list
      FROM accs_task w
     -- (The task's job and step row by one probe each, as the condition's skip reads its job.)
     CROSS JOIN LATERAL (SELECT j.workflow_id FROM accs_job j WHERE j.id = w.job_id LIMIT 1) j
     CROSS JOIN LATERAL (SELECT js.max_items FROM accs_job_step js
                          WHERE js.job_id = w.job_id AND js.step_key = w.step_key LIMIT 1) js
     CROSS JOIN LATERAL (SELECT {step_field("w", "j", "fan_out")} ->> 'over' AS over) fo
     WHERE {PROMOTABLE}
       AND w.task_key = w.step_key AND fo.over IS NOT NULL
), v AS (
    SELECT f.*, CASE WHEN {JSONPATH_FUNCTION}(f.over) IS NULL THEN 'is not a valid jsonpath'
                     WHEN f.list IS NULL THEN 'found no value in the parents'' outputs'
                     WHEN jsonb_typeof(f.list) <> 'array' THEN 'found ' || jsonb_typeof(f.list) || ', not a list'
                     WHEN jsonb_array_length(f.list) > f.max_items
                         THEN 'found ' || jsonb_array_length(f.list) || ' items, more than the limit of '
                              || f.max_items || ' (ACC_MAX_FAN_OUT_ITEMS)'
                END AS failure,
           CASE WHEN jsonb_typeof(f.list) = 'array' THEN jsonb_array_length(f.list) END AS n
      FROM f
), t AS (
    UPDATE accs_task t
       SET task_key = CASE WHEN v.failure IS NULL AND v.n > 0 THEN t.step_key || '[0]' ELSE t.task_key END,
           status = CASE WHEN v.failure IS NOT NULL THEN 'error' WHEN v.n = 0 THEN 'skipped' ELSE t.status END,
           finished_at = CASE WHEN v.failure IS NOT NULL OR v.n = 0 THEN %(now)s END,
           error_code = CASE WHEN v.failure IS NOT NULL THEN 'fan_out_failed' ELSE t.error_code END,
           error_message = CASE WHEN v.failure IS NOT NULL
                                     THEN left('fan_out over ' || v.over || ' ' || v.failure, 2000)
                                WHEN v.n = 0 THEN left('fan_out over an empty list: ' || v.over, 2000)
                                ELSE t.error_message END,
           updated_at = %(now)s
      -- (The tasks by primary key, as every update here: joined alone to the few rows of v, a plan made while
      -- the table was small read the whole primary key, at every call, however few v held.)
      FROM v WHERE t.id = ANY(ARRAY(SELECT v.id FROM v)) AND t.id = v.id
    RETURNING t.id, t.job_id, t.step_key, t.status, t.error_message, v.n, v.over
), more AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT {item_task_id("w", "i")}, w.job_id, w.tenant_id, w.step_key || '[' || i || ']', w.step_key,
           w.service_id, w.host_id, w.exclusive, 'waiting', w.depends_on, 0, w.max_attempts, %(now)s, w.priority,
           w.order_seq, w.timeout_seconds, w.params, w.assigned_node, '', '', '', '', %(now)s, %(now)s
      FROM v JOIN accs_task w ON w.id = v.id AND w.id = ANY(ARRAY(SELECT v.id FROM v))
     CROSS JOIN LATERAL generate_series(1, v.n - 1) AS i
     WHERE v.failure IS NULL AND v.n > 1
     ORDER BY w.id, i
), grow AS (
    UPDATE accs_job_step s SET total = s.total + v.n - 1
      FROM v WHERE s.job_id = v.job_id AND s.step_key = v.step_key AND v.failure IS NULL AND v.n > 1
), rest AS (
    -- A failed fan-out of an on_failure "fail_job" step fails its job as a failed task does (jobs.failure):
    -- the job's other unstarted tasks are skipped (halt), except those of "always" steps. (Read by job,
    -- task_job_open_idx: "IN (...)" let a plan read every unstarted task of every job.)
    SELECT u.id, u.status AS was FROM accs_task u
     WHERE u.job_id = ANY(ARRAY(SELECT v.job_id FROM v JOIN accs_job_step js ON js.job_id = v.job_id
                                                      AND js.step_key = v.step_key
                               WHERE v.failure IS NOT NULL AND js.on_failure = 'fail_job'))
       AND u.status IN {sql_in(TASK_UNSTARTED)} AND NOT {is_always("u")}
       AND u.id NOT IN (SELECT id FROM v)
), halt AS (
    UPDATE accs_task o SET status = 'skipped', finished_at = %(now)s, updated_at = %(now)s,
           error_message = '{JOB_FAILED_REASON}'
     -- (By primary key alone, as the claim's update; each task's status before comes from rest. Joined to
     -- rest, a plan could read every named task once per task of rest: a failed job's thousands.)
     WHERE o.id = ANY(ARRAY(SELECT x.id FROM rest x))
    RETURNING o.id, o.job_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT h.job_id, h.id, %(source)s, 'warn', 'status', 'task ' || x.was || ' → skipped ({JOB_FAILED_REASON})',
           jsonb_build_object('from', x.was, 'to', 'skipped', 'reason', '{JOB_FAILED_REASON}')
      FROM halt h JOIN rest x ON x.id = h.id
    UNION ALL
    SELECT job_id, id, %(source)s, CASE status WHEN 'error' THEN 'error' ELSE 'info' END, 'status',
           CASE status WHEN 'waiting' THEN 'step ' || step_key || ' fanned out over ' || over || ': ' || n || ' task(s)'
                ELSE left('task waiting → ' || status || ' (' || error_message || ')', 2000) END,
           CASE status WHEN 'waiting' THEN jsonb_build_object('fan_out', over, 'tasks', n)
                ELSE jsonb_build_object('from', 'waiting', 'to', status, 'reason', error_message, 'fan_out', over) END
      FROM t
    UNION ALL
    -- The job's own line, as a failed task's fail_job policy writes one: why the job fails.
    SELECT t.job_id, NULL, %(source)s, 'error', 'policy',
           left('job fails (on_failure fail_job): ' || t.error_message, 2000),
           jsonb_build_object('on_failure', 'fail_job', 'reason', t.error_message, 'fan_out', t.over)
      FROM t JOIN accs_job_step js ON js.job_id = t.job_id AND js.step_key = t.step_key
     WHERE t.status = 'error' AND js.on_failure = 'fail_job'
)
SELECT count(*) FROM t WHERE t.status <> 'waiting'
"""

PROMOTE_SQL = f"""
-- Waiting dependents of the steps just settled (or, with roots, tasks with no dependency at all)
-- become queued once every step they depend on is done; an "always" step's tasks once every step
-- they depend on is final, whatever its outcome (its own step row says which).
WITH r AS (SELECT * FROM unnest(%(job_ids)s::uuid[], %(steps)s::text[]) AS r(job_id, step_key)),
p AS (
    UPDATE accs_task w SET status = 'queued', next_attempt_at = %(now)s, updated_at = %(now)s
     WHERE {PROMOTABLE}
    RETURNING w.id, w.job_id, w.service_id
), ev AS (
    INSERT INTO accs_event (job_id, task_id, source, level, type, message, data)
    SELECT job_id, id, %(source)s, 'info', 'status', 'task waiting → queued',
           '{{"from": "waiting", "to": "queued"}}'::jsonb FROM p
)
SELECT DISTINCT s.key::text FROM p JOIN accs_service s ON s.id = p.service_id
"""

# --------------------------------------------------------------------------------------------
# The timeline of a transaction's moves: a row per task moved, its job's moves folded in
# --------------------------------------------------------------------------------------------
#
# An agent's report of a short task moves its job waiting → running, the task starting → running →
# done and the job running → done, all in one transaction. Such moves are written as ONE row per task
# moved (events.timeline.unfold shows its lines): the task's moves in order (``from``, then ``via``, then
# ``to``; ``level`` where theirs is not info); the moves its job made before them (its start) on the row
# of the job's first task moved (``job_before``), and those after (its end) on the row of its last
# (``job``). A job that moved while no task of it did gets a row of its own per move, as every job move
# had before.
#
# The statements that move tasks hand their moves over rather than writing them: task moves as
# ``{"id", "job_id", "task_id", "attempt", "level"?, "data": {"from", "to", "via"?, ...}}`` (``%(moves)s``;
# ``id`` is the row's, taken when the move was made: RESERVE_EVENT_ID),
# job moves as ``{"job_id", "move": {"from", "to", ..., "message"?, "level"?}}`` (``%(job_moves)s``, the
# moves made before the tasks'; a move names its message and level only where they are not the plain
# "job <from> → <to>" at level info). The statement that writes them follows them with its own.

#: A task's move takes its row's id (the timeline's order) when it is made: the row is written later, after
#: rows of what followed from it (a dependent task promoted when it finished), and still reads before them.
RESERVE_EVENT_ID = "nextval('accs_event_id_seq')"

#: The task moves handed over, as rows.
TASK_MOVES = ("tm AS (SELECT * FROM jsonb_to_recordset(%(moves)s::jsonb)"
              " AS m(id bigint, job_id uuid, task_id uuid, attempt int, level text, data jsonb))")


def level_rank(level: str) -> str:
    """Return SQL ranking an event level (debug 0, info 1, warn 2, error 3; none is info)."""
    return f"CASE {level} WHEN 'error' THEN 3 WHEN 'warn' THEN 2 WHEN 'debug' THEN 0 ELSE 1 END"


# The rows, after the CTEs ``tm`` (task moves) and ``jm`` (job_id, before, move): a row per task moved, and
# a row per move of a job no task of which moved. Its message names the task's moves and its job's:
# "task starting → done (job waiting → running → done)".
WRITE_MOVES_SQL = f"""
, tmo AS (
    SELECT tm.*, row_number() OVER (PARTITION BY tm.job_id ORDER BY tm.id, tm.task_id) AS i,
           count(*) OVER (PARTITION BY tm.job_id) AS n
      FROM tm
), jmv AS (
    SELECT jm.job_id,
           jsonb_agg(jm.move) FILTER (WHERE jm.before) AS before,
           jsonb_agg(jm.move) FILTER (WHERE NOT jm.before) AS after,
           max({level_rank("jm.move ->> 'level'")}) FILTER (WHERE jm.before) AS before_rank,
           max({level_rank("jm.move ->> 'level'")}) FILTER (WHERE NOT jm.before) AS after_rank
      FROM jm GROUP BY jm.job_id
), r AS (
    SELECT t.id, t.job_id, t.task_id, t.attempt, t.data, t.level,
           CASE WHEN t.i = 1 THEN j.before END AS before, CASE WHEN t.i = t.n THEN j.after END AS after,
           greatest({level_rank("t.level")}, CASE WHEN t.i = 1 THEN j.before_rank END,
                    CASE WHEN t.i = t.n THEN j.after_rank END) AS rank
      FROM tmo t LEFT JOIN jmv j ON j.job_id = t.job_id
)
INSERT INTO accs_event (id, ts, job_id, task_id, attempt, source, level, type, message, data)
SELECT coalesce(r.id, {RESERVE_EVENT_ID}), %(now)s, r.job_id, r.task_id, r.attempt, %(source)s,
       (ARRAY['debug', 'info', 'warn', 'error'])[r.rank + 1], 'status',
       'task ' || (r.data ->> 'from') || ' → ' || (r.data ->> 'to')
       || coalesce(' (job ' || (coalesce(r.before, r.after) -> 0 ->> 'from') || ' → '
                   || (SELECT string_agg(m.move ->> 'to', ' → ' ORDER BY m.i)
                         FROM jsonb_array_elements(coalesce(r.before, '[]') || coalesce(r.after, '[]'))
                              WITH ORDINALITY AS m(move, i)) || ')', ''),
       r.data || jsonb_strip_nulls(jsonb_build_object('level', nullif(r.level, 'info'), 'job_before', r.before,
                                                      'job', r.after))
  FROM r
UNION ALL
SELECT {RESERVE_EVENT_ID}, %(now)s, jm.job_id, NULL, NULL, %(source)s, coalesce(jm.move ->> 'level', 'info'), 'status',
       coalesce(jm.move ->> 'message', 'job ' || (jm.move ->> 'from') || ' → ' || (jm.move ->> 'to')),
       jm.move - 'message' - 'level'
  FROM jm WHERE jm.job_id NOT IN (SELECT tm.job_id FROM tm)"""

# The moves of a transaction that finalizes no job (a report of starts alone), written on their own.
WRITE_MOVES_ALONE_SQL = f"""
WITH jm AS (
    SELECT m.job_id, true AS before, m.move FROM jsonb_to_recordset(%(job_moves)s::jsonb) AS m(job_id uuid, move jsonb)
), {TASK_MOVES}{WRITE_MOVES_SQL}"""

FINISH_SQL = f"""
-- Progress, current step and status of admitted jobs. A job whose tasks are all final ends; any
-- other admitted job is "running" while a task of it is starting or running and "waiting"
-- otherwise (task_job_open_idx answers the EXISTS with two index probes). How it ends follows
-- the steps' failure policies: a failed task of a "fail_job" step makes it "error", else a canceled
-- task "canceled", else failed tasks of "continue" steps or blocked hosts "partial", else "done".
WITH agg AS (
    SELECT job_id, sum(total) AS total, sum({finished("s")}) AS finished,
           sum(error) AS error, sum(canceled) AS canceled, sum(blocked) AS blocked,
           coalesce(sum(error) FILTER (WHERE on_failure = 'fail_job'), 0) AS fatal,
           coalesce(sum(error) FILTER (WHERE on_failure = 'continue'), 0) AS tolerated,
           count(*) FILTER (WHERE on_failure = 'continue' AND error > 0) AS tolerated_steps,
           (array_agg(step_key ORDER BY position)
                FILTER (WHERE {finished("s")} < total))[1] AS current_key
      FROM accs_job_step s WHERE job_id = ANY(%(jobs)s::uuid[]) GROUP BY job_id
), verdict AS (
    SELECT agg.*, j.status AS was,
           CASE WHEN j.status IN {sql_in(JOB_ADMITTED)} AND agg.finished = agg.total THEN
                     CASE WHEN agg.fatal > 0 THEN 'error' WHEN agg.canceled > 0 THEN 'canceled'
                          WHEN agg.tolerated + agg.blocked > 0 THEN 'partial' ELSE 'done' END END AS ends,
           CASE WHEN j.status IN {sql_in(JOB_ADMITTED)} THEN
                     CASE WHEN EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = agg.job_id
                                          AND t.status IN {sql_in(TASK_HELD)}) THEN 'running' ELSE 'waiting' END
                END AS settles,
           concat_ws('; ',
                     CASE WHEN agg.tolerated > 0 THEN agg.tolerated || ' task(s) of ' || agg.tolerated_steps
                          || ' step(s) with on_failure "continue" failed; their dependents were skipped' END,
                     CASE WHEN agg.blocked > 0 THEN agg.blocked || ' of ' || agg.total
                          || ' task(s) blocked on their host' END) AS partly
      FROM agg JOIN accs_job j ON j.id = agg.job_id
     -- (The jobs by primary key: joined alone, a generic plan made while the table was small read the
     -- whole primary key at every call.)
     WHERE j.id = ANY(%(jobs)s::uuid[])
), upd AS (
    UPDATE accs_job j
       SET progress = v.finished::float / greatest(v.total, 1),
           current_task_key = coalesce(v.current_key, j.current_task_key),
           status = coalesce(v.ends, v.settles, j.status),
           finished_at = CASE WHEN v.ends IS NOT NULL THEN %(now)s ELSE j.finished_at END,
           error_code = CASE v.ends WHEN 'error' THEN 'task_failed' WHEN 'canceled' THEN 'canceled'
                                    WHEN 'partial' THEN CASE WHEN v.tolerated > 0 THEN 'steps_failed'
                                                             ELSE 'hosts_blocked' END
                                    ELSE j.error_code END,
           error_message = CASE v.ends WHEN 'error' THEN v.error || ' task(s) failed'
                                       WHEN 'canceled' THEN v.canceled || ' task(s) canceled'
                                       WHEN 'partial' THEN v.partly
                                       ELSE j.error_message END,
           updated_at = %(now)s
      -- (Each job by its primary key, one probe per verdict: written as a range, the condition cannot be
      -- hashed or merged, so no plan can read the whole primary key to join it, as one made while the
      -- table was nearly empty did at every call; "= ANY" beside the join let a plan read every named
      -- job for each verdict instead.)
      FROM verdict v WHERE j.id >= v.job_id AND j.id <= v.job_id
    RETURNING j.id
), jm AS (
    -- The jobs' moves: those the caller made before this statement (a task's start moving its job from
    -- waiting), then this statement's own. A move names its message and level only where they are not
    -- the plain "job <from> → <to>" at level info.
    SELECT m.job_id, true AS before, m.move FROM jsonb_to_recordset(%(job_moves)s::jsonb) AS m(job_id uuid, move jsonb)
    UNION ALL
    SELECT v.job_id, false,
           jsonb_build_object('from', v.was, 'to', v.ends, 'total', v.total)
           -- (The counts that are not 0: a done job's end names none.)
           || jsonb_strip_nulls(jsonb_build_object(
                  'blocked', nullif(v.blocked, 0), 'canceled', nullif(v.canceled, 0), 'error', nullif(v.error, 0),
                  'continue_failed', nullif(v.tolerated, 0), 'continue_failed_steps', nullif(v.tolerated_steps, 0),
                  'level', CASE v.ends WHEN 'done' THEN NULL WHEN 'error' THEN 'error' ELSE 'warn' END,
                  -- (NULL, so left out, where no reason follows the move: a done or canceled job's.)
                  'message', 'job ' || v.was || ' → ' || v.ends
                             || CASE WHEN v.ends = 'partial' AND v.tolerated = 0
                                         THEN ' (' || v.blocked || ' of ' || v.total || ' task(s) blocked)'
                                     WHEN v.ends = 'partial' THEN ' (' || v.partly || ')'
                                     WHEN v.ends = 'error'
                                         THEN ' (' || v.fatal || ' task(s) of on_failure "fail_job" steps failed)'
                                END))
      FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NOT NULL
    UNION ALL
    SELECT v.job_id, false,
           jsonb_build_object('from', v.was, 'to', v.settles, 'message',
                              'job ' || v.was || ' → ' || v.settles
                              || CASE v.settles WHEN 'waiting' THEN ' (no task starting or running)'
                                                ELSE ' (a task is starting or running)' END)
      FROM verdict v JOIN upd ON upd.id = v.job_id WHERE v.ends IS NULL AND v.settles <> v.was
), {TASK_MOVES}{WRITE_MOVES_SQL}
"""


def finalize_jobs(cur, job_ids: Sequence[UUID], *, now: datetime, source: str, roots: bool = False,
                  moves: Sequence[str] = (), job_moves: Sequence[str] = ()) -> None:
    """Skip, promote, update progress and finish the given (locked) jobs; write the transaction's moves.

    ``roots`` also promotes waiting tasks without dependencies: a job just re-admitted after a
    retry, whose tasks waited for admission. ``moves`` and ``job_moves`` are the moves of tasks and
    jobs the caller made and has not written, each a JSON object's text (see WRITE_MOVES_SQL): they
    are written with the jobs' own moves, a row per task.
    """
    if not job_ids:
        write_moves(cur, moves, job_moves, now=now, source=source)
        return
    # One call of the server-side function that runs the statements above (see finalize_function_sql).
    cur.execute(f"SELECT * FROM {FINALIZE_FUNCTION}(%s::uuid[], %s::timestamptz, %s, %s, %s::jsonb, %s::jsonb)",
                [sorted({str(j) for j in job_ids}), now, source, roots, json_array(moves), json_array(job_moves)])
    notify(cur, [service_channel(r[0]) for r in cur.fetchall()])


def json_array(items: Sequence[str]) -> str:
    """Return the JSON array of ``items``, each a JSON value's text (as a jsonb column reads on Django's cursor)."""
    return "[" + ",".join(items) + "]"


def write_moves(cur, moves: Sequence[str], job_moves: Sequence[str], *, now: datetime, source: str) -> None:
    """Write moves of tasks and jobs that no finalization follows (see WRITE_MOVES_SQL)."""
    if moves or job_moves:
        cur.execute(WRITE_MOVES_ALONE_SQL, {"moves": json_array(moves), "job_moves": json_array(job_moves),
                                            "now": now, "source": source})


REWAIT_ALWAYS_SQL = f"""
-- Queued (never started) tasks of "always" steps go back to waiting while a step they depend on
-- is not final any more (a retry re-queued a task of it): they run once every dependency is final
-- again, and finalize promotes them then.
WITH o AS (
    SELECT t.id, t.job_id FROM accs_task t
     WHERE t.job_id = ANY(%(jobs)s::uuid[]) AND t.status = 'queued' AND {is_always("t")}
       AND EXISTS (SELECT 1 FROM accs_job_step d WHERE d.job_id = t.job_id AND d.step_key = ANY(t.depends_on)
                      AND {finished("d")} < d.total)
)
UPDATE accs_task t SET status = 'waiting', updated_at = %(now)s FROM o WHERE t.id = o.id
RETURNING t.id, t.job_id
"""


def rewait_always(cur, job_ids: Sequence[UUID], *, now: datetime, source: str) -> list[EventRow]:
    """Send queued ``always`` tasks of (locked) jobs back to waiting while a dependency is not final; return events."""
    if not job_ids:
        return []
    cur.execute(REWAIT_ALWAYS_SQL, {"jobs": sorted({str(j) for j in job_ids}), "now": now})
    why = "a dependency was retried; an always step waits until every dependency is final"
    return [EventRow(type="status", job_id=jid, task_id=tid, source=source, message=f"task queued → waiting ({why})",
                     data={"from": "queued", "to": "waiting", "reason": why})
            for tid, jid in sorted(cur.fetchall())]  # the order of creation, as skip_unstarted's


def reset_step_flags(cur, job_ids: Sequence[UUID]) -> None:
    """Forget which steps already released or skipped their dependents (after a retry resets tasks)."""
    cur.execute("UPDATE accs_job_step SET released = false, poisoned = false WHERE job_id = ANY(%s::uuid[])",
                [[str(j) for j in job_ids]])



def skip_unstarted(cur, job_ids: Sequence[UUID], *, now: datetime, source: str, reason: str,
                   to: str = "skipped", keep_always: bool = False) -> list[EventRow]:
    """Move the unstarted (waiting, queued, scheduled) tasks of (locked) jobs to ``to``; return their events.

    ``keep_always`` leaves the tasks of ``always`` steps alone (a failed job still runs its
    cleanup); an operator's cancel or reject cancels them too. Unstarted tasks are locked by
    nobody but claims, which never wait, so this unsorted UPDATE cannot close a lock cycle.
    """
    cur.execute(
        "WITH o AS (SELECT t.id, t.status FROM accs_task t WHERE t.job_id = ANY(%s::uuid[])"
        f"           AND t.status IN {sql_in(TASK_UNSTARTED)}"
        f"           AND NOT (%s AND {is_always('t')})"
        "           FOR UPDATE)"
        f" UPDATE accs_task t SET status = '{to}', finished_at = %s, updated_at = %s, error_message = %s"
        " FROM o WHERE t.id = o.id RETURNING t.id, t.job_id, o.status",
        [[str(j) for j in job_ids], keep_always, now, now, reason],
    )
    # In the order of the task ids (time-ordered: the order the tasks were created), not RETURNING's,
    # which is whatever order the plan read the rows in: the timeline lists them the same every time.
    return [EventRow(type="status", job_id=jid, task_id=tid, source=source, level="warn",
                     message=f"task {frm} → {to} ({reason})", data={"from": frm, "to": to, "reason": reason})
            for tid, jid, frm in sorted(cur.fetchall())]


# finalize_jobs as one server-side function (migration 0020): its statements in one round trip
# instead of four or more, each planned once per server connection (PL/pgSQL caches the plans)
# rather than at every call. The function runs the statements above, their parameters bound to
# its variables; a test compares the database's function with finalize_function_sql(), so a change
# to a statement comes with a migration that replaces the function. It returns the keys of the
# services whose tasks it promoted, for the caller's NOTIFY (the channel names are the caller's).
# (It took the moves to write when the timeline began folding them, migration 0047; the function
# before, accs_finalize_jobs, is left for the previous release's daemons.)
FINALIZE_FUNCTION = "accs_finalize_and_write"

_FINALIZE_PARAMS = {"jobs": "p_jobs", "job_ids": "v_job_ids", "steps": "v_steps", "now": "p_now",
                    "source": "p_source", "roots": "v_roots", "moves": "p_moves", "job_moves": "p_job_moves"}


def _bind(sql: str) -> str:
    """Return ``sql`` with its ``%(name)s`` parameters replaced by the function's variables."""
    return bind_params(sql, _FINALIZE_PARAMS).strip()


def _into(sql: str, last_select: str, target: str) -> str:
    """Return ``sql`` whose final ``last_select`` stores its row into ``target`` (PL/pgSQL's INTO)."""
    if not sql.rstrip().endswith(last_select):
        raise AssertionError(f"the statement no longer ends with {last_select!r}: update finalize_function_sql")
    head, _, rest = sql.rpartition(last_select)
    select_list, _, from_part = last_select.partition(" FROM ")
    return f"{head}{select_list} INTO {target} FROM {from_part}{rest}"


def finalize_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`FINALIZE_FUNCTION`, built from the statements above."""
    poison = _bind(f"WITH x AS ({POISON_STEPS_SQL.strip()})\n"
                   "SELECT array_agg(x.job_id), array_agg(x.step_key) INTO v_job_ids, v_steps FROM x")
    skip = _into(_bind(SKIP_DEPENDENTS_SQL), "SELECT count(DISTINCT id) FROM sk", "v_n")
    release = _bind(f"WITH x AS ({RELEASE_STEPS_SQL.strip()})\n"
                    "SELECT coalesce(array_agg(x.job_id), '{}'), coalesce(array_agg(x.step_key), '{}')"
                    " INTO v_job_ids, v_steps FROM x")
    condition_skip = _into(_bind(CONDITION_SKIP_SQL), "SELECT count(*) FROM sk", "v_n")
    fan_out = _into(_bind(FAN_OUT_SQL), "SELECT count(*) FROM t WHERE t.status <> 'waiting'", "v_m")
    return f"""CREATE OR REPLACE FUNCTION {FINALIZE_FUNCTION}(p_jobs uuid[], p_now timestamptz, p_source text,
                                                   p_roots bool, p_moves jsonb, p_job_moves jsonb)
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement (see jobs.claim's claim function).
SET plan_cache_mode = force_generic_plan
SET jit = off  -- as the claim function: a generic plan's cost must not start a compile per call
-- No sequential scans: every statement reads rows by the ids it was given (jobs, tasks, their steps), but a
-- plan made while a table was small (a connection's first call after a burst had ended) joined them by
-- reading the whole table, and kept doing so as the table grew, for as long as the connection lived.
SET enable_seqscan = off
AS $finalize$
#variable_conflict use_column
DECLARE
    v_job_ids uuid[];
    v_steps text[];
    v_roots uuid[];
    v_n bigint;
    v_m bigint;
BEGIN
    v_roots := CASE WHEN p_roots THEN p_jobs ELSE '{{}}'::uuid[] END;
    -- A pass skips and releases what settled, skips the tasks whose step's condition does not hold, makes
    -- one task per item of the steps fanning out over a parent's list and promotes the rest; steps a
    -- condition or a fan-out ended settle too, so passes repeat until none is.
    FOR k IN 1..{MAX_DAG_DEPTH} LOOP
        FOR i IN 1..{MAX_DAG_DEPTH} LOOP
            {poison};
            EXIT WHEN v_job_ids IS NULL;
            {skip};
        END LOOP;
        {release};
        v_n := 0;
        IF cardinality(v_job_ids) > 0 OR cardinality(v_roots) > 0 THEN
            {condition_skip};
            {fan_out};
            v_n := v_n + v_m;
            RETURN QUERY {_bind(PROMOTE_SQL)};
        END IF;
        v_roots := '{{}}'::uuid[];
        EXIT WHEN v_n = 0;
    END LOOP;
    {_bind(FINISH_SQL)};
END
$finalize$"""
