"""Claiming tasks: the SQL that must be exact.

One statement claims, across all the services an agent serves, up to the room left under every
limit, with ``FOR UPDATE SKIP LOCKED`` in the one global order (priority DESC, order_seq,
created_at, id; a governor condition may shift a service's priority). It moves the tasks to
``starting`` with a lease and attempt + 1 on PostgreSQL's clock, opens their Attempt rows and
writes their events.

The room is computed in the same transaction, under advisory locks, so two agents cannot both
take the last slot:

* per node per service (``Node.max_concurrency`` / ``ACC_MAX_CONCURRENCY_<SERVICE>``),
* node slot cap = min(``Node.slot_cap``, eligible hosts of the node) when the node has hosts,
* node CPU-weight budget (sum of the held tasks' ``cpu_weight``),
* per service global ``max_concurrent`` (lock per capped service),
* the agent's own free slots.

Decided on the task row, in SQL: a host-bound task is claimable only by its host's node, while
the host is eligible; an exclusive task only while no other exclusive task is held on its host
(and at most one per host per claim; a partial unique index is the backstop). A service whose
``required_labels`` the node lacks is not claimed at all. Tasks the agent still runs are never
claimed by it again.

A tenant an operator paused (:func:`workflows.governor.pause_tenant`) is left out by the statement
itself, so every claimer honours the pause.

Tenants take turns at equal priority: the scan reads each tenant's head of a service's queue, and
the order is priority, then turn (each tenant's first task, then each one's second...), then the
tenant served least recently, then ``order_seq`` (see the parts marked "Tenant fairness").

Workflow ``max_active_jobs`` and tenant ``max_in_flight`` limit jobs, not tasks: see
:mod:`jobs.admission`.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import DatabaseError, connection, transaction

from jobs import limit_keys
from jobs.locks import ADVISORY_LOCKS_SQL, LOCK_WAIT_SQL, TRY_ADVISORY_LOCK_SQL, is_lock_timeout, lock_wait_ms
from jobs.narrow import CREATIONS_SQL, WIDEN_FUNCTION
from jobs.notify import service_channel
from jobs.reports import PROMOTE_DUE_SQL
from jobs.sql import bind_params, from_json
from workflows.governor import PAUSED_TENANTS_SQL

log = logging.getLogger("accs.claim")


@dataclass(frozen=True)
class ServiceSpec:
    """What the claim needs to know about a service."""

    id: int
    key: str
    cpu_weight: int
    max_concurrent: int
    exclusive: bool
    required_labels: Mapping[str, Any] = field(default_factory=dict)
    rate_limit: int = 0
    rate_period: int = 60
    rate_key: str = ""
    rate_key_limit: int = 0
    concurrency_key: str = ""
    concurrency_key_limit: int = 0
    lease_seconds: int | None = None  # None: the claimer's default lease

    @property
    def keyed(self) -> bool:
        """Whether a limit applies per value of a params key."""
        return self.rate_key_limit > 0 or self.concurrency_key_limit > 0

    @property
    def rated(self) -> bool:
        """Whether its starts count against a rate limit (service-wide or per key)."""
        return self.rate_limit > 0 or self.rate_key_limit > 0

    @property
    def fleet_limited(self) -> bool:
        """Whether every claimer in the fleet shares a limit of it (a cap, a rate, a per-key cap)."""
        return self.max_concurrent > 0 or self.rated or self.keyed


def service_spec(service) -> ServiceSpec:
    """Return what the claim needs to know about a ``workflows.models.Service``."""
    return ServiceSpec(service.id, service.key, service.cpu_weight, service.max_concurrent,
                       service.exclusive_per_host, dict(service.required_labels or {}),
                       rate_limit=service.rate_limit, rate_period=service.rate_period_seconds,
                       rate_key=service.rate_key, rate_key_limit=service.rate_key_limit,
                       concurrency_key=service.concurrency_key, concurrency_key_limit=service.concurrency_key_limit,
                       lease_seconds=service.lease_seconds)


@dataclass(frozen=True)
class NodeLimits:
    """A node's limits and labels, as the agent read them from its Node row and environment."""

    name: str
    slot_cap: int
    cpu_budget: int
    per_service: dict[str, int]
    labels: Mapping[str, Any] = field(default_factory=dict)


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
    lease_seconds: float = 0.0  # the lease the claim granted (its service's, else the claimer's)


# The claim statement, built from parts: services with a per-key limit need the key filters, and
# services with a rate limit record their starts; a claim that involves neither runs the plain
# statement, whose cost is what the hot path was measured with.
#
# Its instant ({stamp}) is statement_timestamp(), not now(): the statement runs after the service
# and node locks are held, while now() is the transaction's start, earlier by however long the
# claim waited for those locks. Starts are stamped and counted at the instant they really happen,
# so no more than a rate limit's starts land in any real window.
STAMP_SQL = "coalesce(%(now)s::timestamptz, statement_timestamp())"

_CLAIM_HEAD = """
WITH RECURSIVE svc AS (
    -- (A key path as an array once, not once per task a scan passes over.)
    SELECT s.*, string_to_array(s.rpath, '.') AS rparts, string_to_array(s.cpath, '.') AS cparts
      FROM unnest(%(svc_ids)s::bigint[], %(rooms)s::int[], %(weights)s::int[], %(adjust)s::int[],
                         %(scans)s::int[], %(rpaths)s::text[], %(rlimits)s::int[], %(cpaths)s::text[],
                         %(climits)s::int[], %(periods)s::int[], %(rated)s::bool[])
             AS s(id, room, weight, adjust, scan, rpath, rlimit, cpath, climit, period, rated)
){keyed_ctes}, tenant_heads AS (
    -- Tenant fairness, part 1: the tenants with queued work of each service, by a skip scan of
    -- task_claim_idx (one index descent per tenant), so the scan below reads each tenant's head
    -- and a tenant with thousands of tasks at the top of the order cannot hide another's behind them.
    SELECT svc.id AS service_id, (SELECT t.tenant_id FROM accs_task t
                                   WHERE t.service_id = svc.id AND t.status = 'queued' AND t.host_id IS NULL
                                   ORDER BY t.tenant_id LIMIT 1) AS tenant_id
      FROM svc
    UNION ALL
    SELECT q.service_id, (SELECT t.tenant_id FROM accs_task t
                           WHERE t.service_id = q.service_id AND t.status = 'queued' AND t.host_id IS NULL
                             AND t.tenant_id > q.tenant_id
                           ORDER BY t.tenant_id LIMIT 1)
      FROM tenant_heads q WHERE q.tenant_id IS NOT NULL
), paused_tenants AS MATERIALIZED (
    -- The tenants an operator paused (workflows.governor.pause_tenant): their queued tasks are passed
    -- over. Left out here, after the skip scan, a paused tenant's backlog bound to no host costs the
    -- claim its one index descent, never a walk through its tasks; the host scan below (by host, not
    -- tenant) passes over its tasks bound to this node's hosts one by one.
    {paused}
), queued_tenants AS (
    SELECT q.service_id, q.tenant_id FROM tenant_heads q
     WHERE q.tenant_id IS NOT NULL AND q.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
){free}), bound_seen AS (
    -- Tasks bound to this node's eligible hosts, per host and service: task_claim_host_idx. Other
    -- nodes' host-bound work is never scanned. Read without locks: a node with many hosts (a
    -- 1,000-host fan-out) would otherwise lock every host's head at each claim to take a few.
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM svc CROSS JOIN unnest(%(hosts)s::bigint[]) AS h(id) CROSS JOIN LATERAL (
        SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
               t.created_at{bound_key_cols}
          FROM accs_task t
         WHERE t.host_id = h.id AND t.service_id = svc.id AND t.status = 'queued'
           AND t.next_attempt_at <= {stamp}
           AND t.tenant_id::text NOT IN (SELECT * FROM paused_tenants)
           AND t.id <> ALL(%(exclude)s::uuid[]){bound_key_filter}
           -- Exclusive work: not while another exclusive task is held on the host (served by
           -- the partial unique index task_one_held_per_exclusive_host).
           AND NOT (t.exclusive AND EXISTS (SELECT 1 FROM accs_task x WHERE x.host_id = t.host_id AND x.exclusive
                                               AND x.status IN ('starting', 'running')))
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT svc.scan) c
), bound AS (
    -- Of those, each service's and tenant's first, as many as the service's scan (what the scan of
    -- unbound tasks reads of each tenant's queue), locked by id: SKIP LOCKED, and still queued once
    -- locked (a row another claimer took since it was read is passed over).
    SELECT b.* FROM bound_seen b JOIN (
        SELECT t.id FROM accs_task t
         WHERE t.id = ANY(ARRAY(SELECT r.id
                                  FROM (SELECT s.id, s.service_id,
                                               row_number() OVER (PARTITION BY s.service_id, s.tenant_id
                                                                  ORDER BY s.priority DESC, s.order_seq, s.created_at,
                                                                           s.id) AS nth
                                          FROM bound_seen s) r JOIN svc ON svc.id = r.service_id
                                 WHERE r.nth <= svc.scan))
           AND t.status = 'queued'
         ORDER BY t.id
           FOR UPDATE OF t SKIP LOCKED) l ON l.id = b.id
), cand AS (
    SELECT * FROM free UNION ALL SELECT * FROM bound
){keyed_pick}, turns AS (
    -- Tenant fairness, part 2: at equal priority the tenants take turns (each one's first task,
    -- then each one's second...), and within a turn the tenant served least recently goes first.
    SELECT src.*, tn.served_at, svc.room,
           row_number() OVER (PARTITION BY src.tenant_id, src.eff_priority
                              ORDER BY src.order_seq, src.created_at, src.id) AS turn
      FROM {source} src JOIN accs_tenant tn ON tn.id = src.tenant_id JOIN svc ON svc.id = src.service_id
), fair AS (
    -- Each tenant's scan read up to the service's room, so no more than the room per service,
    -- taken in the fair order.
    SELECT turns.*, row_number() OVER (PARTITION BY service_id
                                       ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq,
                                                created_at, id) AS srank
      FROM turns
), ranked AS (
    SELECT src.*,
           row_number() OVER (PARTITION BY CASE WHEN exclusive THEN host_id END
                              ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
               AS host_rank,
           row_number() OVER w AS n, sum(weight) OVER w AS cpu
      FROM fair src
     WHERE srank <= room
    WINDOW w AS (ORDER BY eff_priority DESC, turn, served_at NULLS FIRST, order_seq, created_at, id)
), pick AS (
    -- One global order across the services; the node's slot and CPU room taken in that order;
    -- an exclusive host gets one task per claim.
    SELECT id FROM ranked
     WHERE n <= %(slots)s AND cpu <= %(cpu)s AND (NOT exclusive OR host_id IS NULL OR host_rank = 1)
), upd AS (
    UPDATE accs_task t
       SET status = 'starting', attempt = t.attempt + 1, claimed_by = %(agent)s, node = %(node)s,
           claimed_at = {stamp},
           -- The service's own lease, else the claimer's (jobs.rescue reads its length back as
           -- lease_expires_at - heartbeat_at).
           lease_expires_at = {stamp} + make_interval(
               secs => coalesce((%(leases)s::jsonb ->> t.service_id::text)::float8, %(lease)s)),
           heartbeat_at = {stamp}, updated_at = {stamp},
           cancel_requested_at = NULL, started_at = NULL
     -- By primary key: the planner cannot know how few rows pick holds, and a hash join would
     -- read the whole task table.
     WHERE t.id = ANY(ARRAY(SELECT id FROM pick))
    RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
              t.priority, t.order_seq, t.created_at, t.tenant_id
), served AS (
    -- Tenant fairness, part 3: the tenants served here go to the back of the next turn, when
    -- another tenant was waiting too. Best effort: a tenant row another claimer is marking is
    -- skipped, never waited for (its mark is as recent).
    UPDATE accs_tenant tn SET served_at = {stamp}
     WHERE tn.id = ANY(ARRAY(SELECT x.id FROM accs_tenant x WHERE x.id IN (SELECT tenant_id FROM upd)
                                 ORDER BY x.id FOR NO KEY UPDATE SKIP LOCKED))
       AND (SELECT count(DISTINCT tenant_id) FROM cand) > 1
), att AS (
    INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, pid, status, started_at, stdout_tail,
                              stderr_tail, error_text)
    SELECT id, attempt, %(node)s, %(agent)s, %(pid)s, 'running', {stamp}, '', '', ''
      FROM upd
), ev AS (
    -- One row per task claimed. A task whose job this claim's call made of a narrow start (%(created)s,
    -- jobs.narrow) carries its job's creation too ("created": its time, source and the task's key; the
    -- rest of a one-task job's creation row follows from them, events.timeline.unfold): one row from
    -- start to claim.
    INSERT INTO accs_event (ts, job_id, task_id, attempt, source, level, type, message, data)
    SELECT {stamp}, upd.job_id, upd.id, upd.attempt, %(source)s, 'info', 'status',
           CASE WHEN upd.job_id = ANY(%(created)s::uuid[]) THEN 'job created waiting, task queued → starting'
                ELSE 'task queued → starting' END,
           jsonb_build_object('from', 'queued', 'to', 'starting', 'agent', %(agent)s::text)
           || CASE WHEN upd.job_id = ANY(%(created)s::uuid[]) THEN jsonb_build_object('created', jsonb_build_object(
                  'ts', upd.created_at, 'source', (SELECT 'api:' || j.source FROM accs_job j WHERE j.id = upd.job_id),
                  'task_key', upd.task_key))
              ELSE '{{}}'::jsonb END
      FROM upd
){record_starts}
SELECT upd.id, upd.job_id, upd.task_key, upd.attempt, upd.params, upd.timeout_seconds, h.name, upd.service_id
  FROM upd LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id
"""


_PAUSED = PAUSED_TENANTS_SQL.format(stamp=STAMP_SQL)


# Tasks bound to no host, the plain scan (services without per-key limits).
_FREE_SCAN = """    -- Tasks bound to no host, per service and tenant: served by task_claim_idx (service_id,
    -- tenant_id, priority DESC, order_seq, created_at, id) WHERE queued AND no host; each scan stops
    -- after the service's room. SKIP LOCKED: concurrent claimers never wait for each other nor
    -- take the same row.
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
        SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq, t.created_at
          FROM accs_task t
         WHERE t.service_id = svc.id AND t.tenant_id = q.tenant_id AND t.status = 'queued' AND t.host_id IS NULL
           AND t.next_attempt_at <= {stamp}
           -- Tasks this agent still runs (an older attempt it has not finished) are never
           -- claimed by it again: its own late finish would otherwise race the new attempt.
           AND t.id <> ALL(%(exclude)s::uuid[])
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT svc.scan
           FOR UPDATE OF t SKIP LOCKED) c
"""


def params_key_sql(alias: str, path: str) -> str:
    """SQL for a task's key: the params value at a dotted path ('' when the params lack it).

    The claim and every reader of the limits use this one expression, so they agree on a key.
    """
    return params_key_at(alias, f"string_to_array({path}, '.')")


def params_key_at(alias: str, parts: str) -> str:
    """SQL for a task's key at a path already split into its parts (see :func:`params_key_sql`)."""
    return f"coalesce({alias}.params #>> {parts}, '')"


# Per-key limits. The keys at their limit are read once per claim, per service (cfull: held tasks
# at the key cap; rfull: starts in the window at the key rate). The scan below passes over a full
# key in the one row where its queue begins (jobs.limit_keys), never over its queued tasks, and a
# candidate whose key is among them is passed over with one lookup in a hash table built once per
# claim. So the claim's cost follows its room, the keys at their limit and the held work, not the
# backlog behind the full keys (bench/keyed_claim.py). The keyed claim function runs the statement
# built for the kinds of key its services have (c: a cap, r: a rate) and whether any records its
# starts (keyed_claim_kinds): a service without a limit of a kind in a claim that has both passes
# that kind's parts at the cost of a comparison. Each statement is planned once per connection, at
# its first use; a smaller statement is a smaller plan to start at each call (the statement with
# every part cost a claim of a per-key cap alone 0.4-0.5 ms more, docs/performance.md).
#
# cused: held tasks per key of the services with a per-key cap. Where the cap's path is the one the
# service's tasks are keyed by (jobs.limit_keys), the count kept per key (accs_limit_key_held, one
# row per key with held work); else counted from the held tasks' params (task_held_service_idx).
# rused: starts in the window per key of the services with a per-key rate (rate_start_service_at_idx;
# the window's starts only: older ones are forgotten by the forget_old_rate_starts duty).
_USED = {
    "c": f"""
, cused AS MATERIALIZED (
    SELECT k.service_id, k.key, k.held AS used
      FROM svc JOIN accs_limit_key_held k ON k.service_id = svc.id AND k.held > 0
     WHERE svc.climit > 0 AND svc.cpath = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
    UNION ALL
    SELECT h.service_id, {params_key_at('h', 'svc.cparts')} AS key, count(*) AS used
      FROM svc JOIN accs_task h ON h.service_id = svc.id AND h.status IN ('starting', 'running')
     WHERE svc.climit > 0
       AND svc.cpath IS DISTINCT FROM accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)
     GROUP BY 1, 2
), cfull AS MATERIALIZED (
    SELECT u.service_id, u.key FROM cused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.climit
)""",
    "r": f"""
, rused AS MATERIALIZED (
    SELECT r.service_id, r.key, count(*) AS used
      FROM svc JOIN accs_rate_start r ON r.service_id = svc.id
                                     AND r.at > {STAMP_SQL} - make_interval(secs => svc.period)
     WHERE svc.rlimit > 0 AND r.key IS NOT NULL
     GROUP BY 1, 2
), rfull AS MATERIALIZED (
    SELECT u.service_id, u.key FROM rused u JOIN svc ON svc.id = u.service_id WHERE u.used >= svc.rlimit
)""",
}
_LIMIT = {"c": "svc.climit", "r": "svc.rlimit"}
_PARTS = {"c": "svc.cparts", "r": "svc.rparts"}


def _key_cols(kinds: str) -> str:
    """SQL for a candidate's two keys (NULL for a kind of limit the claim's services do not have)."""
    cols = {k: (f"CASE WHEN {_LIMIT[k]} > 0 THEN {params_key_at('t', _PARTS[k])} END" if k in kinds else "NULL::text")
            for k in "rc"}
    return "".join(f",\n               {cols[k]} AS {k}key" for k in "rc")


def _key_filter(kinds: str, *, walked: bool = False) -> str:
    """SQL that passes over a task whose key, read from its params, is at its limit.

    A hashed subplan: one lookup per task, however many keys are full (the set of full keys is read
    only where a task reaches it). ``walked``: the tasks were found through their key's row, whose
    room was read for the limit on the path they are keyed by, so only a limit on another path is
    checked here.
    """
    parts = []
    for k in kinds:
        full = f"(t.service_id, {params_key_at('t', _PARTS[k])}) NOT IN (SELECT * FROM {k}full)"
        skip = f" OR svc.{k}path = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)" if walked else ""
        parts.append(f"\n           AND ({_LIMIT[k]} = 0{skip} OR {full})")
    return "".join(parts)


def _before(a: str, b: str, *, a_id: str = "id", b_id: str = "id") -> str:
    """SQL: whether position ``a`` comes strictly before position ``b`` in the claim order."""
    return (f"({a}.priority > {b}.priority OR ({a}.priority = {b}.priority"
            f" AND ({a}.order_seq, {a}.created_at, {a}.{a_id}) < ({b}.order_seq, {b}.created_at, {b}.{b_id})))")


def _key_left(kinds: str, kind: str) -> str:
    """Return the SQL of a key's room left under its limit of ``kind`` on the path the tasks are keyed
    by (accs_limit_key_path); NULL where the service has no such limit. A second limit on another path
    is kept per task (_key_filter, and the pick after the claim's scans)."""
    if kind not in kinds:
        return "NULL::int"
    return f"CASE WHEN {_ALIGNED[kind]} THEN {_LIMIT[kind]} - {_KEY_USED[kind].format(key='h.key')} END"


# The keys at their limit are left out by the walk's index (limit_key_head_order_idx, partial on
# this): the database marks a key's rows when its held tasks fill its cap or its starts its window.
_KEY_HAS_ROOM = "NOT h.cap_full AND h.rate_until IS NULL"


# Whether a service's limit of a kind counts on the path its tasks are keyed by (accs_limit_key_path).
_ALIGNED = {k: f"{_LIMIT[k]} > 0 AND svc.{k}path = accs_limit_key_path(svc.climit, svc.cpath, svc.rlimit, svc.rpath)"
            for k in "cr"}

# What a key {key} of a service (``svc``) has used of its limit on the path its tasks are keyed by,
# probed for that one key: its held count (kept by the database), or its starts in the window
# (rate_start_key_at_idx; the key compared in the starts' collation, which the index is built in).
_KEY_USED = {
    "c": "coalesce((SELECT k.held FROM accs_limit_key_held k WHERE k.service_id = svc.id"
         " AND k.key = ({key} COLLATE \"C\")), 0)",
    "r": "(SELECT count(*) FROM accs_rate_start r WHERE r.service_id = svc.id AND r.key = ({key} COLLATE \"default\")"
         f" AND r.at > {STAMP_SQL} - make_interval(secs => svc.period))::int",
}


# How many key rows past the full ones a claim reads per tenant, beyond its room: rows that lag
# behind their key (its first tasks were claimed or canceled since) still leave it keys to fill from.
KEY_ROWS_SPARE = 8


def _free_keyed(kinds: str) -> str:
    """Return the CTEs that find and lock the host-free candidates when some service has per-key limits.

    Tasks are found by their key, never by passing over the queued tasks of a full key (jobs.limit_keys
    keeps each queued task's key and a row per key where its queue begins):

    * kheads: each tenant's key rows in the claim order (limit_key_head_order_idx), a key at its
      limit passed over in its one row, up to the service's room and a few spare rows;
    * kkeys: those keys, each with the room it has left;
    * ktasks: each key's first tasks (task_limit_key_idx, one descent), no more than its room left
      or the service's;
    * kpicked: the first ``room`` of them per tenant, in the global order; then locked by id with
      SKIP LOCKED and still queued (free).

    After the claim's update (_KEY_ROWS_MOVE), the rows read are brought up to date: a row of a key
    whose first queued task now lies later is moved there, and a key with none left is marked
    emptied, for jobs.limit_keys.SETTLE_SQL to settle in the claim's transaction.

    Each task's key is read again from its params where it is picked (_key_filter here, and the
    per-key ranks after the scans), so the stored key only finds tasks: a stale one could delay a
    task, never let a key exceed its limit. Claimers of a keyed service hold its lock, so no other
    claimer takes a task or moves a row from under this one. Services of the claim without
    per-key limits take the plain scan.
    """
    plain = _FREE_SCAN.replace("t.created_at\n          FROM accs_task t",
                               f"t.created_at{_key_cols(kinds)}\n          FROM accs_task t")
    return f"""
, kheads AS MATERIALIZED (
    SELECT q.service_id, q.tenant_id, h.id AS hid, h.key, h.priority, h.order_seq, h.created_at, h.task_id
      FROM queued_tenants q JOIN svc ON svc.id = q.service_id CROSS JOIN LATERAL (
        SELECT h.id, h.service_id, h.key, h.priority, h.order_seq, h.created_at, h.task_id
          FROM accs_limit_key_head h
         WHERE h.service_id = svc.id AND h.tenant_id = q.tenant_id AND NOT h.emptied
           AND {_KEY_HAS_ROOM}
         ORDER BY h.priority DESC, h.order_seq, h.created_at, h.task_id
         LIMIT svc.room + {KEY_ROWS_SPARE}) h
     WHERE q.tenant_id IS NOT NULL AND (svc.climit > 0 OR svc.rlimit > 0)
), kkeys AS MATERIALIZED (
    -- Each key's room under its cap (cleft) and its rate (rleft), and the nearer of the two (kleft).
    SELECT r.*, least(r.cleft, r.rleft) AS kleft
      FROM (SELECT DISTINCT ON (h.service_id, h.tenant_id, h.key) h.service_id, h.tenant_id, h.key,
                   {_key_left(kinds, "c")} AS cleft, {_key_left(kinds, "r")} AS rleft
              FROM kheads h JOIN svc ON svc.id = h.service_id
             ORDER BY h.service_id, h.tenant_id, h.key) r
), ktasks AS (
    SELECT k.service_id, k.tenant_id, k.key, f.*
      FROM kkeys k JOIN svc ON svc.id = k.service_id CROSS JOIN LATERAL (
        SELECT t.id, t.priority, t.order_seq, t.created_at
          FROM accs_task t
         WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
           AND t.host_id IS NULL AND t.limit_key = k.key
           AND t.next_attempt_at <= {STAMP_SQL} AND t.id <> ALL(%(exclude)s::uuid[]){_key_filter(kinds, walked=True)}
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id
         LIMIT least(k.kleft, svc.room)) f
     WHERE k.kleft > 0
), kpicked AS (
    SELECT x.id FROM (SELECT ktasks.*, row_number() OVER (PARTITION BY service_id, tenant_id
                                                          ORDER BY priority DESC, order_seq, created_at, id) AS r
                        FROM ktasks) x
      JOIN svc ON svc.id = x.service_id
     WHERE x.r <= svc.room
), free AS (
    SELECT c.*, svc.weight, c.priority + svc.adjust AS eff_priority
      FROM (SELECT t.id, t.service_id, t.host_id, t.exclusive, t.tenant_id, t.priority, t.order_seq,
                   t.created_at{_key_cols(kinds)}
              FROM accs_task t JOIN svc ON svc.id = t.service_id
             WHERE t.id = ANY(ARRAY(SELECT id FROM kpicked)) AND t.status = 'queued' AND t.host_id IS NULL
             ORDER BY t.id
               FOR UPDATE OF t SKIP LOCKED) c JOIN svc ON svc.id = c.service_id
    UNION ALL
{plain.format(stamp=STAMP_SQL).rstrip()}
     WHERE svc.climit = 0 AND svc.rlimit = 0
"""


# The key rows the claim read, brought up to date after its update (see _free_keyed): each key's
# first queued task now, the claimed ones left out; a row before it is moved there (one row kept
# per key, the others dropped), a key with none is marked emptied. A row locked by a transaction
# queueing a task of its key is skipped (SKIP LOCKED), never waited for.
#
# A key this claim filled is marked in the same update: its cap full when the claim took all the room
# its held count left (cfilled), its window full until the period has passed when it took all of its
# rate's starts (the newest starts are then all this claim's). The database's triggers mark the same
# keys after the statement, from the held counts and the starts themselves (jobs.limit_keys); finding
# the mark already there they write nothing, where they would otherwise write each row a second time.
# They stay the authority: a mark set here on a count a finish has lowered since is cleared by them.
_KEY_ROWS_MOVE = f""", kfirst AS (
    SELECT k.service_id, k.tenant_id, k.key, n.id, n.priority, n.order_seq, n.created_at,
           k.cleft <= x.taken AS cfilled, k.rleft IS NOT NULL AND svc.rlimit <= x.taken AS rfilled, svc.period
      FROM kkeys k JOIN svc ON svc.id = k.service_id LEFT JOIN LATERAL (
        SELECT t.id, t.priority, t.order_seq, t.created_at FROM accs_task t
         WHERE t.service_id = k.service_id AND t.tenant_id = k.tenant_id AND t.status = 'queued'
           AND t.host_id IS NULL AND t.limit_key = k.key AND t.id <> ALL(ARRAY(SELECT id FROM upd))
         ORDER BY t.priority DESC, t.order_seq, t.created_at, t.id LIMIT 1) n ON true
      CROSS JOIN LATERAL (
        -- The key's tasks this claim took, of every tenant (the held count is the key's, not a tenant's).
        SELECT count(*) AS taken FROM ktasks c
         WHERE c.service_id = k.service_id AND c.key = k.key AND c.id = ANY(ARRAY(SELECT id FROM upd))) x
), kstale AS (
    SELECT h.id, h.service_id, h.tenant_id, h.key, f.id AS first_id, f.priority, f.order_seq, f.created_at,
           f.cfilled, f.rfilled, f.period
      FROM accs_limit_key_head h
      JOIN kfirst f ON f.service_id = h.service_id AND f.tenant_id = h.tenant_id AND f.key = h.key
     WHERE h.id = ANY(ARRAY(SELECT hid FROM kheads))
       AND (f.id IS NULL OR {_before("h", "f", a_id="task_id")})
     ORDER BY h.id
       FOR UPDATE OF h SKIP LOCKED
), kkeep AS (
    SELECT min(id) AS id FROM kstale GROUP BY service_id, tenant_id, key
), kmoved AS (
    UPDATE accs_limit_key_head h
       SET priority = coalesce(s.priority, h.priority), order_seq = coalesce(s.order_seq, h.order_seq),
           created_at = coalesce(s.created_at, h.created_at), task_id = coalesce(s.first_id, h.task_id),
           emptied = s.first_id IS NULL,
           cap_full = h.cap_full OR coalesce(s.cfilled, false),
           rate_until = CASE WHEN s.rfilled THEN {STAMP_SQL} + make_interval(secs => s.period)
                             ELSE h.rate_until END
      FROM kstale s WHERE h.id = s.id AND s.id IN (SELECT id FROM kkeep)
), kdropped AS (
    DELETE FROM accs_limit_key_head h WHERE h.id IN (SELECT id FROM kstale WHERE id NOT IN (SELECT id FROM kkeep))
)"""


def _cand_used(kind: str) -> str:
    """SQL: what a candidate's key has used of its limit of ``kind``, probed for that key (the limit on
    the path the tasks are keyed by, and any rate) or read from the full set (a cap on another path)."""
    probe = _KEY_USED[kind].format(key=f"cand.{kind}key")
    if kind == "r":
        return f"coalesce({probe}, 0)"
    return (f"CASE WHEN {_LIMIT[kind]} = 0 THEN 0 WHEN {_ALIGNED[kind]} THEN {probe}"
            f" ELSE coalesce((SELECT u.used FROM {kind}used u"
            f" WHERE u.service_id = cand.service_id AND u.key = cand.{kind}key), 0) END")


def _keyed_pick(kinds: str) -> str:
    """Return the CTEs that keep, per key, no more candidates than the key has room for.

    Its rate or its cap, whichever is nearer. Ranks count the candidates of a key in the global
    order, so a key's room goes to its most important tasks. (Each walk keeps to this for its
    tenant; candidates of several tenants and host-bound ones need it.) The service's room is kept
    by the fair order below.
    """
    ranks = "".join(f""",
           {_LIMIT[k]} - {_cand_used(k)} AS {k}left,
           row_number() OVER (PARTITION BY cand.service_id, cand.{k}key
                              ORDER BY cand.eff_priority DESC, cand.order_seq, cand.created_at, cand.id) AS {k}rank"""
                    for k in kinds)
    allowed = " AND ".join(f"({k}key IS NULL OR {k}rank <= {k}left)" for k in kinds)
    return f""", keyed AS (
    SELECT cand.*{ranks}
      FROM cand JOIN svc ON svc.id = cand.service_id
), keyed_cand AS (
    SELECT id, service_id, host_id, exclusive, tenant_id, priority, order_seq, created_at, weight, eff_priority
      FROM keyed WHERE {allowed}
)"""


# Every start of a rate-limited service is recorded (with its key), in the claim's own statement.
_RECORD_STARTS = f""", starts AS (
    INSERT INTO accs_rate_start (service_id, key, at)
    SELECT upd.service_id, CASE WHEN svc.rlimit > 0 THEN {params_key_sql('upd', 'svc.rpath')} END,
           {STAMP_SQL}
      FROM upd JOIN svc ON svc.id = upd.service_id WHERE svc.rated
)"""


def claim_sql(*, kinds: str = "", rated: bool) -> str:
    """Return the claim statement for services with the per-key limits ``kinds`` ('c' a cap, 'r' a rate).

    ``kinds`` empty: no per-key limit (the plain statement). ``rated``: starts are recorded.
    """
    if set(kinds) - set("cr"):
        raise ValueError(f"unknown kind of key limit in {kinds!r}: 'c' (cap) and 'r' (rate) exist")
    if not kinds:
        return _CLAIM_HEAD.format(keyed_ctes="", bound_key_cols="", bound_key_filter="", keyed_pick="", paused=_PAUSED,
                                  source="cand", record_starts=_RECORD_STARTS if rated else "",
                                  free=", free AS (\n" + _FREE_SCAN.format(stamp=STAMP_SQL), stamp=STAMP_SQL)
    return _CLAIM_HEAD.format(
        keyed_ctes="".join(_USED[k] for k in "cr" if k in kinds), bound_key_cols=_key_cols(kinds),
        bound_key_filter=_key_filter(kinds), keyed_pick=_keyed_pick(kinds),
        source="keyed_cand",
        record_starts=(_RECORD_STARTS if rated else "") + _KEY_ROWS_MOVE, free=_free_keyed(kinds), paused=_PAUSED,
        stamp=STAMP_SQL)


CLAIM_SQL = claim_sql(rated=False)


# The claim of services without a rate or per-key limit (a fleet-wide cap included), as one
# server-side function (migrations 0019, 0023-0025): the claim's hot path in one round trip (no BEGIN,
# no COMMIT, none of the reads and locks of claim_many's general path as separate statements),
# and its statements planned once per server connection (PL/pgSQL caches their plans) instead
# of at every claim: planning the claim statement cost more than running it. Nothing here is
# session state a pooler could lose: the function lives in the database, and a connection that
# never ran it just plans it once.
#
# It runs, in order: the promotion of due retries, a look at the services' current limits (a
# service that has a rate or per-key limit now is left out and named in the answer, for the
# general path to claim under its lock; a service with nothing queued that this node could take,
# or a capped one whose cap is full now, is left out of this claim, and a claim with every service
# left out returns there, having taken no lock: the idle poll), the locks (the node's, and each
# capped service's, shared with every claimer of it: waited for, or, when the caller asks, as
# agents behind a pooler do, only tried, a busy one left out and named in the answer for the caller
# to claim again soon; then the look for queued work again, since the lock's previous holder may
# have taken it all), the node's held work and hosts read after them (each statement of a PL/pgSQL
# function sees the rows committed before it starts, so the counts are exact under the locks),
# the room of each service, and the very claim statement above (CLAIM_SQL) with its parameters
# bound to the function's variables. Its instant is taken once, after the locks, as the general
# path's statement_timestamp() is. Under a capped service's lock the function makes no round trip
# to the client, so it holds the lock as briefly as it can.
PLAIN_CLAIM_FUNCTION = "accs_claim_plain"

_PLAIN_PARAMS = {
    "svc_ids": "v_ids", "rooms": "v_rooms", "weights": "v_weights", "adjust": "v_adjust", "scans": "v_rooms",
    "rpaths": "v_texts", "rlimits": "v_zeros", "cpaths": "v_texts", "climits": "v_zeros", "periods": "v_zeros",
    "rated": "v_falses", "exclude": "p_exclude", "hosts": "v_hosts", "slots": "v_slots", "cpu": "v_cpu",
    "agent": "p_agent", "node": "p_node", "leases": "v_leases", "lease": "p_lease", "pid": "p_pid",
    "source": "p_source", "created": "v_created",
}

# Whether the service {svc} has a task queued that this node could take: one bound to no host, or
# to one of the node's hosts. Each is one descent of its index (task_claim_idx, task_claim_host_idx)
# for the first row in the index's order: an EXISTS leaves the plan free to read the table from its
# start instead, which the generic plan chose where the statistics said most tasks were this service's
# queued ones, and then read past every other service's rows first (11 ms a call behind another
# service's 50,000 tasks, and growing with them).
_QUEUED_HERE = """(coalesce((SELECT true FROM accs_task t
                     WHERE t.service_id = {svc} AND t.status = 'queued' AND t.host_id IS NULL
                     ORDER BY t.service_id, t.tenant_id LIMIT 1), false)
            OR EXISTS (SELECT 1 FROM accs_host h
                        WHERE h.node_id = p_node
                          AND coalesce((SELECT true FROM accs_task t
                                         WHERE t.host_id = h.id AND t.service_id = {svc} AND t.status = 'queued'
                                         ORDER BY t.host_id, t.service_id LIMIT 1), false)))"""

# The builder's promotion of due retries, bound to the function's arguments (its own services only).
_PROMOTE_PARAMS = {"now": "p_now", "services": "p_svc_ids", "limit": "p_promote_limit", "source": "p_source"}


# Both claim functions, under their locks: the claim's instant, the node's hosts and its held work,
# and the node's slots and CPU left.
_NODE_ROOM = """        v_stamp := coalesce(p_now, clock_timestamp());
        SELECT count(*), count(*) FILTER (WHERE h.status = 'ok'),
               coalesce(array_agg(h.id) FILTER (WHERE h.status = 'ok' AND h.id <> ALL(p_blocked)), '{}')
          INTO v_hosts_all, v_hosts_ok, v_hosts
          FROM accs_host h WHERE h.node_id = p_node;
        -- Held tasks on this node (task_held_node_idx), as HELD_SQL counts them.
        SELECT count(*), coalesce(sum(s.cpu_weight), 0) INTO v_held, v_held_cpu
          FROM accs_task t JOIN accs_service s ON s.id = t.service_id
         WHERE t.status IN ('starting', 'running') AND t.node = p_node;
        v_slots := least(p_free,
                         CASE WHEN v_hosts_all > 0 THEN least(p_slot_cap, v_hosts_ok) ELSE p_slot_cap END - v_held);
        v_cpu := p_cpu_budget - v_held_cpu;"""


# Both claim functions, first thing after the promotion: narrow starts (jobs.narrow) at the head of
# the services' queues become their jobs and tasks now, each tenant's first as many as this claim
# could take, so the claim takes narrow and wide work in the one global order. Starts another
# claimer is widening are passed over.
_WIDEN_HEADS = f"""    IF p_free > 0 THEN
        PERFORM {WIDEN_FUNCTION}(NULL, p_svc_ids, p_free, NULL, NULL, true);
    END IF;
"""
# The plain claim function's: the starts' creation rows are not written as they are widened; the
# claim's row of each task it takes carries its job's creation (one row from start to claim), and
# the starts it widened but did not take get their creation rows once it is done.
_WIDEN_HEADS_FOLDED = f"""    IF p_free > 0 THEN
        v_created := {WIDEN_FUNCTION}(NULL, p_svc_ids, p_free, NULL, NULL, false);
    END IF;
"""


def _bind(statement: str, names: Mapping[str, str]) -> str:
    """Return ``statement`` with its instant and its parameters bound to a function's variables."""
    return bind_params(statement.replace(STAMP_SQL, "v_stamp"), names)


def _bound_promotion() -> str:
    """Return the promotion of due retries (PROMOTE_DUE_SQL) as a claim function runs it."""
    promote = bind_params(PROMOTE_DUE_SQL, _PROMOTE_PARAMS)
    return (textwrap.indent(promote, "    ")
            + "\n    SELECT array_agg(DISTINCT up.service_id) INTO v_promoted FROM up;")


_ANSWER_TAIL = ("SELECT upd.id, upd.job_id, upd.task_key, upd.attempt, upd.params, upd.timeout_seconds, h.name,"
                " upd.service_id\n")


def _function_answer(body: str, *, lease: str) -> str:
    """Return the claim statement ``body`` answering a function's columns: exact types, and ``lease``."""
    if _ANSWER_TAIL not in body:
        raise AssertionError("the claim statement's final SELECT changed: update jobs.claim._function_answer")
    # The function's columns have exact types: the varchar columns are cast, and each task's lease is added.
    return body.replace(_ANSWER_TAIL, "SELECT upd.id, upd.job_id, upd.task_key::text, upd.attempt, upd.params,"
                                      " upd.timeout_seconds, h.name::text, upd.service_id,\n"
                                      f"       {lease}\n")


def plain_claim_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`PLAIN_CLAIM_FUNCTION`, built from CLAIM_SQL.

    A migration holds a copy; a test compares the database's function with this text, so a
    change to the claim statement cannot leave the function running the old one unnoticed.
    """
    body = _function_answer(_bind(CLAIM_SQL, _PLAIN_PARAMS),
                            lease="coalesce((v_leases ->> upd.service_id::text)::float8, p_lease), NULL::text")
    promote = _bound_promotion()
    node_key = "ARRAY['accs:node:' || p_node]"
    node_lock = ADVISORY_LOCKS_SQL.format(keys=node_key)
    all_locks = ADVISORY_LOCKS_SQL.format(
        keys=f"{node_key} || ARRAY(SELECT 'accs:service:' || c FROM unnest(v_capped) AS c)")
    try_service_lock = TRY_ADVISORY_LOCK_SQL.format(key="'accs:service:' || c.id")
    return f"""CREATE OR REPLACE FUNCTION {PLAIN_CLAIM_FUNCTION}(
    p_svc_ids bigint[], p_weights int[], p_adjust int[], p_node_caps int[], p_channels text[],
    p_node text, p_agent text, p_pid int, p_source text, p_now timestamptz, p_free int, p_slot_cap int,
    p_cpu_budget int, p_lease float8, p_blocked bigint[], p_exclude uuid[], p_promote_limit int,
    p_try_capped boolean)
RETURNS TABLE (id uuid, job_id uuid, task_key text, attempt int, params jsonb, timeout_seconds int,
               host text, service_id bigint, lease float8, left_out text)
LANGUAGE plpgsql VOLATILE
-- One plan per server connection for each statement, made at its first call: planning a custom plan
-- at every call (the default until PostgreSQL trusts a generic one) is what the function is for
-- avoiding. The claim statement's shape does not depend on its parameters' values (ids go through
-- arrays, scans are bounded per service), so the generic plan is the plan.
SET plan_cache_mode = force_generic_plan
-- No JIT: a generic plan cannot see the scans' limits, so its estimated cost passes jit_above_cost
-- once the backlog is large (100k queued) and every call would compile its expressions
-- (1.4 s) to run them on a few rows.
SET jit = off
-- No sorts where an index gives the order: the generic plan is made from the statistics of the
-- connection's first call, and statistics go stale (after a TRUNCATE, or a backlog that came and
-- went since the last ANALYZE say nothing is queued). Trusting them, the plan read each host's
-- head through task_job_open_idx (every queued task, sorted per host: 0.2 ms a host, 150 ms a
-- claim on a 500-host node) instead of task_claim_host_idx (one descent, in claim order). The
-- sorts no index can give (a few rows) are still made.
SET enable_sort = off
-- No sequential scans, as the report's and the finalization's functions: a plan made while the task table
-- was nearly empty read the whole table for the node's held tasks, the services' held counts and the due
-- retries, at every claim, for as long as the connection lived (the tables grew under it).
SET enable_seqscan = off
AS $claim$
#variable_conflict use_column
DECLARE
    v_stamp timestamptz;
    v_promoted bigint[];
    v_created uuid[] := '{{}}';  -- jobs this call made of narrow starts whose creation the claim's rows carry
    v_limited bigint[];
    v_capped bigint[];
    v_caps int[];
    v_full bigint[];  -- services left out: nothing queued, a capped one's cap full, or its lock busy
    v_busy bigint[] := '{{}}';  -- capped services whose lock another claimer held
    v_hosts_all int;
    v_hosts_ok int;
    v_hosts bigint[];
    v_held int;
    v_held_cpu int;
    v_slots int;
    v_cpu int;
    v_ids bigint[];
    v_rooms int[];
    v_weights int[];
    v_adjust int[];
    v_leases jsonb;
    v_texts text[];
    v_zeros int[];
    v_falses bool[];
BEGIN
    -- Retries of these services whose backoff is over (the builder's promotion, PROMOTE_DUE_SQL).
{promote}
    IF v_promoted IS NOT NULL THEN
        PERFORM pg_notify(c.ch, '') FROM (SELECT DISTINCT x.ch FROM unnest(p_channels, p_svc_ids) AS x(ch, sid)
                                          WHERE x.sid = ANY(v_promoted) ORDER BY 1) c;
    END IF;
{_WIDEN_HEADS_FOLDED}    -- The services as the database holds them now: one with a rate or per-key limit is not claimed
    -- here; a capped one is, under its lock, with the cap read now.
    SELECT coalesce(array_agg(s.id), '{{}}') INTO v_limited FROM accs_service s
     WHERE s.id = ANY(p_svc_ids) AND (s.rate_limit > 0 OR s.rate_key_limit > 0 OR s.concurrency_key_limit > 0);
    -- A look at the services without any lock: one with no queued task this node could take has
    -- nothing to claim now (a new task's NOTIFY wakes the claimers again), and a capped one whose
    -- cap is full now stays full for this claim (claims only fill it; a finish frees room for the
    -- next claim). Either is left out of this claim, so its claimers do not queue for a lock only
    -- to find nothing (task_claim_idx, task_claim_host_idx, task_held_service_idx).
    -- (OFFSET 0 keeps each count a single evaluation: flattened into the aggregates' filters, it
    -- would be counted once per filter. The held tasks are counted only when some are queued.)
    SELECT coalesce(array_agg(c.id) FILTER (WHERE c.room AND c.cap > 0), '{{}}'),
           coalesce(array_agg(c.cap) FILTER (WHERE c.room AND c.cap > 0), '{{}}'),
           coalesce(array_agg(c.id) FILTER (WHERE NOT c.room), '{{}}')
      INTO v_capped, v_caps, v_full
      FROM (SELECT s.id, s.max_concurrent AS cap,
                   {_QUEUED_HERE.format(svc="s.id")}
                   AND (s.max_concurrent <= 0
                        OR (SELECT count(*) FROM accs_task t
                             WHERE t.status IN ('starting', 'running') AND t.service_id = s.id) < s.max_concurrent)
                   AS room
              FROM accs_service s
             WHERE s.id = ANY(p_svc_ids) AND s.id <> ALL(v_limited)
            OFFSET 0) c;
    -- Nothing to claim when every service was left out (the usual idle poll): no lock, no scan.
    <<claiming>>
    BEGIN
        EXIT claiming WHEN cardinality(v_limited) + cardinality(v_full) >= cardinality(p_svc_ids);
        IF p_try_capped THEN
            -- Behind a pooler: the node's lock ('accs:node:<name>', shared by the node's agents only)
            -- is waited for, holding no other meanwhile; each capped service's ('accs:service:<id>'),
            -- shared by every claimer of the fleet, is only tried. A service whose lock another
            -- claimer holds is left out of this claim and named in the answer ('busy'), and the
            -- caller claims again a moment later: in line for it, each claimer would hold one of the
            -- pool's few server connections through the wait, and the reports would queue behind
            -- them. A try never waits, so it adds no lock-order cycle.
            PERFORM {node_lock};
            SELECT coalesce(array_agg(c.id) FILTER (WHERE NOT c.got), '{{}}') INTO v_busy
              FROM (SELECT c.id, {try_service_lock} AS got
                      FROM unnest(v_capped) AS c(id) OFFSET 0) c;
        ELSE
            -- Direct: the node's and each capped service's lock, waited for as
            -- jobs.locks.advisory_locks takes them (sorted by key hash). A waiter sleeps on its own
            -- connection; claimers retrying instead would take the CPU the lock's holder needs.
            PERFORM {all_locks};
        END IF;
        -- Under the locks, the look for queued work again: the claimer that held a service's lock
        -- before this one may have taken all of it.
        SELECT v_full || v_busy
               || coalesce(array_agg(c.id) FILTER (WHERE NOT {_QUEUED_HERE.format(svc="c.id")}), '{{}}')
          INTO v_full FROM unnest(v_capped) AS c(id) WHERE c.id <> ALL(v_busy);
        EXIT claiming WHEN cardinality(v_limited) + cardinality(v_full) >= cardinality(p_svc_ids);
{_NODE_ROOM}
        IF v_slots > 0 THEN
            -- Each service's room (service_room): the node's slots and CPU, its per-node cap, and its
            -- fleet-wide cap as the look read it, less what the whole fleet holds now (under its lock).
            SELECT array_agg(r.id ORDER BY r.ord), array_agg(r.room ORDER BY r.ord), array_agg(r.weight ORDER BY r.ord),
                   array_agg(r.adjust ORDER BY r.ord),
                   coalesce(jsonb_object_agg(r.id::text, r.lease::float8) FILTER (WHERE r.lease > 0), '{{}}')
              INTO v_ids, v_rooms, v_weights, v_adjust, v_leases
              FROM (SELECT u.id, u.ord, greatest(u.weight, 1) AS weight, u.adjust, s.lease_seconds AS lease,
                           least(v_slots, v_cpu / greatest(u.weight, 1),
                                 CASE WHEN u.cap > 0 THEN u.cap - (SELECT count(*) FROM accs_task t
                                                                    WHERE t.status IN ('starting', 'running')
                                                                      AND t.node = p_node AND t.service_id = u.id)
                                 END,
                                 (SELECT c.cap - (SELECT count(*) FROM accs_task t
                                                   WHERE t.status IN ('starting', 'running') AND t.service_id = u.id)
                                    FROM unnest(v_capped, v_caps) AS c(id, cap) WHERE c.id = u.id)) AS room
                      FROM unnest(p_svc_ids, p_weights, p_adjust, p_node_caps) WITH ORDINALITY
                           AS u(id, weight, adjust, cap, ord)
                      JOIN accs_service s ON s.id = u.id
                     WHERE u.id <> ALL(v_limited) AND u.id <> ALL(v_full)
                    OFFSET 0) r  -- each count once (the filter below would repeat them)
             WHERE r.room > 0;
            IF v_ids IS NOT NULL THEN
                v_texts := array_fill(''::text, ARRAY[cardinality(v_ids)]);
                v_zeros := array_fill(0, ARRAY[cardinality(v_ids)]);
                v_falses := array_fill(false, ARRAY[cardinality(v_ids)]);
                RETURN QUERY
{body.strip()};
            END IF;
        END IF;
    END claiming;
    -- The starts this call widened but did not take: their creation rows (jobs.narrow).
    IF cardinality(v_created) > 0 THEN
{textwrap.indent(CREATIONS_SQL.format(jobs="v_created").strip(), "        ")};
    END IF;
    -- The services left out for the caller to handle, each as a row without a task: those with a
    -- rate or per-key limit ('limited': the general path claims them) and the capped ones whose lock
    -- was busy ('busy': claim them again soon).
    RETURN QUERY SELECT NULL::uuid, NULL::uuid, NULL::text, NULL::int, NULL::jsonb, NULL::int, NULL::text, l.id,
                        NULL::float8, l.why
                   FROM (SELECT x, 'limited' FROM unnest(v_limited) AS x
                         UNION ALL SELECT x, 'busy' FROM unnest(v_busy) AS x) AS l(id, why);
END
$claim$"""



# The claim of services with a rate or per-key limit (and any others claimed with them), as one
# server-side function too (migration 0032): the general path's reads, locks, claim statement and
# settling of the key rows in one round trip, its statements planned once per server connection.
# (Built per call, the keyed claim statement cost more to plan than to run, and the five statements
# around it each cost a round trip; measured in docs/performance.md.)
#
# It runs, in order: the promotion of due retries; a look at the room without any lock when a
# service has a fleet-wide cap or a service-wide rate (a limit full now stays full for this claim:
# claims only fill it, so a claimer that finds none does not queue for the lock); the locks (the
# node's, and each fleet-limited service's, shared with every claimer of it, waited for in the
# order of jobs.locks); the room again under them, with the services' limits, the node's hosts,
# held work and the starts in each rate period read now (each statement sees every row committed
# before it starts, so the counts are exact under the locks); the keyed claim statement for the
# kinds of limit the services have now (KEYED_CLAIM_STATEMENTS); then the key rows the claim found
# empty are settled (jobs.limit_keys.SETTLE_SQL), a statement that sees the tasks queued before the
# claim took those rows.
KEYED_CLAIM_FUNCTION = "accs_claim_keyed"

# The claim statements the keyed claim function chooses from, by (kinds of per-key limit, whether
# starts are recorded): a per-key rate records its starts, so it is never without them.
KEYED_CLAIM_STATEMENTS = {(kinds, rated): claim_sql(kinds=kinds, rated=rated)
                          for kinds in ("cr", "c", "r", "") for rated in (True, False)
                          if rated or "r" not in kinds}


def keyed_claim_kinds(climits: Sequence[int], rlimits: Sequence[int], rated: Sequence[bool]) -> tuple[str, bool]:
    """Return the key of KEYED_CLAIM_STATEMENTS for services with these per-key caps and rates and
    these needs to record starts, as the keyed claim function chooses it."""
    kinds = ("c" if any(c > 0 for c in climits) else "") + ("r" if any(r > 0 for r in rlimits) else "")
    return kinds, any(rated) or "r" in kinds

_KEYED_PARAMS = {
    **_PLAIN_PARAMS, "scans": "v_scans", "rpaths": "v_rpaths", "rlimits": "v_rlimits", "cpaths": "v_cpaths",
    "climits": "v_climits", "periods": "v_periods", "rated": "v_rated",
}

# Each service's room under every limit (service_room), read at v_stamp: the node's slots and CPU,
# its per-node cap, its fleet-wide cap and its service-wide rate, less what is held or was started
# now; with the service's limits as the database holds them now. Services named in v_ids only.
_KEYED_ROOMS = """SELECT array_agg(r.id ORDER BY r.ord), array_agg(r.room ORDER BY r.ord),
               array_agg(r.weight ORDER BY r.ord), array_agg(r.adjust ORDER BY r.ord),
               array_agg(CASE WHEN r.climit > 0 OR r.rlimit > 0 THEN least(r.room * 4 + 16, 1000) ELSE r.room END
                         ORDER BY r.ord),
               array_agg(r.rpath ORDER BY r.ord), array_agg(r.rlimit ORDER BY r.ord),
               array_agg(r.cpath ORDER BY r.ord), array_agg(r.climit ORDER BY r.ord),
               array_agg(r.period ORDER BY r.ord), array_agg(r.rate > 0 OR r.rlimit > 0 ORDER BY r.ord),
               coalesce(jsonb_object_agg(r.id::text, r.lease::float8) FILTER (WHERE r.lease > 0), '{}'),
               coalesce(array_agg(r.id ORDER BY r.ord) FILTER (WHERE r.climit > 0 OR r.rlimit > 0), '{}')
          INTO v_ids, v_rooms, v_weights, v_adjust, v_scans, v_rpaths, v_rlimits, v_cpaths, v_climits, v_periods,
               v_rated, v_leases, v_keyed
          FROM (SELECT u.id, u.ord, greatest(u.weight, 1) AS weight, u.adjust, s.lease_seconds AS lease,
                       s.rate_key AS rpath, s.rate_key_limit AS rlimit, s.concurrency_key AS cpath,
                       s.concurrency_key_limit AS climit, s.rate_period_seconds AS period, s.rate_limit AS rate,
                       least(v_slots, v_cpu / greatest(u.weight, 1),
                             CASE WHEN u.cap > 0 THEN u.cap - (SELECT count(*) FROM accs_task t
                                                                WHERE t.status IN ('starting', 'running')
                                                                  AND t.node = p_node AND t.service_id = u.id)
                             END,
                             CASE WHEN s.max_concurrent > 0 THEN s.max_concurrent - (
                                 SELECT count(*) FROM accs_task t
                                  WHERE t.status IN ('starting', 'running') AND t.service_id = u.id)
                             END,
                             CASE WHEN s.rate_limit > 0 THEN s.rate_limit - (
                                 SELECT count(*) FROM accs_rate_start r
                                  WHERE r.service_id = u.id
                                    AND r.at > v_stamp - make_interval(secs => s.rate_period_seconds))
                             END) AS room
                  FROM unnest(p_svc_ids, p_weights, p_adjust, p_node_caps) WITH ORDINALITY
                       AS u(id, weight, adjust, cap, ord)
                  JOIN accs_service s ON s.id = u.id
                 WHERE u.id = ANY(v_ids)
                OFFSET 0) r  -- each count once (the filter below would repeat them)
         WHERE r.room > 0"""


def keyed_claim_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`KEYED_CLAIM_FUNCTION`, built from KEYED_CLAIM_STATEMENTS.

    A migration holds a copy; a test compares the database's function with this text.
    """
    # One RETURN QUERY per statement, chosen as keyed_claim_kinds chooses (the services' limits as
    # read under the locks).
    branches: list[str] = []
    for (kinds, rated), statement in KEYED_CLAIM_STATEMENTS.items():
        body = _function_answer(_bind(statement, _KEYED_PARAMS),
                                lease="coalesce((v_leases ->> upd.service_id::text)::float8, p_lease)")
        test = f"v_kinds = '{kinds}' AND v_any_rated = {str(rated).lower()}"
        branches.append(f"""{"IF" if not branches else "ELSIF"} {test} THEN
        RETURN QUERY
{textwrap.indent(body.strip(), "    ")};""")
    choose = "\n    ".join(branches) + "\n    END IF;"
    settle = _bind(limit_keys.SETTLE_SQL, {"svc_ids": "v_keyed"})
    locks = ADVISORY_LOCKS_SQL.format(
        keys="ARRAY['accs:node:' || p_node] || ARRAY(SELECT 'accs:service:' || s.id FROM accs_service s"
             " WHERE s.id = ANY(v_ids) AND (s.max_concurrent > 0 OR s.rate_limit > 0 OR s.rate_key_limit > 0"
             " OR s.concurrency_key_limit > 0))")
    return f"""CREATE OR REPLACE FUNCTION {KEYED_CLAIM_FUNCTION}(
    p_svc_ids bigint[], p_weights int[], p_adjust int[], p_node_caps int[], p_channels text[],
    p_node text, p_agent text, p_pid int, p_source text, p_now timestamptz, p_free int, p_slot_cap int,
    p_cpu_budget int, p_lease float8, p_blocked bigint[], p_exclude uuid[], p_promote_limit int)
RETURNS TABLE (id uuid, job_id uuid, task_key text, attempt int, params jsonb, timeout_seconds int,
               host text, service_id bigint, lease float8)
LANGUAGE plpgsql VOLATILE
-- Planned once per server connection, never compiled, and no sort where an index gives the order
-- (stale statistics cannot turn a head's probe into a sort of the backlog): as the plain claim
-- function (jobs.claim); no sequential scans either.
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_sort = off
SET enable_seqscan = off
AS $claim$
#variable_conflict use_column
DECLARE
    v_stamp timestamptz;
    v_promoted bigint[];
    v_created uuid[] := '{{}}';  -- jobs this call made of narrow starts whose creation the claim's rows carry
    v_pass int;
    v_hosts_all int;
    v_hosts_ok int;
    v_hosts bigint[];
    v_held int;
    v_held_cpu int;
    v_slots int;
    v_cpu int;
    v_ids bigint[] := p_svc_ids;  -- the services still in this claim
    v_rooms int[];
    v_weights int[];
    v_adjust int[];
    v_scans int[];
    v_rpaths text[];
    v_rlimits int[];
    v_cpaths text[];
    v_climits int[];
    v_periods int[];
    v_rated bool[];
    v_leases jsonb;
    v_keyed bigint[];  -- the services with a per-key limit
    v_kinds text;  -- the kinds of per-key limit among them: 'c' a cap, 'r' a rate (KEYED_CLAIM_STATEMENTS)
    v_any_rated boolean;  -- whether any of the services records its starts
BEGIN
    -- Retries of these services whose backoff is over (the builder's promotion, PROMOTE_DUE_SQL).
{_bound_promotion()}
    IF v_promoted IS NOT NULL THEN
        PERFORM pg_notify(c.ch, '') FROM (SELECT DISTINCT x.ch FROM unnest(p_channels, p_svc_ids) AS x(ch, sid)
                                          WHERE x.sid = ANY(v_promoted) ORDER BY 1) c;
    END IF;
{_WIDEN_HEADS}    -- Pass 1, without any lock, only when a service has a fleet-wide cap or a service-wide rate: a
    -- limit full now stays full for this claim (claims only fill it; a finish or the passing window
    -- frees room for the next claim), so a claimer that finds no room does not queue behind all the
    -- others for the lock, and the services without room are left out of it. (Whether a key has
    -- room is for the claim statement to find.) Pass 2, under the locks: the counts are exact.
    FOR v_pass IN 1..2 LOOP
        IF v_pass = 2 THEN
            -- The node's lock and each fleet-limited service's (a cap, a rate, a per-key limit),
            -- shared with every claimer of it, waited for as jobs.locks.advisory_locks takes them.
            PERFORM {locks};
        ELSIF NOT EXISTS (SELECT 1 FROM accs_service s
                           WHERE s.id = ANY(v_ids) AND (s.max_concurrent > 0 OR s.rate_limit > 0)) THEN
            CONTINUE;
        END IF;
{_NODE_ROOM}
        IF v_slots <= 0 THEN
            RETURN;
        END IF;
        {_KEYED_ROOMS};
        IF v_ids IS NULL THEN
            RETURN;
        END IF;
    END LOOP;
    IF cardinality(v_keyed) > 0 THEN
        -- Rate blocks that have run out: their keys are walked again (limit_key_head_rate_until_idx).
        UPDATE accs_limit_key_head h SET rate_until = NULL
         WHERE h.service_id = ANY(v_keyed) AND h.rate_until IS NOT NULL AND h.rate_until <= v_stamp;
    END IF;
    v_kinds := CASE WHEN 0 < ANY(v_climits) THEN 'c' ELSE '' END || CASE WHEN 0 < ANY(v_rlimits) THEN 'r' ELSE '' END;
    v_any_rated := true = ANY(v_rated) OR v_kinds IN ('r', 'cr');
    {choose}
    IF cardinality(v_keyed) > 0 THEN
        -- The key rows this claim found empty, seen again now that it holds them (jobs.limit_keys).
{textwrap.indent(settle.strip(), "        ")};
    END IF;
END
$claim$"""

def claim_statement(rooms: Sequence[tuple[ServiceSpec, int]], *,
                    adjust: Mapping[int, int]) -> tuple[str, dict[str, Any]]:
    """Return the claim statement these services need and its per-service parameters.

    The statement a claim function runs (CLAIM_SQL in the plain one, one of KEYED_CLAIM_STATEMENTS in
    the keyed one), for reading its plan (EXPLAIN) with the parameters the function would bind.
    """
    specs = [s for s, _ in rooms]
    sql = (KEYED_CLAIM_STATEMENTS[keyed_claim_kinds([s.concurrency_key_limit for s in specs],
                                                    [s.rate_key_limit for s in specs], [s.rated for s in specs])]
           if any(s.rated or s.keyed for s in specs) else CLAIM_SQL)
    return sql, {
        "svc_ids": [s.id for s in specs], "rooms": [n for _, n in rooms],
        "weights": [max(s.cpu_weight, 1) for s in specs], "adjust": [adjust.get(s.id, 0) for s in specs],
        # Host-bound candidates of a service with a per-key limit are scanned past its room: some
        # may belong to keys with less room left than the service has.
        "scans": [min(n * 4 + 16, 1000) if s.keyed else n for s, n in rooms],
        "rpaths": [s.rate_key for s in specs], "rlimits": [s.rate_key_limit for s in specs],
        "cpaths": [s.concurrency_key for s in specs], "climits": [s.concurrency_key_limit for s in specs],
        "periods": [s.rate_period for s in specs], "rated": [s.rated for s in specs],
        # Services with a lease of their own (service id -> seconds); the others get the claimer's.
        "leases": json.dumps({s.id: float(s.lease_seconds) for s in specs if s.lease_seconds}),
        # Jobs the call made of narrow starts (their creation rides on the claim's row): none here.
        "created": [],
    }


# The held counts both claim functions make before a claim, as one statement (its plan is tested:
# tests/jobs/test_index_readers.py).
HELD_SQL = """
-- Held tasks on this node (task_held_node_idx) and of the capped services (task_held_service_idx):
-- partial indexes holding only starting/running tasks, so the cost follows the running work.
SELECT t.service_id, count(*) FILTER (WHERE t.node = %(node)s), count(*), coalesce(
       sum(s.cpu_weight) FILTER (WHERE t.node = %(node)s), 0)
  FROM accs_task t JOIN accs_service s ON s.id = t.service_id
 WHERE t.status IN ('starting', 'running') AND (t.node = %(node)s OR t.service_id = ANY(%(capped)s::bigint[]))
 GROUP BY t.service_id
"""

def labels_satisfied(required: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
    """Return whether a node with ``labels`` offers every label a service requires."""
    return all(str(labels.get(k)) == str(v) for k, v in (required or {}).items())


@dataclass(frozen=True)
class ClaimRound:
    """What one claim took, and the capped services it left out because another claimer held
    their lock at that moment (``contended``): those may still have room, so claim again soon.

    ``waited_out``: a lock wait ran past the claim's bound and rolled its transaction back; the
    services claimed in it took nothing (they are named in ``contended`` when capped).
    """

    tasks: list[ClaimedTask]
    contended: frozenset[int] = frozenset()
    waited_out: bool = False


def claim_many(services: Sequence[ServiceSpec], limits: NodeLimits, *, agent_id: str, free_slots: int,
               lease_seconds: float, pid: int | None = None, now: datetime | None = None,
               blocked_hosts: frozenset[int] = frozenset(), exclude: Collection[UUID] = (),
               priority_adjust: Mapping[int, int] | None = None) -> list[ClaimedTask]:
    """Claim across ``services`` in the global order, within every limit, waiting for the locks of
    capped services; see :func:`claim_round`."""
    return claim_round(services, limits, agent_id=agent_id, free_slots=free_slots, lease_seconds=lease_seconds,
                       pid=pid, now=now, blocked_hosts=blocked_hosts, exclude=exclude,
                       priority_adjust=priority_adjust).tasks


def claim_round(services: Sequence[ServiceSpec], limits: NodeLimits, *, agent_id: str, free_slots: int,
                lease_seconds: float, pid: int | None = None, now: datetime | None = None,
                blocked_hosts: frozenset[int] = frozenset(), exclude: Collection[UUID] = (),
                priority_adjust: Mapping[int, int] | None = None, try_capped: bool = False,
                lock_wait: float | None = None) -> ClaimRound:
    """Claim across ``services`` in the global order, within every limit; one short transaction.

    ``priority_adjust`` maps a service id to a priority shift (governor conditions). ``exclude``
    names tasks the agent is still running (any attempt): they are never claimed again. The
    fleet-wide limits (``max_concurrent``, rates, per-key caps) are read from the database in the
    claim's transaction; the rest of each :class:`ServiceSpec` is taken as given.

    Every claimer of a capped service shares its lock. With ``try_capped`` (agents behind a
    pooler, where a claimer waiting in line would hold one of the pool's few server connections)
    the claim does not wait for it: a capped service whose lock another claimer holds is left out
    and named in the answer's ``contended``, for the caller to claim again a moment later.
    Otherwise it waits, sleeping on its own connection (claimers retrying instead take the CPU the
    lock's holder needs: measured in docs/performance.md).

    With ``lock_wait`` (seconds) no lock is waited for longer, whatever holds it (a slow claimer, a
    convoy, a site holding a capped service's lock to pause it, a migration): the claim's
    transaction rolls back, claims nothing, and answers ``waited_out`` for the caller to back off.
    """
    services = [s for s in services if labels_satisfied(s.required_labels, limits.labels)]
    if free_slots <= 0 or not services:
        return ClaimRound([])
    adjust = priority_adjust or {}
    if not any(s.rated or s.keyed for s in services):
        # The common case, in one round trip, capped services included (under their locks, in the
        # function); a service that gained a rate or per-key limit since the agent's cache was
        # read is left to the general path below, under its lock.
        try:
            tasks, limited, busy = _claim_plain(services, limits, agent_id=agent_id, free_slots=free_slots,
                                                lease_seconds=lease_seconds, pid=pid, now=now,
                                                blocked_hosts=blocked_hosts, exclude=exclude, adjust=adjust,
                                                try_capped=try_capped, lock_wait=lock_wait)
        except DatabaseError as exc:
            return _waited_out(services, exc)
        if not limited or free_slots <= len(tasks):
            return ClaimRound(tasks, busy)
        limited_services = [s for s in services if s.id in limited]
        try:
            more = _claim_general(limited_services, limits, agent_id=agent_id,
                                  free_slots=free_slots - len(tasks), lease_seconds=lease_seconds, pid=pid, now=now,
                                  blocked_hosts=blocked_hosts, exclude=[*exclude, *(t.id for t in tasks)],
                                  adjust=adjust, lock_wait=lock_wait)
        except DatabaseError as exc:  # the plain claim's tasks are committed: they are the answer
            return replace(_waited_out(limited_services, exc), tasks=tasks)
        return ClaimRound(tasks + more, busy)
    try:
        return ClaimRound(_claim_general(services, limits, agent_id=agent_id, free_slots=free_slots,
                                         lease_seconds=lease_seconds, pid=pid, now=now, blocked_hosts=blocked_hosts,
                                         exclude=exclude, adjust=adjust, lock_wait=lock_wait))
    except DatabaseError as exc:
        return _waited_out(services, exc)


def _waited_out(services: Sequence[ServiceSpec], exc: DatabaseError) -> ClaimRound:
    """Answer a claim whose lock wait ran out (its transaction rolled back); raise any other error."""
    if not is_lock_timeout(exc):
        raise exc
    return ClaimRound([], frozenset(s.id for s in services if s.fleet_limited), waited_out=True)


PLAIN_CLAIM_CALL = f"""
SELECT * FROM {PLAIN_CLAIM_FUNCTION}(%(svc_ids)s::bigint[], %(weights)s::int[], %(adjust)s::int[], %(caps)s::int[],
    %(channels)s::text[], %(node)s, %(agent)s, %(pid)s, %(source)s, %(now)s::timestamptz, %(free)s, %(slot_cap)s,
    %(cpu_budget)s, %(lease)s::float8, %(blocked)s::bigint[], %(exclude)s::uuid[], %(promote_limit)s,
    %(try_capped)s)
"""

def _bounded(call: str) -> str:
    """Return a claim function's ``call`` with its lock waits bounded.

    The lock_timeout is set first, for the statement's own transaction (SET LOCAL), and the call
    takes an argument from the setting's answer (an empty text appended to its source), so it
    cannot run before it. One statement, one round trip, as unbounded.
    """
    return ("\nSELECT c.* FROM " + LOCK_WAIT_SQL.format(ms="%(lock_wait)s") + " AS w(setting),\nLATERAL"
            + call.replace("SELECT * FROM", "", 1).replace("%(source)s", "%(source)s || left(w.setting, 0)", 1)
            .rstrip() + " AS c\n")


BOUNDED_PLAIN_CLAIM_CALL = _bounded(PLAIN_CLAIM_CALL)


def _call_params(services: Sequence[ServiceSpec], limits: NodeLimits, *, agent_id: str, free_slots: int,
                 lease_seconds: float, pid: int | None, now: datetime | None, blocked_hosts: frozenset[int],
                 exclude: Collection[UUID], adjust: Mapping[int, int], lock_wait: float | None) -> dict[str, Any]:
    """Return the arguments both claim functions take (PLAIN_CLAIM_CALL, KEYED_CLAIM_CALL)."""
    caps = [limits.per_service.get(s.key) or 0 for s in services]
    bound = {} if lock_wait is None else {"lock_wait": lock_wait_ms(lock_wait)}
    return {**bound,
            "svc_ids": [s.id for s in services], "weights": [max(s.cpu_weight, 1) for s in services],
            "adjust": [adjust.get(s.id, 0) for s in services], "caps": [max(c, 0) for c in caps],
            "channels": [service_channel(s.key) for s in services], "node": limits.name, "agent": agent_id,
            "pid": pid, "source": f"agent:{limits.name}", "now": now, "free": free_slots, "slot_cap": limits.slot_cap,
            "cpu_budget": limits.cpu_budget, "lease": float(lease_seconds), "blocked": sorted(blocked_hosts),
            "exclude": [str(t) for t in exclude], "promote_limit": max(free_slots, 100)}


def _claim_plain(services: Sequence[ServiceSpec], limits: NodeLimits, *, agent_id: str, free_slots: int,
                 lease_seconds: float, pid: int | None, now: datetime | None, blocked_hosts: frozenset[int],
                 exclude: Collection[UUID], adjust: Mapping[int, int],
                 try_capped: bool, lock_wait: float | None) -> tuple[list[ClaimedTask], set[int], frozenset[int]]:
    """Claim services without a rate or per-key limit in one call; return the tasks, the services
    left out for the general path (they have such a limit now) and the capped ones whose lock was busy.

    One statement, so outside a transaction it is its own (one round trip, committed by the server).
    """
    params = _call_params(services, limits, agent_id=agent_id, free_slots=free_slots, lease_seconds=lease_seconds,
                          pid=pid, now=now, blocked_hosts=blocked_hosts, exclude=exclude, adjust=adjust,
                          lock_wait=lock_wait)
    with connection.cursor() as cur:
        cur.execute(PLAIN_CLAIM_CALL if lock_wait is None else BOUNDED_PLAIN_CLAIM_CALL,
                    {**params, "try_capped": try_capped})
        rows = cur.fetchall()
    by_id = {s.id: s for s in services}
    tasks = [ClaimedTask(row[0], row[1], row[2], row[3], from_json(row[4]) or {}, row[5], host=row[6],
                         service_key=by_id[row[7]].key, lease_seconds=float(row[8]))
             for row in rows if row[0] is not None]
    return (tasks, {row[7] for row in rows if row[0] is None and row[9] == "limited"},
            frozenset(row[7] for row in rows if row[0] is None and row[9] == "busy"))


KEYED_CLAIM_CALL = f"""
SELECT * FROM {KEYED_CLAIM_FUNCTION}(%(svc_ids)s::bigint[], %(weights)s::int[], %(adjust)s::int[], %(caps)s::int[],
    %(channels)s::text[], %(node)s, %(agent)s, %(pid)s, %(source)s, %(now)s::timestamptz, %(free)s, %(slot_cap)s,
    %(cpu_budget)s, %(lease)s::float8, %(blocked)s::bigint[], %(exclude)s::uuid[], %(promote_limit)s)
"""
BOUNDED_KEYED_CLAIM_CALL = _bounded(KEYED_CLAIM_CALL)


def _claim_general(services: Sequence[ServiceSpec], limits: NodeLimits, *, agent_id: str, free_slots: int,
                   lease_seconds: float, pid: int | None, now: datetime | None, blocked_hosts: frozenset[int],
                   exclude: Collection[UUID], adjust: Mapping[int, int],
                   lock_wait: float | None = None) -> list[ClaimedTask]:
    """Claim under every limit in one call of the keyed claim function (its own transaction)."""
    with connection.cursor() as cur:
        cur.execute(KEYED_CLAIM_CALL if lock_wait is None else BOUNDED_KEYED_CLAIM_CALL,
                    {**_call_params(services, limits, agent_id=agent_id, free_slots=free_slots,
                                    lease_seconds=lease_seconds, pid=pid, now=now, blocked_hosts=blocked_hosts,
                                    exclude=exclude, adjust=adjust, lock_wait=lock_wait)})
        rows = cur.fetchall()
    by_id = {s.id: s for s in services}
    return [ClaimedTask(row[0], row[1], row[2], row[3], from_json(row[4]) or {}, row[5], host=row[6],
                        service_key=by_id[row[7]].key, lease_seconds=float(row[8]))
            for row in rows]

ADOPT_SQL = """
-- Tasks this agent claimed without hearing the answer (the claim committed, then the connection
-- broke): still 'starting', never started. Their leases are renewed on PostgreSQL's clock, locks
-- taken in id order; task_held_node_idx finds them.
WITH l AS (
    SELECT t.id FROM accs_task t
     WHERE t.node = %(node)s AND t.status = 'starting' AND t.claimed_by = %(agent)s AND t.started_at IS NULL
       AND t.id <> ALL(%(known)s::uuid[])
     ORDER BY t.id FOR UPDATE OF t
), upd AS (
    UPDATE accs_task t SET lease_expires_at = now() + make_interval(secs => coalesce(s.lease_seconds, %(lease)s)),
           heartbeat_at = now()
      FROM l, accs_service s WHERE t.id = l.id AND s.id = t.service_id
    RETURNING t.id, t.job_id, t.task_key, t.attempt, t.params, t.timeout_seconds, t.host_id, t.service_id,
              t.priority, t.order_seq, t.created_at, coalesce(s.lease_seconds, %(lease)s) AS lease
)
SELECT upd.id, upd.job_id, upd.task_key, upd.attempt, upd.params, upd.timeout_seconds, h.name, s.key, upd.lease
  FROM upd JOIN accs_service s ON s.id = upd.service_id LEFT JOIN accs_host h ON h.id = upd.host_id
 ORDER BY upd.priority DESC, upd.order_seq, upd.created_at, upd.id
"""


def adopt_claimed(node: str, *, agent_id: str, known: Collection[UUID], lease_seconds: float) -> list[ClaimedTask]:
    """Return the tasks ``agent_id`` claimed but does not know it holds, with their leases renewed.

    A claim whose connection breaks after the commit leaves its tasks claimed by an agent that
    never saw them; without this they would sit until their lease ended and run a second
    attempt. ``known`` names every task the agent runs or still has to report.
    """
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        cur.execute(ADOPT_SQL, {"node": node, "agent": agent_id, "known": [str(t) for t in known],
                                "lease": float(lease_seconds)})
        return [ClaimedTask(row[0], row[1], row[2], row[3], from_json(row[4]) or {}, row[5], host=row[6],
                            service_key=row[7], lease_seconds=float(row[8]))
                for row in cur.fetchall()]


def claim(service: ServiceSpec, limits: NodeLimits, *, agent_id: str, free_slots: int, lease_seconds: float,
          pid: int | None = None, now: datetime | None = None, blocked_hosts: frozenset[int] = frozenset(),
          exclude: Collection[UUID] = ()) -> list[ClaimedTask]:
    """Claim tasks of one service (see :func:`claim_many`)."""
    return claim_many([service], limits, agent_id=agent_id, free_slots=free_slots, lease_seconds=lease_seconds,
                      pid=pid, now=now, blocked_hosts=blocked_hosts, exclude=exclude)


FORGET_STARTS_SQL = """
-- Starts older than their service's rate period count against nothing any more. A bounded batch
-- by ctid, so a long pause never turns into one huge delete.
DELETE FROM accs_rate_start WHERE ctid = ANY(ARRAY(
    SELECT r.ctid FROM accs_rate_start r JOIN accs_service s ON s.id = r.service_id
     WHERE r.at < now() - make_interval(secs => s.rate_period_seconds)
     LIMIT %(limit)s))
"""


def forget_old_starts(*, limit: int = 5000) -> int:
    """Delete up to ``limit`` recorded starts that no rate window holds any more; return how many."""
    with connection.cursor() as cur:
        cur.execute(FORGET_STARTS_SQL, {"limit": limit})
        return cur.rowcount
