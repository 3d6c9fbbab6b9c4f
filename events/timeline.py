"""Writing the timeline. Events are rows of ``accs_event``; every status change writes one in the
transaction that makes the change (callers pass their cursor)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from django.db import connection


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
