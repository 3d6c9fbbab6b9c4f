"""A host's quarantine, set and cleared here only: the fleet's host state belongs to ``nodes``.

A quarantined host (``status = 'error'``, ``quarantined_at`` set) is out of eligibility: the claim
gives its tasks to no agent until an operator clears it. It is set when a task fails for good on
it and its service says ``quarantine_host_on_final_failure``: the failure path of ``jobs`` calls
:func:`quarantine_hosts` in its own transaction, through the function this app registers with
:func:`jobs.failure.apply.register_host_quarantine` when it is ready (``jobs`` imports nothing of
``nodes`` but its models).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import connection, transaction

from accs_site.admin_kit import ActionResult
from events.timeline import EventRow, operator_source, write_events
from jobs.failure.apply import HostFailure
from jobs.notify import notify, service_channel

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper

QUARANTINE_SQL = """
-- One statement for the batch; a host already quarantined keeps its first reason. Host rows are
-- taken in id order (nothing else locks them in a transaction that also holds task locks).
WITH v AS (SELECT DISTINCT ON (host) host, reason FROM unnest(%(hosts)s::bigint[], %(reasons)s::text[])
                                                         WITH ORDINALITY AS v(host, reason, n)
            ORDER BY host, n)
UPDATE accs_host h SET status = 'error', quarantined_at = %(now)s, quarantine_reason = v.reason
  FROM v WHERE h.id = v.host AND h.status = 'ok'
RETURNING h.id, h.name
"""


def quarantine_hosts(cur: CursorWrapper, failures: Sequence[HostFailure], *, now: datetime,
                     source: str) -> list[EventRow]:
    """Take the hosts of tasks that failed for good out of eligibility (caller's transaction); return the events."""
    if not failures:
        return []
    cur.execute(QUARANTINE_SQL, {"hosts": [f.host_id for f in failures], "reasons": [f.reason for f in failures],
                                 "now": now})
    names = dict(cur.fetchall())
    events, seen = [], set()
    for f in failures:
        if f.host_id in names and f.host_id not in seen:
            seen.add(f.host_id)
            name = names[f.host_id]
            events.append(EventRow(type="status", level="error", job_id=f.job_id, task_id=f.task_id, source=source,
                                   message=f"host {name} ok → error (quarantined)", data={"host": name, "to": "error"}))
    return events


def clear_quarantine(host_id: int, *, by: str = "") -> ActionResult:
    """Make a quarantined host eligible again and wake the services with tasks waiting on it."""
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_host SET status = 'ok', quarantined_at = NULL, quarantine_reason = ''"
                    " WHERE id = %s AND status = 'error' RETURNING name", [host_id])
        row = cur.fetchone()
        if not row:
            return ActionResult(False, "host is not quarantined")
        write_events([EventRow(type="status", message=f"host {row[0]} error → ok (quarantine cleared by {by or 'api'})",
                               source=operator_source(by), data={"host": row[0], "to": "ok"})], cursor=cur)
        cur.execute("SELECT DISTINCT s.key FROM accs_task t JOIN accs_service s ON s.id = t.service_id"
                    " WHERE t.host_id = %s AND t.status = 'queued'", [host_id])
        notify(cur, [service_channel(r[0]) for r in cur.fetchall()])
    return ActionResult(True, f"host {row[0]} is eligible again")
