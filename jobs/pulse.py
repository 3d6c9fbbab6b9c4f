"""The cluster's pulse: the engine's own record of when PostgreSQL was out of its reach.

Every builder stamps one row (``accs_cluster_pulse``) each tick with PostgreSQL's clock. A stamp
records an outage (``accs_outage``: from the previous stamp to this one) when

* the previous stamp is older than the gap (:data:`GAP_SECONDS`, or three of the builder's ticks
  if longer): no builder reached the database meanwhile, whatever the reason — a stop, a crash
  restart with a long recovery, a failover to a standby, a network cut, a pooler restart; or
* PostgreSQL restarted since the previous stamp, however briefly (:data:`RESTARTED_AT_SQL`: its
  start time, or the time a crash restart reset the server's shared statistics, which the
  postmaster's start time does not show).

The signal is written by the engine on the server it is talking to, so it holds behind a pooler
and across a promotion (the stamps are replicated: the promoted standby's first stamp finds the
last one older than the gap, when the failover took longer than the gap, as any failover that
can cost a lease does). A time when no builder ran at all reads as an outage too: nothing could have
rescued a lease then either. :mod:`jobs.rescue` and the failure policy read the outages.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection, transaction

PULSE_NAME = "cluster"
GAP_SECONDS = 5.0

# When PostgreSQL last (re)started: a stop and start moves pg_postmaster_start_time(); a crash
# restart (a backend killed, the postmaster reinitialising every backend) does not, but it resets
# the shared statistics, whose reset time says when (PostgreSQL 15 and later).
RESTARTED_AT_SQL = "greatest(pg_postmaster_start_time(), (SELECT stats_reset FROM pg_stat_bgwriter))"


def outage_words(*, began_at: datetime, ended_at: datetime) -> str:
    """Say how long a recorded outage lasted, as a daemon logs it: ``database reachable again after 50.5 s``
    (from the last stamp before it to the first after it)."""
    return f"database reachable again after {(ended_at - began_at).total_seconds():.1f} s"


def stamp(*, gap_seconds: float = GAP_SECONDS) -> datetime | None:
    """Stamp the pulse; record an outage when the last stamp is older than ``gap_seconds`` or
    PostgreSQL restarted since. Return the outage's start when one was recorded, else None."""
    if gap_seconds <= 0:
        raise ValueError(f"gap_seconds must be positive, got {gap_seconds}")
    with transaction.atomic(), connection.cursor() as cur:
        # The row lock orders concurrent stampers: the second one sees the first one's stamp.
        cur.execute("SELECT seen_at FROM accs_cluster_pulse WHERE name = %s FOR UPDATE", [PULSE_NAME])
        row = cur.fetchone()
        cur.execute(f"SELECT clock_timestamp(), {RESTARTED_AT_SQL}")
        now, restarted_at = cur.fetchone()
        if row is None:
            # The first stamp of a site: nothing to compare with.
            cur.execute("INSERT INTO accs_cluster_pulse (name, seen_at) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
                        [PULSE_NAME, now])
            return None
        seen_at = row[0]
        cause = ("restart" if restarted_at is not None and restarted_at > seen_at
                 else "gap" if (now - seen_at).total_seconds() > gap_seconds else None)
        if cause:
            cur.execute("INSERT INTO accs_outage (began_at, ended_at, cause) VALUES (%s, %s, %s)",
                        [seen_at, now, cause])
        cur.execute("UPDATE accs_cluster_pulse SET seen_at = %s WHERE name = %s", [now, PULSE_NAME])
        return seen_at if cause else None
