"""Archive event partitions older than the retention period to object storage, then drop them."""

from __future__ import annotations

from django.db import connection

from events.partitions import archive_partitions
from jobs.duties.base import Duty


def archive(limit: int) -> int:
    # Exporting a month of events can take longer than the daemons' statement timeout allows.
    # SET LOCAL: the builder runs each duty in a transaction fenced by the leader's term, and a
    # session-level SET would outlive it on a pooled server session.
    with connection.cursor() as cur:
        cur.execute("SET LOCAL statement_timeout = 0")
        cur.execute("SET LOCAL idle_in_transaction_session_timeout = 0")  # uploads run inside it
    return len(archive_partitions(limit=limit))


def duty() -> Duty:
    return Duty("archive_event_partitions", every=3600.0, limit=1, run=archive)
