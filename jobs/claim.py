"""Claiming tasks (CLM1-CLM4): the SQL that must be exact.

One statement claims up to ``n`` queued tasks of one service with ``FOR UPDATE SKIP LOCKED`` in
the global order (priority DESC, order_seq, created_at, id), moves them to ``starting`` with a
lease and attempt + 1, opens their Attempt rows and writes their events.

``n`` is the smallest room left under every limit of CLM3, computed in the same transaction
under advisory locks so that two agents cannot both take the last slot:

* per node per service (``Node.max_concurrency`` / ``ACC_MAX_CONCURRENCY_<SERVICE>``),
* node slot cap = min(``Node.slot_cap``, eligible hosts of the node) when the node has hosts,
* node CPU-weight budget (sum of the held tasks' ``cpu_weight``),
* per service global ``max_concurrent`` (lock per service),
* one held task per host for exclusive services (also a partial unique index),
* the agent's own free slots.

Workflow ``max_active_jobs`` and tenant ``max_in_flight`` are admission limits on jobs, enforced
where jobs start (:func:`jobs.transitions.start_due_jobs`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection, transaction
from django.utils import timezone

from jobs.sql import from_json


@dataclass(frozen=True)
class ServiceSpec:
    """What the claim needs to know about a service."""

    id: int
    key: str
    cpu_weight: int
    max_concurrent: int
    exclusive: bool


@dataclass(frozen=True)
class NodeLimits:
    """A node's limits, as the agent read them from its Node row and environment."""

    name: str
    slot_cap: int
    cpu_budget: int
    per_service: dict[str, int]


@dataclass(frozen=True)
class ClaimedTask:
    id: UUID
    job_id: UUID
    task_key: str
    attempt: int
    params: dict[str, Any]
    timeout_seconds: int
    host: str | None
    service_key: str


CLAIM_SQL = """
WITH cand AS (
    -- Served by task_claim_idx (service_id, priority DESC, order_seq, created_at, id) WHERE queued:
    -- the scan stops after n rows that pass the filters. SKIP LOCKED: concurrent claimers never wait
    -- for each other and never take the same row.
    SELECT t.id, t.host_id, t.exclusive, t.priority, t.order_seq, t.created_at
      FROM accs_task t
     WHERE t.service_id = %(svc)s AND t.status = 'queued' AND t.next_attempt_at <= %(now)s
       AND (t.host_id IS NULL OR t.host_id = ANY(%(hosts)s))
       -- Tasks this agent still runs (an older attempt it has not finished) are never claimed by
       -- it again: its own late finish would otherwise race the new attempt.
       AND t.id <> ALL(%(exclude)s::uuid[])
     ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
     LIMIT %(n)s
       FOR UPDATE SKIP LOCKED
), pick AS (
    -- An exclusive service gets at most one task per host per claim.
    SELECT id FROM (
        SELECT id, host_id, exclusive,
               row_number() OVER (PARTITION BY host_id ORDER BY priority DESC, order_seq, created_at, id) AS rn
          FROM cand) c
     WHERE NOT exclusive OR host_id IS NULL OR rn = 1
), upd AS (
    UPDATE accs_task t
       SET status = 'starting', attempt = t.attempt + 1, claimed_by = %(agent)s, node = %(node)s,
           claimed_at = %(now)s, lease_expires_at = %(lease)s, heartbeat_at = %(now)s, updated_at = %(now)s,
           cancel_requested_at = NULL, started_at = NULL
      FROM pick WHERE t.id = pick.id
    RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.priority,
              t.order_seq, t.created_at
), att AS (
    INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                              stderr_tail, error_text)
    SELECT id, attempt, %(node)s, %(agent)s, %(pid)s, 'running', %(now)s, '', '', '' FROM upd
), ev AS (
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT %(now)s, job_id, id, attempt, %(source)s, 'info', 'status', 'task queued → starting',
           jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', %(agent)s::text) FROM upd
)
SELECT upd.id, upd.job_id, upd.task_key, upd.attempt, upd.params, upd.timeout_seconds, h.name
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id
"""

HELD_SQL = """
-- Held tasks on this node and of this service: read through task_held_service_idx, a partial
-- index holding only starting/running tasks, so the cost follows the running work, not the table.
SELECT count(*) FILTER (WHERE t.node = %(node)s),
       coalesce(sum(s.cpu_weight) FILTER (WHERE t.node = %(node)s), 0),
       count(*) FILTER (WHERE t.node = %(node)s AND t.service_id = %(svc)s),
       count(*) FILTER (WHERE t.service_id = %(svc)s)
  FROM accs_task t JOIN accs_service s ON s.id = t.service_id
 WHERE t.status IN ('starting', 'running') AND (t.node = %(node)s OR t.service_id = %(svc)s)
"""


@dataclass(frozen=True)
class Room:
    """How many tasks each limit still allows; ``n`` is the smallest."""

    n: int
    reasons: dict[str, int]


def room_for(cur, service: ServiceSpec, limits: NodeLimits, *, free_slots: int, eligible_hosts: int,
             node_has_hosts: bool) -> Room:
    """Compute the claimable room under every CLM3 limit (caller holds the locks)."""
    cur.execute(HELD_SQL, {"node": limits.name, "svc": service.id})
    node_held, node_cpu, node_svc_held, svc_held = cur.fetchone()
    reasons = {"agent_free_slots": free_slots}
    slot_cap = min(limits.slot_cap, eligible_hosts) if node_has_hosts else limits.slot_cap
    reasons["node_slot_cap"] = slot_cap - node_held
    reasons["node_cpu_budget"] = (limits.cpu_budget - int(node_cpu)) // max(service.cpu_weight, 1)
    per_service = limits.per_service.get(service.key)
    if per_service is not None and per_service > 0:
        reasons["node_service_cap"] = per_service - node_svc_held
    if service.max_concurrent > 0:
        reasons["service_global_max"] = service.max_concurrent - svc_held
    return Room(max(0, min(reasons.values())), reasons)


def claim(service: ServiceSpec, limits: NodeLimits, *, agent_id: str, free_slots: int, lease_seconds: float,
          pid: int | None = None, now: datetime | None = None, blocked_hosts: frozenset[int] = frozenset(),
          exclude: Collection[UUID] = ()) -> list[ClaimedTask]:
    """Claim up to the room left under every limit; one short transaction, no lock held afterwards.

    ``exclude`` names tasks the agent is still running (any attempt): they are never claimed again.
    """
    if free_slots <= 0:
        return []
    now = now or timezone.now()
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        # Serialise claimers that share a limit: agents of this node, and every claimer of a
        # service with a global cap. Transaction-scoped, released at commit.
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:node:{limits.name}"])
        if service.max_concurrent > 0:
            cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{service.id}"])
        cur.execute("SELECT id, status FROM accs_host WHERE node_id = %s", [limits.name])
        node_hosts = cur.fetchall()
        eligible = [h for h, status in node_hosts if status == "ok" and h not in blocked_hosts]
        if service.exclusive and eligible:
            cur.execute("SELECT host_id FROM accs_task WHERE exclusive AND status IN ('starting', 'running')"
                        " AND host_id = ANY(%s)", [eligible])
            busy = {r[0] for r in cur.fetchall()}
            claimable_hosts = [h for h in eligible if h not in busy]
        else:
            claimable_hosts = eligible
        room = room_for(cur, service, limits, free_slots=free_slots,
                        eligible_hosts=len([h for h, s in node_hosts if s == "ok"]), node_has_hosts=bool(node_hosts))
        if room.n <= 0:
            return []
        cur.execute(CLAIM_SQL, {
            "svc": service.id, "now": now, "hosts": claimable_hosts, "n": room.n, "agent": agent_id,
            "node": limits.name, "lease": now + timedelta(seconds=lease_seconds), "pid": pid,
            "source": f"agent:{limits.name}", "exclude": [str(t) for t in exclude],
        })
        return [ClaimedTask(*row[:4], from_json(row[4]) or {}, row[5], host=row[6], service_key=service.key)
                for row in cur.fetchall()]
