"""Archive event partitions older than the retention period to object storage, then drop them."""

from __future__ import annotations

from django.db import connection

from events.partitions import archive_partitions
from jobs.duties import Duty


def archive(limit: int) -> int:
    # Exporting a month of events can take longer than the daemons' statement timeout allows.
    with connection.cursor() as cur:
        cur.execute("SET statement_timeout = 0")
    try:
        return len(archive_partitions(limit=limit))
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET statement_timeout")


def duty() -> Duty:
    return Duty("archive_event_partitions", every=3600.0, limit=1, run=archive)
