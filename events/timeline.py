"""Writing the timeline. Events are rows of ``accs_event``; every status change writes one in the
transaction that makes the change (callers pass their cursor).

A job's creation with its tasks is ONE row (:func:`creation_event`), not one per job move and per
task: the job's status change, with ``data["tasks"]`` naming each task created and its status. Readers
that show the timeline line by line unfold it with :func:`unfold` into the job's moves and one
"task created" line per task, so nothing is lost to operators.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection

from events.models import Event, Level


@dataclass
class EventRow:
    """One event to insert."""

    type: str
    message: str
    job_id: UUID | str | None = None
    task_id: UUID | str | None = None
    attempt: int | None = None
    source: str = "system"
    level: str = "info"
    data: dict[str, Any] = field(default_factory=dict)


INSERT_EVENTS_SQL = """
INSERT INTO accs_event (job_id, task_id, attempt, source, level, type, message, data)
SELECT j, t, a, s, l, ty, m, d::jsonb
  FROM unnest(%s::uuid[], %s::uuid[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[])
       AS e(j, t, a, s, l, ty, m, d)
"""


def write_events(rows: Sequence[EventRow], *, cursor=None) -> None:
    """Insert events in one statement, on ``cursor`` (default: Django's connection)."""
    if not rows:
        return
    params: list[list[Any]] = [
        [str(r.job_id) if r.job_id else None for r in rows],
        [str(r.task_id) if r.task_id else None for r in rows],
        [r.attempt for r in rows],
        [r.source for r in rows],
        [r.level for r in rows],
        [r.type for r in rows],
        [r.message for r in rows],
        [json.dumps(r.data, default=str) for r in rows],
    ]
    if cursor is None:
        with connection.cursor() as cur:
            cur.execute(INSERT_EVENTS_SQL, params)
    else:
        cursor.execute(INSERT_EVENTS_SQL, params)


def log_event(level: str, type: str, message: str, data: dict[str, Any] | None = None, *,
              job_id=None, job_task_id=None, attempt: int | None = None, source: str = "system") -> None:
    """Append one event (one row of :func:`write_events`)."""
    write_events([EventRow(type=type, message=message, job_id=job_id, task_id=job_task_id, attempt=attempt,
                           source=source, level=level, data=data or {})])


#: The ``source`` of what the builder writes.
BUILDER = "builder"


def operator_source(by: str) -> str:
    """Return the ``source`` of an operator's action: ``user:<name>``, or ``api`` when no user is named."""
    return f"user:{by}" if by else "api"


# --------------------------------------------------------------------------------------------
# A job's creation: one row for the job and its tasks
# --------------------------------------------------------------------------------------------

#: The job's creation started at once: the row is the job's move from nothing to ``waiting``.
CREATED = "created"
#: Admitted by the builder: the row is the job's move from ``queued`` to ``waiting``.
ADMITTED = "queued"


def created_tasks(tasks: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """Return the ``data["tasks"]`` entries of a creation event: each task's id, key and first status."""
    return [{"id": str(t["id"]), "task_key": t["task_key"], "to": str(t["status"])} for t in tasks]


def tasks_summary(statuses: Sequence[str]) -> str:
    """Return ``1 task queued`` or ``3 tasks: 2 queued, 1 waiting`` (first statuses, in order of appearance)."""
    if len(statuses) == 1:
        return f"1 task {statuses[0]}"
    counts = Counter(statuses)
    return f"{len(statuses)} tasks: " + ", ".join(f"{n} {status}" for status, n in counts.items())


def creation_message(frm: str, statuses: Sequence[str]) -> str:
    """Return the message of a creation event (``frm`` is :data:`CREATED` or :data:`ADMITTED`)."""
    move = "job created waiting" if frm == CREATED else "job queued → waiting"
    return f"{move}, {tasks_summary(statuses)}" if statuses else move


def creation_level(statuses: Iterable[str]) -> str:
    """A creation with a blocked task is a warning, as the blocked task's own line is."""
    return Level.WARN if "blocked" in statuses else Level.INFO


def creation_event(job_id: UUID | str, tasks: list[dict[str, Any]], *, source: str) -> EventRow:
    """Return the one event recording the builder's admission of a queued job with its new tasks."""
    entries = created_tasks(tasks)
    statuses = [e["to"] for e in entries]
    return EventRow(type="status", message=creation_message(ADMITTED, statuses), job_id=job_id, source=source,
                    level=creation_level(statuses), data={"from": ADMITTED, "to": "waiting", "tasks": entries})


def is_creation(event: Event) -> bool:
    """Whether ``event`` is a job's compact creation row (a job move that lists the tasks it created)."""
    data = event.data
    return (event.task_id is None and event.type == "status" and isinstance(data, dict)
            and isinstance(data.get("tasks"), list) and data.get("from") in (CREATED, ADMITTED))


def is_folded(event: Event) -> bool:
    """Whether ``event`` is a task's row that folds several moves (its own through ``via``, its job's)."""
    data = event.data
    return (event.task_id is not None and event.type == "status" and isinstance(data, dict)
            and (any(isinstance(data.get(k), list) for k in ("via", "job_before", "job"))
                 or isinstance(data.get("created"), dict)))


def job_move_message(move: dict[str, Any]) -> str:
    """Return the line of a job's move folded into a task's row: its own message, else ``job <from> → <to>``."""
    return move.get("message") or f"job {move.get('from', '')} → {move.get('to', '')}"


def unfold(event: Event) -> list[Event]:
    """Return a row that stands for several lines as those lines, oldest first; any other event as itself.

    A job's creation row stands for the job's moves (created → queued, queued → waiting) and one "task
    created" line per task, with each task's id and key. A task's folded row (jobs.finalize: a report's
    moves, a row per task) stands for the moves its job made before the task's, the task's own moves
    one line each (``from``, each of ``via``, ``to``) and the moves its job made after them. Each line
    has the row's time, source and id: what the timeline showed when each was a row of its own. The
    lines are not saved.
    """
    if is_folded(event):
        if isinstance(event.data.get("created"), dict):
            return _unfold_created(event)
        return _unfold_moves(event)
    if not is_creation(event):
        return [event]
    data = event.data

    def line(message: str, level: str, line_data: dict[str, Any], task_id: Any = None) -> Event:
        return Event(id=event.id, ts=event.ts, job_id=event.job_id, task_id=task_id, attempt=None,
                     source=event.source, level=level, type=event.type, message=message, data=line_data)

    lines = []
    if data["from"] == CREATED:
        lines.append(line("job created queued", Level.INFO,
                          {"from": "created", "to": "queued", "approval": data.get("approval", "not_required")}))
    lines.append(line("job queued → waiting (tasks created)", Level.INFO, {"from": "queued", "to": "waiting"}))
    for task in data["tasks"]:
        to = task.get("to", "")
        lines.append(line(f"task created {to}", creation_level([to]),
                          {"from": "created", "to": to, "task_key": task.get("task_key", "")}, UUID(task["id"])))
    return lines


def _unfold_created(event: Event) -> list[Event]:
    """Return the lines of a claim's row that carries its job's creation (a narrow start, jobs.narrow).

    ``data.created`` holds the creation's time, source and the task's key. The creation's lines come
    first, at that time and from that source, as the job's creation row would have shown them; then
    the claim's line.
    """
    created = event.data["created"]
    stamp = created.get("ts")
    when = datetime.fromisoformat(stamp) if isinstance(stamp, str) else event.ts
    # What the creation row of a one-task job, due now and needing no approval, holds (jobs.narrow).
    task = {"id": str(event.task_id), "task_key": created.get("task_key", ""), "to": "queued"}
    origin = Event(id=event.id, ts=when, job_id=event.job_id, task_id=None, attempt=None,
                   source=created.get("source") or event.source, level=Level.INFO, type=event.type, message="",
                   data={"from": CREATED, "to": "waiting", "approval": "not_required", "tasks": [task]})
    data = {k: v for k, v in event.data.items() if k != "created"}
    claim = Event(id=event.id, ts=event.ts, job_id=event.job_id, task_id=event.task_id, attempt=event.attempt,
                  source=event.source, level=event.level, type=event.type,
                  message=f"task {data.get('from', '')} → {data.get('to', '')}", data=data)
    return unfold(origin) + unfold(claim)


#: What a folded row holds besides its task's moves' own data.
_FOLDED_KEYS = ("from", "to", "via", "level", "job_before", "job")


def _unfold_moves(event: Event) -> list[Event]:
    data = event.data

    def job_line(move: dict[str, Any]) -> Event:
        return Event(id=event.id, ts=event.ts, job_id=event.job_id, task_id=None, attempt=None, source=event.source,
                     level=move.get("level", Level.INFO), type=event.type, message=job_move_message(move),
                     data={k: v for k, v in move.items() if k not in ("message", "level")})

    # The task's moves: from → each status it passed through → to; the row's other data (the attempt's
    # process id) belongs to its move into running, or to its last move.
    path = [data.get("from", ""), *[str(s) for s in data.get("via") or []], data.get("to", "")]
    extra = {k: v for k, v in data.items() if k not in _FOLDED_KEYS}
    steps = list(zip(path, path[1:], strict=False))
    with_extra = next((i for i, (_, to) in enumerate(steps) if to == "running"), len(steps) - 1)
    task_lines = [Event(id=event.id, ts=event.ts, job_id=event.job_id, task_id=event.task_id, attempt=event.attempt,
                        source=event.source, level=data.get("level", Level.INFO), type=event.type,
                        message=f"task {frm} → {to}",
                        data={"from": frm, "to": to, **(extra if i == with_extra else {})})
                  for i, (frm, to) in enumerate(steps)]
    return ([job_line(m) for m in data.get("job_before") or []] + task_lines
            + [job_line(m) for m in data.get("job") or []])
