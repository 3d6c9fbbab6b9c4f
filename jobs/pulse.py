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

from django.db import connection

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


# One statement, so that the pulse row is locked only while the server runs it: a builder frozen
# (stopped, swapped out, starved of CPU) between two statements of a transaction would hold the row,
# and every other builder's tick would wait behind it until the server ended that transaction (a
# minute), holding off a takeover of the leader's lease for as long. The row lock still orders
# concurrent stampers: the second one waits for the first one's commit and compares with its stamp;
# its clock is read after the lock (in ``verdict``, from the locked row).
STAMP_SQL = f"""
WITH prev AS (
    SELECT seen_at FROM accs_cluster_pulse WHERE name = %(name)s FOR UPDATE
), verdict AS MATERIALIZED (
    SELECT seen_at, clock_timestamp() AS now, {RESTARTED_AT_SQL} AS restarted_at FROM prev
), outage AS (
    INSERT INTO accs_outage (began_at, ended_at, cause)
    SELECT seen_at, now, CASE WHEN restarted_at > seen_at THEN 'restart' ELSE 'gap' END FROM verdict
     WHERE restarted_at > seen_at OR now - seen_at > %(gap)s * interval '1 second'
    RETURNING began_at
), stamped AS (
    UPDATE accs_cluster_pulse p SET seen_at = v.now FROM verdict v WHERE p.name = %(name)s
), first AS (
    -- The first stamp of a site: nothing to compare with.
    INSERT INTO accs_cluster_pulse (name, seen_at)
    SELECT %(name)s, clock_timestamp() WHERE NOT EXISTS (SELECT 1 FROM prev)
    ON CONFLICT (name) DO NOTHING
)
SELECT (SELECT began_at FROM outage)
"""


def stamp(*, gap_seconds: float = GAP_SECONDS) -> datetime | None:
    """Stamp the pulse; record an outage when the last stamp is older than ``gap_seconds`` or
    PostgreSQL restarted since. Return the outage's start when one was recorded, else None.

    One statement (:data:`STAMP_SQL`); outside a transaction it commits by itself.
    """
    if gap_seconds <= 0:
        raise ValueError(f"gap_seconds must be positive, got {gap_seconds}")
    with connection.cursor() as cur:
        cur.execute(STAMP_SQL, {"name": PULSE_NAME, "gap": gap_seconds})
        return cur.fetchone()[0]
