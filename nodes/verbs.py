"""Operators' verbs on the fleet: drain and undrain a node, clear a host's quarantine.

A draining node's agents claim nothing new and finish what they hold; the agent reads the
node's state at each heartbeat. A quarantined host is out of eligibility until cleared; its
quarantine is set and cleared in :mod:`nodes.quarantine`, whose ``clear_quarantine`` is offered here.
"""

from __future__ import annotations

from django.db import connection, transaction

from accs_site.admin_kit import ActionResult
from events.timeline import EventRow, operator_source, write_events
from nodes.quarantine import clear_quarantine

__all__ = ["clear_quarantine", "drain_node", "undrain_node"]


def _set_node_state(name: str, *, to: str, by: str) -> ActionResult:
    frm = "draining" if to == "active" else "active"
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute("UPDATE accs_node SET state = %s WHERE name = %s AND state = %s RETURNING name", [to, name, frm])
        if not cur.fetchone():
            cur.execute("SELECT state FROM accs_node WHERE name = %s", [name])
            row = cur.fetchone()
            return ActionResult(False, f"node {name} is {row[0]}; nothing to do" if row else f"no node {name!r}")
        write_events([EventRow(type="node", message=f"node {name} {frm} → {to} (by {by or 'api'})",
                               source=operator_source(by), level="warn" if to == "draining" else "info",
                               data={"node": name, "from": frm, "to": to})], cursor=cur)
    return ActionResult(True, f"node {name} is {to}" + (": it claims nothing new" if to == "draining" else ""))


def drain_node(name: str, *, by: str = "") -> ActionResult:
    """Stop a node from claiming new tasks; its running tasks finish normally."""
    return _set_node_state(name, to="draining", by=by)


def undrain_node(name: str, *, by: str = "") -> ActionResult:
    """Let a draining node claim tasks again."""
    return _set_node_state(name, to="active", by=by)
