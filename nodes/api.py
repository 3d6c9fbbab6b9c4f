"""Node presence: agents register their node, heartbeat it and sign off; the builder marks the
silent ones lost; operators retire the ones that never ran anything."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from django.db import connection, transaction

from accs_site.clock import db_now
from accs_site.conf import accs
from accs_site.version import VERSION
from events.timeline import EventRow, operator_source, write_events
from nodes.models import AwakeState, Node, NodeDeploy, Presence

BOOT_ID = uuid.uuid4().hex[:8]


def agent_identity() -> str:
    """Return this process's identity: ``hostname:pid:boot-id``."""
    return f"{socket.gethostname()}:{os.getpid()}:{BOOT_ID}"


def register_node(name: str, *, labels: dict[str, Any], services: list[str], agent_id: str,
                  max_concurrency: dict[str, int] | None = None, version: str = VERSION) -> Node:
    """Create or refresh the node row of an agent running ``version``; the node is awake from now on.
    A node that last reported another release gets one deploy row, in this transaction."""
    with transaction.atomic():
        with connection.cursor() as cur:
            now = db_now(cur)

        # A new node takes its limits from ACC_SLOT_CAP / ACC_CPU_BUDGET; afterwards the row (admin) rules.
        node, created = Node.objects.select_for_update().get_or_create(
            name=name, defaults={"labels": labels, "slot_cap": accs.slot_cap, "cpu_budget": accs.cpu_budget})
        was = node.awake_state
        was_presence = node.presence
        if not created and node.version != version:
            NodeDeploy.objects.create(node_name=name, version=version, previous_version=node.version,
                                      agent_id=agent_id, started_at=now)
        node.presence = Presence.ONLINE
        node.labels = {**node.labels, **labels}
        node.services = sorted(set(node.services or []) | set(services))
        node.agent_id = agent_id
        node.version = version
        node.last_seen = now
        node.awake_state = AwakeState.AWAKE
        if max_concurrency:
            node.max_concurrency = {**node.max_concurrency, **max_concurrency}
        node.save()
        if created or was != AwakeState.AWAKE:
            write_events([EventRow(type="node", message=f"node {name} {was} → awake ({agent_id})",
                                   source=f"agent:{name}",
                                   data={"node": name, "from": was, "to": "awake", "services": services})])
        if not created and was_presence != Presence.ONLINE:
            write_events([_presence_event(name, was_presence, Presence.ONLINE, f"agent {agent_id} started")])
    return node


def _presence_event(name: str, frm: str, to: str, why: str, *, source: str = "") -> EventRow:
    return EventRow(type="node", message=f"node {name} {frm} → {to} ({why})", source=source or f"agent:{name}",
                    level="info" if to == Presence.ONLINE else "warn", data={"node": name, "from": frm, "to": to})


TOUCH_SQL = """
-- PostgreSQL's clock: every node's last_seen is compared with the others' and with now().
WITH o AS (SELECT name, presence FROM accs_node WHERE name = %(name)s FOR NO KEY UPDATE)
UPDATE accs_node n SET last_seen = now(), agent_id = %(agent)s, awake_state = 'awake', presence = 'online'
  FROM o WHERE n.name = o.name
RETURNING o.presence, n.state, n.slot_cap, n.cpu_budget, n.max_concurrency, n.labels
"""


def touch_node(name: str, *, agent_id: str) -> tuple[str, dict[str, Any]]:
    """Heartbeat the node row (it is online again if it was not); return its state and limits."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(TOUCH_SQL, {"name": name, "agent": agent_id})
        row = cur.fetchone()
        if row is None:
            return "active", {}
        was, state, slot_cap, cpu_budget, max_concurrency, labels = row
        if was != Presence.ONLINE:
            write_events([_presence_event(name, was, Presence.ONLINE, f"heartbeat from {agent_id}")], cursor=cur)
    return state, {"state": state, "slot_cap": slot_cap, "cpu_budget": cpu_budget,
                   "max_concurrency": _json(max_concurrency), "labels": _json(labels)}


def _json(value: Any) -> Any:
    import json

    return json.loads(value) if isinstance(value, str) else value


def sign_off(name: str, *, agent_id: str) -> bool:
    """Mark the node offline when its agent stops cleanly; False if another agent touched it since."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("UPDATE accs_node SET presence = 'offline' WHERE name = %s AND agent_id = %s"
                    " AND presence = 'online' RETURNING name", [name, agent_id])
        if cur.fetchone() is None:
            return False
        write_events([_presence_event(name, Presence.ONLINE, Presence.OFFLINE, f"agent {agent_id} stopped")],
                     cursor=cur)
    return True


MARK_LOST_SQL = """
-- Online nodes whose last heartbeat is older than the limit, on PostgreSQL's clock; picked once
-- (MATERIALIZED), so no plan rescans the pick and takes more than the limit.
WITH picked AS MATERIALIZED (
    SELECT name FROM accs_node WHERE presence = 'online'
       AND (last_seen IS NULL OR last_seen < now() - make_interval(secs => %(after)s))
     ORDER BY name LIMIT %(limit)s FOR NO KEY UPDATE SKIP LOCKED
), lost AS (
    UPDATE accs_node n SET presence = 'lost' FROM picked p WHERE n.name = p.name
    RETURNING n.name, n.last_seen
)
SELECT name, extract(epoch FROM now() - last_seen) FROM lost
"""


#: How often a live agent touches its node row at least: at every pass of its loop, no more often than
#: this (the agent's NODE_REFRESH_SECONDS), and an idle pass ends within its poll interval (+20 % jitter).
NODE_TOUCH_SECONDS = 2.0
#: Heartbeats a node may miss before operators see it as suspect.
SUSPECT_AFTER_BEATS = 3
#: Never suspect sooner: one pass of an agent's loop may stall a few seconds on a busy database.
SUSPECT_FLOOR_SECONDS = 15.0


def heartbeat_every_seconds() -> float:
    """Return the interval between a live agent's touches of its node row (its heartbeat)."""
    return max(NODE_TOUCH_SECONDS, accs.poll_interval_sec * 1.2)


def stale_after_seconds() -> float:
    """Return how old a node's last heartbeat may be before the node is suspect: a few missed heartbeats.

    Seconds, not ``ACC_NODE_LOST_AFTER_SEC`` (after which the builder marks it lost) nor a task lease:
    an agent touches its node every pass, so a silence of three intervals means a dead or cut-off agent.
    """
    return max(SUSPECT_AFTER_BEATS * heartbeat_every_seconds(), SUSPECT_FLOOR_SECONDS)


def mark_lost(*, after_seconds: float, limit: int = 1000) -> list[str]:
    """Mark online nodes without a heartbeat for ``after_seconds`` lost, with events; return their names."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(MARK_LOST_SQL, {"after": float(after_seconds), "limit": limit})
        rows = cur.fetchall()
        write_events([_presence_event(name, Presence.ONLINE, Presence.LOST,
                                      "never heard from" if ago is None else f"no heartbeat for {float(ago):.0f}s",
                                      source="builder") for name, ago in rows], cursor=cur)
    return [r[0] for r in rows]


def retire_nodes(names: list[str], *, by: str = "") -> tuple[list[str], dict[str, str]]:
    """Delete nodes that are not online and never held a task (a typo, a one-off test agent).

    Return (retired, refused with the reason). Nodes with history stay: their tasks, attempts
    and hosts name them.
    """
    retired: list[str] = []
    refused: dict[str, str] = {}
    with transaction.atomic(), connection.cursor() as cur:
        for name in sorted(set(names)):
            cur.execute("SELECT presence FROM accs_node WHERE name = %s FOR UPDATE", [name])
            row = cur.fetchone()
            if row is None:
                refused[name] = "no such node"
                continue
            if row[0] == Presence.ONLINE:
                refused[name] = "it is online (stop its agent first)"
                continue
            cur.execute("SELECT EXISTS (SELECT 1 FROM accs_attempt WHERE node = %s)"
                        " OR EXISTS (SELECT 1 FROM accs_task WHERE node = %s OR assigned_node = %s)"
                        " OR EXISTS (SELECT 1 FROM accs_host WHERE node_id = %s)", [name, name, name, name])
            if cur.fetchone()[0]:
                refused[name] = "it has run tasks or has hosts; its history keeps it"
                continue
            Node.objects.filter(name=name).delete()  # its disk samples go with it
            retired.append(name)
        write_events([EventRow(type="node", message=f"node {name} retired (by {by or 'api'})", level="warn",
                               source=operator_source(by), data={"node": name, "to": "retired"})
                      for name in retired], cursor=cur)
    return retired, refused


HELD_ATTEMPTS_SQL = """
-- Held tasks are few and served by the partial index on starting/running tasks; their current
-- attempt row holds the pid of the process group the agent started.
SELECT a.pid, t.id::text, a.agent_id
  FROM accs_task t JOIN accs_attempt a ON a.task_id = t.id AND a.attempt_no = t.attempt
 WHERE t.status IN ('starting', 'running') AND t.node = %s AND a.status = 'running' AND a.pid IS NOT NULL
"""


def held_attempt_processes(name: str) -> list[tuple[int, str, str]]:
    """Return (pid, task id, agent id) of the unfinished attempts recorded for node ``name``."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(HELD_ATTEMPTS_SQL, [name])
        return [(int(pid), task_id, agent_id) for pid, task_id, agent_id in cur.fetchall()]
