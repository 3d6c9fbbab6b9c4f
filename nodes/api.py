"""Node presence: agents register their node and heartbeat it (AGT1)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from django.db import connection, transaction
from django.db.models.functions import Now

from accs_site.clock import db_now

from events.timeline import EventRow, write_events
from nodes.models import AwakeState, Node

VERSION = "0.1.0"
BOOT_ID = uuid.uuid4().hex[:8]


def agent_identity() -> str:
    """Return this process's identity: ``hostname:pid:boot-id``."""
    return f"{socket.gethostname()}:{os.getpid()}:{BOOT_ID}"


def register_node(name: str, *, labels: dict[str, Any], services: list[str], agent_id: str,
                  max_concurrency: dict[str, int] | None = None) -> Node:
    """Create or refresh the node row of an agent; the node is awake from now on."""
    with transaction.atomic():
        with connection.cursor() as cur:
            now = db_now(cur)
        from accs_site.conf import accs

        # A new node takes its limits from ACC_SLOT_CAP / ACC_CPU_BUDGET; afterwards the row (admin) rules.
        node, created = Node.objects.select_for_update().get_or_create(
            name=name, defaults={"labels": labels, "slot_cap": accs.slot_cap, "cpu_budget": accs.cpu_budget})
        was = node.awake_state
        node.labels = {**node.labels, **labels}
        node.services = sorted(set(node.services or []) | set(services))
        node.agent_id = agent_id
        node.version = VERSION
        node.last_seen = now
        node.awake_state = AwakeState.AWAKE
        if max_concurrency:
            node.max_concurrency = {**node.max_concurrency, **max_concurrency}
        node.save()
        if created or was != AwakeState.AWAKE:
            write_events([EventRow(type="node", message=f"node {name} {was} → awake ({agent_id})", source=f"agent:{name}",
                                   data={"node": name, "from": was, "to": "awake", "services": services})])
    return node


def touch_node(name: str, *, agent_id: str) -> tuple[str, dict[str, Any]]:
    """Heartbeat the node row; return its state and limits as the database has them now."""
    # PostgreSQL's clock: every node's last_seen is compared with the others' and with now().
    Node.objects.filter(name=name).update(last_seen=Now(), agent_id=agent_id, awake_state=AwakeState.AWAKE)
    row = Node.objects.filter(name=name).values("state", "slot_cap", "cpu_budget", "max_concurrency", "labels").first()
    return (row["state"], row) if row else ("active", {})


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
