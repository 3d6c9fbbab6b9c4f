"""Which releases the fleet runs: the daemons seen lately whose release is not this code's.

Agents write their release on their node row when they register; the leading builder's lease
holder carries its release (:func:`jobs.leader.default_holder`). The previous release's builders
wrote none, so a holder without one counts as another release. A builder that does not lead
writes nothing to the database: its start-up log line names its release.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from accs_site.conf import accs
from accs_site.version import VERSION
from jobs.leader import LEASE_NAME, holder_version

# Nodes heartbeat every third of ACC_HEARTBEAT_TTL_SEC; one seen within ACC_NODE_LOST_AFTER_SEC still runs.
NODES_SQL = """
SELECT name, version FROM accs_node
 WHERE presence = 'online' AND last_seen > now() - make_interval(secs => %(recent)s)
   AND version IS DISTINCT FROM %(version)s
 ORDER BY name
"""
LEADER_SQL = "SELECT holder FROM accs_leader WHERE name = %(name)s AND expires_at > now()"


@dataclass(frozen=True)
class Daemon:
    """A running daemon of another release: what it is, its name, its release ("" when it wrote none)."""

    kind: str
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.version or 'no release: 0.1.0 or older'})"


def other_release_daemons() -> list[Daemon]:
    """Return the agents seen lately and the leading builder whose release is not :data:`VERSION`."""
    recent = float(accs.node_lost_after_sec)
    with connection.cursor() as cur:
        cur.execute(NODES_SQL, {"recent": recent, "version": VERSION})
        found = [Daemon(kind="agent", name=name, version=version or "") for name, version in cur.fetchall()]
        cur.execute(LEADER_SQL, {"name": LEASE_NAME})
        row = cur.fetchone()
    if row is not None and holder_version(row[0]) != VERSION:
        holder = row[0]
        found.append(Daemon(kind="builder", name=holder.split(" ")[0], version=holder_version(holder)))
    return found
