"""What the system looks like now: the read model behind the dashboard, ``accs_status`` and /metrics.

Every query here must stay cheap when the tables hold millions of rows, so each one reads only
the live part of the data through a partial index or a bounded window:

* active tasks (queued / starting / running) through ``task_claim_idx`` and the held-task indexes;
* waiting tasks and admitted jobs through the waiting / running jobs (``job_workflow_admitted_idx``
  holds exactly those);
* failed jobs and dead letters through the jobs in ``error`` (``job_tenant_status_created_idx``);
* why queued work does not move from the queued tasks, the held tasks per service, and the small
  node, service and governor tables;
* latency, run time, throughput and recent failures from the newest attempts only
  (``ORDER BY id DESC LIMIT n`` on the primary key), never from a scan of the whole history.

No exact ``COUNT(*)`` over a whole table happens here.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.urls import reverse
from django.utils import timezone

from accs_site.admin_kit import human_age
from accs_site.conf import accs
from accs_site.dbrouter import read_connection, replica_lag
from accs_site.version import VERSION
from jobs.claim import params_key_sql
from nodes.api import stale_after_seconds
from tenants.models import Tenant
from workflows.governor import PAUSE_PREFIX, paused_service_key, paused_tenant_id
from workflows.models import GovernorCondition

#: How many of the newest attempts the latency / run-time / throughput figures read at most.
ATTEMPT_SAMPLE = 20_000
#: The window those figures cover (when the sample reaches back that far).
RECENT_WINDOW = timedelta(hours=1)
#: Failed jobs are counted over this window ("failed (24 h)").
FAILED_WINDOW = timedelta(hours=24)

HELD = ("starting", "running")


def _tenant_filter(column: str, tenant_ids: set[UUID] | None) -> tuple[str, dict[str, Any]]:
    """Return an SQL condition restricting ``column`` to ``tenant_ids`` (None: no restriction)."""
    if tenant_ids is None:
        return "TRUE", {}
    return f"{column} = ANY(%(tenants)s::uuid[])", {"tenants": [str(t) for t in tenant_ids]}


# --------------------------------------------------------------------------------------------
# Queues: per tenant and per service
# --------------------------------------------------------------------------------------------

ACTIVE_TASKS_SQL = """
-- Only queued/scheduled/starting/running rows, one branch per partial index, each branch's
-- condition being exactly its index's (task_claim_idx, task_claim_host_idx, task_scheduled_idx,
-- task_lease_idx): a single `status IN (...)` matches none of them, and the planner then reads
-- the whole task table. Retries waiting out their backoff (scheduled) count as queued and retrying.
WITH a AS (
    SELECT t.tenant_id, t.service_id, t.status, t.attempt, t.next_attempt_at
      FROM accs_task t WHERE t.status = 'queued' AND t.host_id IS NULL AND {tenants}
    UNION ALL
    SELECT t.tenant_id, t.service_id, t.status, t.attempt, t.next_attempt_at
      FROM accs_task t WHERE t.status = 'queued' AND t.host_id IS NOT NULL AND {tenants}
    UNION ALL
    SELECT t.tenant_id, t.service_id, t.status, t.attempt, t.next_attempt_at
      FROM accs_task t WHERE t.status = 'scheduled' AND {tenants}
    UNION ALL
    SELECT t.tenant_id, t.service_id, t.status, t.attempt, t.next_attempt_at
      FROM accs_task t WHERE t.status IN ('starting', 'running') AND {tenants}
    UNION ALL
    -- Narrow starts not widened yet (jobs.narrow): each is a queued task, claimable since it started.
    SELECT t.tenant_id, t.service_id, 'queued', 0, t.created_at
      FROM accs_start t WHERE {tenants}
)
SELECT a.tenant_id, a.service_id, CASE WHEN a.status = 'scheduled' THEN 'queued' ELSE a.status END, count(*),
       count(*) FILTER (WHERE a.status IN ('queued', 'scheduled') AND a.attempt > 0),
       min(a.next_attempt_at) FILTER (WHERE a.status = 'queued' AND a.next_attempt_at <= %(now)s)
  FROM a
 GROUP BY 1, 2, 3
"""

WAITING_TASKS_SQL = """
-- Waiting tasks only exist in admitted jobs (waiting or running); job_workflow_admitted_idx holds
-- exactly those jobs.
SELECT t.tenant_id, t.service_id, count(*)
  FROM accs_job j JOIN accs_task t ON t.job_id = j.id AND t.status = 'waiting'
 WHERE j.status IN ('waiting', 'running') AND {tenants}
 GROUP BY 1, 2
"""

ADMITTED_JOBS_SQL = """
-- Jobs whose tasks exist: waiting (none of their tasks starting or running) or running.
-- job_workflow_admitted_idx holds exactly those jobs.
-- A narrow start not widened yet (jobs.narrow) is a waiting job.
SELECT j.tenant_id, count(*) FILTER (WHERE j.status = 'waiting'), count(*) FILTER (WHERE j.status = 'running')
  FROM (SELECT j.tenant_id, j.status FROM accs_job j WHERE j.status IN ('waiting', 'running') AND {tenants}
        UNION ALL
        SELECT j.tenant_id, 'waiting' FROM accs_start j WHERE {tenants}) j
 GROUP BY 1
"""

QUEUED_JOBS_SQL = """
-- Jobs not instantiated yet (due later, waiting for approval or for the builder): job_due_idx.
SELECT j.tenant_id, count(*), count(*) FILTER (WHERE j.approval_state = 'pending'),
       min(j.created_at) FILTER (WHERE j.scheduled_at <= %(now)s AND j.approval_state IN ('not_required', 'approved'))
  FROM accs_job j
 WHERE j.status = 'queued' AND {tenants}
 GROUP BY 1
"""

FAILED_JOBS_SQL = """
-- Jobs that ended in error inside the window, per tenant: the partial index on (tenant,
-- finished_at) of jobs in error, so older failures are not read.
SELECT j.tenant_id, count(*)
  FROM accs_job j
 WHERE j.tenant_id = ANY(%(ids)s::uuid[]) AND j.status = 'error' AND j.finished_at >= %(since)s
 GROUP BY 1
"""

DEAD_LETTER_SQL = """
-- Dead letters: tasks in final error (their attempts used up), whatever their job became since (a
-- job that continues past a failed step ends partial and keeps them), as the tasks list and the
-- redrive count them. task_dead_letter_count_idx holds exactly those rows with the columns
-- counted, so the count is an index-only scan of the dead letters, not a heap read of each.
SELECT t.tenant_id, t.service_id, count(*)
  FROM accs_task t
 WHERE t.tenant_id = ANY(%(ids)s::uuid[]) AND t.status = 'error'
 GROUP BY 1, 2
"""


@dataclass
class TenantQueue:
    """Queue figures of one tenant (the dashboard's summary cards)."""

    tenant_id: str
    tenant: str
    # Jobs
    jobs_queued: int = 0  # not instantiated yet (due later, awaiting approval or the builder)
    awaiting_approval: int = 0  # of those, waiting for an approval
    jobs_waiting: int = 0  # tasks created, none starting or running
    jobs_running: int = 0  # a task starting or running
    failed_24h: int = 0  # jobs that ended in error in the last 24 h
    # Tasks
    waiting: int = 0  # waiting for their dependencies
    queued: int = 0  # claimable, or a retry waiting out its backoff
    running: int = 0  # starting or running
    retrying: int = 0  # queued again after a failure
    dead_letter: int = 0  # failed for good
    oldest_queued_age: float | None = None


@dataclass
class ServiceQueue:
    """Queue figures of one (tenant, service) pair; the metrics' label set."""

    tenant: str
    service: str
    waiting: int = 0
    queued: int = 0
    starting: int = 0
    running: int = 0
    retrying: int = 0
    dead_letter: int = 0
    oldest_queued_age: float | None = None


def _max_age(current: float | None, new: float | None) -> float | None:
    if new is None:
        return current
    return new if current is None else max(current, new)


def queue_depth(*, tenant_ids: set[UUID] | None = None, now: datetime | None = None
                ) -> tuple[list[TenantQueue], list[ServiceQueue]]:
    """Return queue figures per tenant and per (tenant, service), restricted to ``tenant_ids``."""
    now = now or timezone.now()
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, slug FROM accs_tenant ORDER BY slug")
        tenants = {t: slug for t, slug in cur.fetchall() if tenant_ids is None or t in tenant_ids}
        cur.execute("SELECT id, key FROM accs_service")
        services = dict(cur.fetchall())
        per_tenant = {t: TenantQueue(tenant_id=str(t), tenant=slug) for t, slug in tenants.items()}
        per_service: dict[tuple[UUID, int], ServiceQueue] = {}

        def svc(tenant_id: UUID, service_id: int) -> ServiceQueue:
            key = (tenant_id, service_id)
            if key not in per_service:
                per_service[key] = ServiceQueue(tenant=tenants.get(tenant_id, str(tenant_id)),
                                                service=services.get(service_id, str(service_id)))
            return per_service[key]

        where, params = _tenant_filter("t.tenant_id", tenant_ids)
        cur.execute(ACTIVE_TASKS_SQL.format(tenants=where), {"now": now, **params})
        for tenant_id, service_id, status, n, retrying, oldest in cur.fetchall():
            row, card = svc(tenant_id, service_id), per_tenant.get(tenant_id)
            setattr(row, status, n)
            row.retrying += retrying
            age = (now - oldest).total_seconds() if oldest else None
            row.oldest_queued_age = _max_age(row.oldest_queued_age, age)
            if card:
                if status == "queued":
                    card.queued += n
                else:
                    card.running += n
                card.retrying += retrying
                card.oldest_queued_age = _max_age(card.oldest_queued_age, age)
        where, params = _tenant_filter("j.tenant_id", tenant_ids)
        cur.execute(WAITING_TASKS_SQL.format(tenants=where), params)
        for tenant_id, service_id, n in cur.fetchall():
            svc(tenant_id, service_id).waiting = n
            if tenant_id in per_tenant:
                per_tenant[tenant_id].waiting += n
        cur.execute(ADMITTED_JOBS_SQL.format(tenants=where), params)
        for tenant_id, waiting, running in cur.fetchall():
            if tenant_id in per_tenant:
                per_tenant[tenant_id].jobs_waiting, per_tenant[tenant_id].jobs_running = waiting, running
        cur.execute(QUEUED_JOBS_SQL.format(tenants=where), {"now": now, **params})
        for tenant_id, n, pending, oldest_due in cur.fetchall():
            card = per_tenant.get(tenant_id)
            if card:
                card.jobs_queued, card.awaiting_approval = n, pending
                # A due job the builder has not instantiated yet is queued work too.
                card.oldest_queued_age = _max_age(card.oldest_queued_age,
                                                  (now - oldest_due).total_seconds() if oldest_due else None)
        ids = [str(t) for t in tenants]
        cur.execute(FAILED_JOBS_SQL, {"since": now - FAILED_WINDOW, "ids": ids})
        for tenant_id, failed in cur.fetchall():
            per_tenant[tenant_id].failed_24h = failed
        cur.execute(DEAD_LETTER_SQL, {"ids": ids})
        for tenant_id, service_id, n in cur.fetchall():
            svc(tenant_id, service_id).dead_letter = n
            per_tenant[tenant_id].dead_letter += n
    rows = sorted(per_service.values(), key=lambda r: (r.tenant, r.service))
    return list(per_tenant.values()), rows


# --------------------------------------------------------------------------------------------
# Latency, run time, throughput: the newest attempts only
# --------------------------------------------------------------------------------------------

RECENT_STATS_SQL = """
-- The newest attempts by primary key (attempt ids grow with claim time), then only those started
-- inside the window: a bounded read whatever the size of accs_attempt.
WITH recent AS (
    SELECT a.task_id, a.attempt_no, a.status, a.started_at, a.finished_at
      FROM accs_attempt a ORDER BY a.id DESC LIMIT %(sample)s
), r AS (
    SELECT r.*, t.service_id,
           -- Queue latency (claim time − time the task became claimable) is known for the task's
           -- current attempt only: a later retry moves next_attempt_at.
           CASE WHEN r.attempt_no = t.attempt AND t.next_attempt_at <= r.started_at
                THEN extract(epoch FROM r.started_at - t.next_attempt_at) END AS latency,
           CASE WHEN r.finished_at IS NOT NULL AND r.status IN ('succeeded', 'failed', 'timeout')
                THEN extract(epoch FROM r.finished_at - r.started_at) END AS run_time
      FROM recent r JOIN accs_task t ON t.id = r.task_id
     WHERE r.started_at >= %(since)s AND {tenants}
)
SELECT service_id, count(*), count(*) FILTER (WHERE finished_at IS NOT NULL),
       count(*) FILTER (WHERE status IN ('failed', 'timeout')),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY latency), percentile_cont(0.95) WITHIN GROUP (ORDER BY latency),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY run_time), percentile_cont(0.95) WITHIN GROUP (ORDER BY run_time),
       min(started_at)
  FROM r GROUP BY ROLLUP (service_id)
"""


@dataclass
class Timing:
    """Latency and throughput over the recent window (overall, or of one service)."""

    service: str
    attempts: int = 0
    finished: int = 0
    failed: int = 0
    per_minute: float = 0.0
    latency_p50: float | None = None
    latency_p95: float | None = None
    run_p50: float | None = None
    run_p95: float | None = None


@dataclass
class RecentStats:
    """Timings overall and per service; ``window_seconds`` is what the sample actually covers."""

    window_seconds: float
    sampled: bool
    overall: Timing
    services: list[Timing]


def recent_stats(*, tenant_ids: set[UUID] | None = None, now: datetime | None = None,
                 sample: int = ATTEMPT_SAMPLE, window: timedelta = RECENT_WINDOW) -> RecentStats:
    """Return p50/p95 queue latency and run time, and throughput, over the recent window."""
    now = now or timezone.now()
    since = now - window
    where, params = _tenant_filter("t.tenant_id", tenant_ids)
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, key FROM accs_service")
        services = dict(cur.fetchall())
        cur.execute(RECENT_STATS_SQL.format(tenants=where), {"sample": sample, "since": since, **params})
        rows = cur.fetchall()
    overall = Timing(service="")
    per: list[Timing] = []
    oldest: datetime | None = None
    for service_id, n, finished, failed, l50, l95, r50, r95, first in rows:
        timing = Timing(service=services.get(service_id, str(service_id)) if service_id else "", attempts=n,
                        finished=finished, failed=failed, latency_p50=l50, latency_p95=l95, run_p50=r50, run_p95=r95)
        if service_id is None:
            overall, oldest = timing, first
        else:
            per.append(timing)
    # A full sample that does not reach back to the window start covers less than the window.
    sampled = overall.attempts >= sample
    start = max(since, oldest) if (sampled and oldest) else since
    span = max((now - start).total_seconds(), 1.0)
    for timing in [overall, *per]:
        timing.per_minute = timing.finished * 60.0 / span
    return RecentStats(window_seconds=span, sampled=sampled, overall=overall,
                       services=sorted(per, key=lambda t: t.service))


# --------------------------------------------------------------------------------------------
# Nodes, disk, governor, recent failures
# --------------------------------------------------------------------------------------------

NODES_SQL = """
SELECT n.name, n.state, n.presence, n.awake_state, n.last_seen, n.version, n.services, n.labels, n.disk_level,
       n.agent_id, d.used_pct, d.level, d.ts, d.path
  FROM accs_node n
  LEFT JOIN LATERAL (SELECT used_pct, level, ts, path FROM accs_disk_sample s
                      WHERE s.node_id = n.name ORDER BY s.ts DESC LIMIT 1) d ON TRUE
 ORDER BY n.name
"""


@dataclass
class NodeHealth:
    """A node's presence, drain state and disk, as an operator needs them at a glance.

    ``presence`` is what the agents said (online, offline after a clean stop, lost once the
    builder noticed the silence); ``stale`` flags an online node whose heartbeat is already
    overdue, before the builder marks it lost.
    """

    name: str
    state: str
    presence: str
    awake_state: str
    last_seen: datetime | None
    seen_ago: float | None
    stale: bool
    version: str
    services: list[str]
    labels: dict[str, Any]
    running: int
    disk_level: str
    disk_used_pct: float | None
    disk_path: str
    disk_sampled_at: datetime | None
    agent_id: str

    @property
    def live(self) -> bool:
        """Whether an agent on this node claims work now: online and active."""
        return self.presence == "online" and self.state == "active"

    @property
    def other_release(self) -> bool:
        """Whether its agent last registered with another release than this code's (or with none)."""
        return self.version != VERSION


def node_health(*, now: datetime | None = None) -> list[NodeHealth]:
    """Return every node with its presence, last heartbeat (overdue ones flagged), held tasks and disk."""
    now = now or timezone.now()
    stale_after = stale_after_seconds()
    with read_connection().cursor() as cur:
        # Held tasks only: task_held_service_idx / task_lease_idx (partial).
        cur.execute("SELECT node, count(*) FROM accs_task WHERE status IN ('starting', 'running') GROUP BY node")
        held = dict(cur.fetchall())
        cur.execute(NODES_SQL)
        rows = cur.fetchall()
    out = []
    for (name, state, presence, awake, last_seen, version, services, labels, disk_level, agent_id, pct, level, ts,
         path) in rows:
        ago = (now - last_seen).total_seconds() if last_seen else None
        services, labels = _json(services), _json(labels)
        out.append(NodeHealth(
            name=name, state=state, presence=presence, awake_state=awake, last_seen=last_seen, seen_ago=ago,
            stale=presence == "online" and awake != "sleep" and (ago is None or ago > stale_after), version=version,
            services=list(services) if isinstance(services, list) else [],
            labels=labels if isinstance(labels, dict) else {}, running=held.get(name, 0),
            disk_level=level or disk_level or "ok", disk_used_pct=pct, disk_path=path or "", disk_sampled_at=ts,
            agent_id=agent_id,
        ))
    return out


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


@dataclass
class Condition:
    """A governor condition and whether it holds now."""

    name: str
    holds: bool
    reason: str
    raised_at: datetime | None
    expires_at: datetime | None
    cleared_at: datetime | None
    raised_by: str

    @property
    def paused_service(self) -> str | None:
        """The service this condition pauses (``pause-<key>``), None for any other condition."""
        return paused_service_key(self.name)

    @property
    def paused_tenant(self) -> UUID | None:
        """The tenant this condition pauses (``tenant-pause-<id>``), None for any other condition."""
        return paused_tenant_id(self.name)


@dataclass
class PausedTenant:
    """A tenant an operator paused: no agent claims its tasks until it is resumed or the pause ends."""

    tenant_id: str
    tenant: str
    reason: str
    raised_by: str
    raised_at: datetime | None
    expires_at: datetime | None


def paused_tenants(conditions: list[Condition], *, tenant_ids: set[UUID] | None = None) -> list[PausedTenant]:
    """Return the tenants whose pause holds among ``conditions`` (those in ``tenant_ids``, None: all), by slug."""
    pauses = {c.paused_tenant: c for c in conditions if c.holds and c.paused_tenant is not None}
    if tenant_ids is not None:
        pauses = {k: c for k, c in pauses.items() if k in tenant_ids}
    if not pauses:
        return []
    slugs = dict(Tenant.objects.filter(pk__in=list(pauses)).values_list("pk", "slug"))
    return sorted((PausedTenant(tenant_id=str(k), tenant=slugs[k], reason=c.reason, raised_by=c.raised_by,
                                raised_at=c.raised_at, expires_at=c.expires_at)
                   for k, c in pauses.items() if k in slugs), key=lambda p: p.tenant)


def governor_conditions(*, now: datetime | None = None) -> list[Condition]:
    """Return the governor conditions, those holding first."""
    now = now or timezone.now()
    out = [Condition(name=c.name, holds=c.holds(now), reason=c.reason, raised_at=c.raised_at, expires_at=c.expires_at,
                     cleared_at=c.cleared_at, raised_by=c.raised_by) for c in GovernorCondition.objects.all()]
    return sorted(out, key=lambda c: (not c.holds, c.name))


RECENT_FAILURES_SQL = """
-- Failed attempts among the newest ones (primary key order): bounded, whatever the history size.
WITH recent AS (
    SELECT a.id, a.task_id, a.attempt_no, a.status, a.node, a.finished_at, a.exit_code, a.error_text
      FROM accs_attempt a ORDER BY a.id DESC LIMIT %(sample)s
)
SELECT r.finished_at, t.job_id, t.id, t.task_key, s.key, r.node, r.attempt_no, t.max_attempts, r.status,
       r.exit_code, r.error_text, (t.status = 'error' AND t.attempt = r.attempt_no) AS final, tn.slug
  FROM recent r JOIN accs_task t ON t.id = r.task_id JOIN accs_service s ON s.id = t.service_id
  JOIN accs_tenant tn ON tn.id = t.tenant_id
 WHERE r.status IN ('failed', 'timeout') AND {tenants}
 ORDER BY r.id DESC LIMIT %(limit)s
"""


@dataclass
class Failure:
    """One failed attempt; ``final`` when it made its task a dead letter."""

    at: datetime | None
    job_id: str
    task_id: str
    task_key: str
    service: str
    node: str
    attempt: int
    max_attempts: int
    status: str
    exit_code: int | None
    error: str
    final: bool
    tenant: str

    @property
    def said(self) -> str:
        """The attempt's end in one phrase, ``failed (exit 1): disk full``: the exit code said once."""
        return attempt_end_words(self.status, self.exit_code, self.error)


def attempt_end_words(status: str, exit_code: int | None, error: str) -> str:
    """Say how an attempt ended: its status, its exit code, then its error without repeating the code.

    Executors start a process's error with its exit code (``exit code 1: …``); said after
    ``failed (exit 1)`` it would be said twice.
    """
    head = f"{status} (exit {exit_code})" if exit_code is not None else status
    if exit_code is not None:
        error = re.sub(rf"^\s*exit(?: code)? {exit_code}\s*(?::\s*|$)", "", error or "")
    return f"{head}: {error}" if error else head


def recent_failures(*, tenant_ids: set[UUID] | None = None, limit: int = 10,
                    sample: int = ATTEMPT_SAMPLE) -> list[Failure]:
    """Return the newest failed attempts (retried or final)."""
    where, params = _tenant_filter("t.tenant_id", tenant_ids)
    with read_connection().cursor() as cur:
        cur.execute(RECENT_FAILURES_SQL.format(tenants=where), {"sample": sample, "limit": limit, **params})
        return [Failure(at=r[0], job_id=str(r[1]), task_id=str(r[2]), task_key=r[3], service=r[4], node=r[5],
                        attempt=r[6], max_attempts=r[7], status=r[8], exit_code=r[9], error=(r[10] or "")[:300],
                        final=bool(r[11]), tenant=r[12]) for r in cur.fetchall()]


# --------------------------------------------------------------------------------------------
# Why isn't it moving?
# --------------------------------------------------------------------------------------------

STUCK_QUEUED_SQL = """
-- Queued tasks (and retries waiting out their backoff) per tenant and service, with those bound
-- to a quarantined host. One branch per partial index, each branch's condition being exactly the
-- index's (task_claim_idx, task_claim_host_idx, task_scheduled_idx), so the planner reads those
-- small indexes rather than walking an index over every task ever created.
WITH q AS (
    SELECT t.tenant_id, t.service_id, NULL::bigint AS host_id
      FROM accs_task t WHERE t.status = 'queued' AND t.host_id IS NULL AND {tenants}
    UNION ALL
    SELECT t.tenant_id, t.service_id, t.host_id
      FROM accs_task t WHERE t.status = 'queued' AND t.host_id IS NOT NULL AND {tenants}
    UNION ALL
    SELECT t.tenant_id, t.service_id, t.host_id
      FROM accs_task t WHERE t.status = 'scheduled' AND {tenants}
    UNION ALL
    -- Narrow starts not widened yet (jobs.narrow): queued tasks bound to no host (a start's id is its job's).
    SELECT t.tenant_id, t.service_id, NULL::bigint
      FROM (SELECT s.id AS job_id, s.tenant_id, s.service_id FROM accs_start s) t WHERE {tenants}
)
SELECT q.tenant_id, q.service_id, count(*), count(*) FILTER (WHERE h.status = 'error'),
       (array_agg(DISTINCT h.name) FILTER (WHERE h.status = 'error'))[1:5]
  FROM q LEFT JOIN accs_host h ON h.id = q.host_id
 GROUP BY 1, 2
"""

HELD_BY_SERVICE_SQL = """
-- Held tasks per service in every tenant (a global cap counts them all): the partial indexes of
-- held tasks (task_held_service_idx, task_held_node_idx) hold only these rows.
SELECT t.service_id, count(*) FROM accs_task t WHERE t.status IN ('starting', 'running') GROUP BY 1
"""


FLOW_SAMPLE = 10_000  # queued tasks read per service to tell which limit holds them back

FLOW_SQL = f"""
-- The services with flow control: starts in their rate window, keys at their limits, and the
-- queued tasks each limit holds back per tenant (the first FLOW_SAMPLE per service, so a huge
-- backlog costs a bounded read). Keys are read from params as the claim reads them.
WITH s AS (
    SELECT id, key, rate_limit, rate_period_seconds AS period, rate_key, rate_key_limit, concurrency_key,
           concurrency_key_limit
      FROM accs_service WHERE rate_limit > 0 OR rate_key_limit > 0 OR concurrency_key_limit > 0
), starts AS (
    SELECT r.service_id, r.key FROM accs_rate_start r JOIN s ON s.id = r.service_id
     WHERE r.at > now() - make_interval(secs => s.period)
), rfull AS (
    SELECT st.service_id, st.key FROM starts st JOIN s ON s.id = st.service_id
     WHERE s.rate_key_limit > 0 AND st.key IS NOT NULL GROUP BY 1, 2 HAVING count(*) >= min(s.rate_key_limit)
), cfull AS (
    SELECT h.service_id, {params_key_sql('h', 's.concurrency_key')} AS key
      FROM accs_task h JOIN s ON s.id = h.service_id
     WHERE s.concurrency_key_limit > 0 AND h.status IN ('starting', 'running')
     GROUP BY 1, 2 HAVING count(*) >= min(s.concurrency_key_limit)
), q AS (
    SELECT s.id AS service_id, t.tenant_id,
           EXISTS (SELECT 1 FROM rfull f WHERE f.service_id = s.id
                      AND f.key = {params_key_sql('t', 's.rate_key')}) AS on_key_rate,
           EXISTS (SELECT 1 FROM cfull f WHERE f.service_id = s.id
                      AND f.key = {params_key_sql('t', 's.concurrency_key')}) AS on_key_cap
      FROM s CROSS JOIN LATERAL (SELECT t.tenant_id, t.params FROM accs_task t
                                  WHERE t.service_id = s.id AND t.status = 'queued' AND {{tenants}}
                                  LIMIT %(sample)s) t
)
SELECT s.key, s.rate_limit, s.period, s.rate_key, s.rate_key_limit, s.concurrency_key, s.concurrency_key_limit,
       (SELECT count(*) FROM starts WHERE starts.service_id = s.id),
       (SELECT count(*) FROM rfull WHERE rfull.service_id = s.id),
       (SELECT count(*) FROM cfull WHERE cfull.service_id = s.id),
       q.tenant_id, count(q.service_id), count(*) FILTER (WHERE q.on_key_rate), count(*) FILTER (WHERE q.on_key_cap)
  FROM s LEFT JOIN q ON q.service_id = s.id
 GROUP BY s.id, s.key, s.rate_limit, s.period, s.rate_key, s.rate_key_limit, s.concurrency_key,
          s.concurrency_key_limit, q.tenant_id
 ORDER BY s.key
"""


@dataclass
class FlowLimit:
    """A service's rate limits and per-key cap right now, and the queued tasks each holds back.

    ``starts_left`` is what the service-wide rate limit still allows in its window (None: no
    such limit); ``waiting_*`` count queued tasks held back by each limit, ``by_tenant`` the
    same per tenant slug.
    """

    service: str
    rate_limit: int
    period_seconds: int
    started: int
    starts_left: int | None
    rate_key: str
    rate_key_limit: int
    keys_at_rate_limit: int
    concurrency_key: str
    concurrency_key_limit: int
    keys_at_cap: int
    queued: int = 0
    waiting_on_rate: int = 0
    waiting_on_key_rate: int = 0
    waiting_on_key_cap: int = 0
    by_tenant: dict[str, dict[str, int]] = field(default_factory=dict)


def _task_filter(tenant_ids: set[UUID] | None, job_id: UUID | None) -> tuple[str, dict[str, Any]]:
    """Return the SQL condition on queued tasks ``t``: one job's (its page), or the viewer's tenants'."""
    if job_id is not None:
        return "t.job_id = %(job)s", {"job": str(job_id)}  # task_job_open_idx (queued tasks)
    return _tenant_filter("t.tenant_id", tenant_ids)


def flow_limits(*, tenant_ids: set[UUID] | None = None, job_id: UUID | None = None) -> list[FlowLimit]:
    """Return the flow-control state of every service that has a rate limit or a per-key cap.

    The queued tasks counted are the viewer's tenants' (``tenant_ids``), or one job's (``job_id``).
    """
    where, params = _task_filter(tenant_ids, job_id)
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, slug FROM accs_tenant")
        slugs = dict(cur.fetchall())
        cur.execute(FLOW_SQL.format(tenants=where), {**params, "sample": FLOW_SAMPLE})
        rows = cur.fetchall()
    out: dict[str, FlowLimit] = {}
    for (key, rate, period, rkey, rkey_limit, ckey, ckey_limit, started, keys_rate, keys_cap, tenant_id,
         queued, on_key_rate, on_key_cap) in rows:
        left = max(rate - started, 0) if rate else None
        flow = out.setdefault(key, FlowLimit(key, rate, period, started, left, rkey, rkey_limit, keys_rate, ckey,
                                             ckey_limit, keys_cap))
        if not queued:
            continue
        on_rate = queued if left == 0 else 0
        counts = {"queued": queued, "rate_limit": on_rate, "key_rate_limit": on_key_rate, "key_cap": on_key_cap}
        flow.by_tenant[slugs.get(tenant_id, str(tenant_id))] = counts
        flow.queued += queued
        flow.waiting_on_rate += on_rate
        flow.waiting_on_key_rate += on_key_rate
        flow.waiting_on_key_cap += on_key_cap
    return list(out.values())


class Stuck:
    """Why queued tasks of a service are not claimed (the ``reason`` of a :class:`StuckReason`)."""

    NO_AGENT = "no_agent"  # no node that is online and active serves the service
    SUSPECT = "suspect"  # every live node serving it has missed its last heartbeats
    DRAINING = "draining"  # every node serving it is draining
    LABELS = "labels"  # live agents serve it, but none has the labels it requires
    GOVERNOR = "governor"  # a governor condition it is blocked during holds
    PAUSED = "paused"  # an operator paused the service
    AT_CAP = "at_cap"  # as many of its tasks run as its global cap allows
    QUARANTINED_HOST = "quarantined_host"  # tasks bound to a host in quarantine
    RATE_LIMIT = "rate_limit"  # the service used every start its rate limit allows in the window
    KEY_RATE_LIMIT = "key_rate_limit"  # their key used every start its per-key rate limit allows
    KEY_CAP = "key_cap"  # their key holds as many tasks as the per-key cap allows
    # Reasons of one job (its page), beside the tasks' reasons above:
    APPROVAL = "approval"  # the job waits for approval
    SCHEDULED = "scheduled"  # the job is due later
    ADMISSION = "admission"  # the job is due and waits for admission (a cap, or the builder)
    BACKOFF = "backoff"  # a task waits out its backoff before its next attempt


@dataclass
class StuckReason:
    """One reason queued work does not move: a sentence for people and its figures.

    ``tenant`` is set when the tasks concerned belong to one tenant; ``count`` is how many
    tasks the reason holds back; ``detail`` says what to look at or do; ``links`` lead to the
    causes and the tasks held back (``{"label", "url"}`` each: the node, the condition, the tasks).
    """

    service: str
    tenant: str
    reason: str
    count: int
    message: str
    detail: str
    links: list[dict[str, str]] = field(default_factory=list)


def _tasks(n: int) -> str:
    return f"{n} task" if n == 1 else f"{n} tasks"


def _link(label: str, url: str) -> dict[str, str]:
    return {"label": label, "url": url}


def _held_tasks_link(service_id: int, job_id: UUID | None) -> dict[str, str]:
    """Link the tasks list filtered to a service's queued tasks (and one job's, on its page)."""
    url = f"{reverse('admin:jobs_task_changelist')}?service__id__exact={service_id}&status__in=queued%2Cscheduled"
    return _link("the tasks", url + (f"&q={job_id}" if job_id else ""))


def _node_link(name: str) -> dict[str, str]:
    return _link(f"node {name}", reverse("admin:nodes_node_change", args=[name]))


def _condition_link(name: str) -> dict[str, str]:
    return _link(f"condition {name}", f"{reverse('admin:workflows_governorcondition_changelist')}?q={name}")


def _silent_for(nodes: list[NodeHealth]) -> str:
    """Say how long the most recently seen of ``nodes`` has been silent."""
    ages = [n.seen_ago for n in nodes if n.seen_ago is not None]
    return f"has not been seen for {human_age(min(ages))}" if ages else "has never been seen"


def _suspect_words(key: str, suspects: list[NodeHealth], *, show_nodes: bool) -> tuple[str, str]:
    """The message and detail of tasks that only suspect nodes serve."""
    names = ", ".join(n.name for n in suspects)
    if len(suspects) == 1:
        who = f"the only node serving it, {names}," if show_nodes else "the only node serving it"
    else:
        who = f"every node serving it ({names})" if show_nodes else "every node serving it"
    lost_after = human_age(accs.node_lost_after_sec)
    detail = (f"its agent may be dead or cut off: the builder marks it lost after {lost_after} of silence and its "
              f"running tasks are rescued when their leases expire; start an agent serving '{key}' elsewhere "
              f"(manage.py runagent --services {key})")
    return "{tasks} of '{key}' wait: " + f"{who} {_silent_for(suspects)}", detail


def _node_words(node: NodeHealth) -> str:
    """Describe why a node serving a service does not claim it, e.g. ``edge-2 (lost, seen 12 min ago)``."""
    words = [node.presence] if node.presence != "online" else []
    if node.state != "active":
        words.append(node.state)
    seen = "never seen" if node.seen_ago is None else f"seen {human_age(node.seen_ago)} ago"
    return f"{node.name} ({', '.join(words + [seen])})"


def stuck_reasons(*, nodes: list[NodeHealth], conditions: list[Condition], tenant_ids: set[UUID] | None = None,
                  show_nodes: bool = True, flow: list[FlowLimit] | None = None,
                  job_id: UUID | None = None) -> list[StuckReason]:
    """Return why queued tasks are not claimed: per service, each reason with the tasks it holds back.

    A service is served live by a node that is online and active and lists it among its services.
    ``show_nodes`` False leaves node names out of the details (viewers without infrastructure rights).
    With ``job_id`` the tasks are that job's only (the job and task pages ask this way).
    """
    with read_connection().cursor() as cur:
        cur.execute("SELECT id, slug FROM accs_tenant")
        slugs = dict(cur.fetchall())
        cur.execute("SELECT id, key, max_concurrent, block_during, required_labels FROM accs_service")
        services = {r[0]: r[1:] for r in cur.fetchall()}
        where, params = _task_filter(tenant_ids, job_id)
        cur.execute(STUCK_QUEUED_SQL.format(tenants=where), params)
        queued_rows = cur.fetchall()
        held: dict[int, int] = {}
        if queued_rows:
            cur.execute(HELD_BY_SERVICE_SQL)
            held = dict(cur.fetchall())
    queued: dict[int, dict[str, int]] = defaultdict(dict)  # service → tenant slug → tasks
    quarantined: dict[int, dict[str, int]] = defaultdict(dict)
    quarantined_hosts: dict[int, set[str]] = defaultdict(set)
    for tenant_id, service_id, n, on_quarantined, hosts in queued_rows:
        slug = slugs.get(tenant_id, str(tenant_id))
        queued[service_id][slug] = n
        if on_quarantined:
            quarantined[service_id][slug] = on_quarantined
            quarantined_hosts[service_id].update(hosts or [])
    holding = {c.name: c for c in conditions if c.holds}
    tenant_pauses = {slugs.get(c.paused_tenant, ""): c for c in holding.values() if c.paused_tenant is not None}

    out: list[StuckReason] = []
    for service_id, per_tenant in queued.items():
        key, cap, block_during, required = services.get(service_id, (str(service_id), 0, [], {}))
        required = _json(required) or {}

        def add(reason: str, counts: dict[str, int], message: str, detail: str, key: str = key,
                links: tuple[dict[str, str], ...] = (), service_id: int = service_id) -> None:
            out.append(_reason(key, reason, counts, message, detail,
                               links=[*links, _held_tasks_link(service_id, job_id)]))

        serving = [n for n in nodes if key in n.services]
        live = [n for n in serving if n.live]
        if live and all(n.stale for n in live):
            message, detail = _suspect_words(key, live, show_nodes=show_nodes)
            add(Stuck.SUSPECT, per_tenant, message, detail,
                links=tuple(_node_link(n.name) for n in live) if show_nodes else ())
        elif not live and serving and all(n.state != "active" for n in serving):
            add(Stuck.DRAINING, per_tenant, "{tasks} queued for '{key}' and every node serving it is draining",
                ("undrain one: " + ", ".join(_node_words(n) for n in serving)) if show_nodes else
                "ask an operator to undrain a node serving it",
                links=tuple(_node_link(n.name) for n in serving) if show_nodes else ())
        elif not live:
            if not show_nodes:
                detail = "ask an operator to start an agent serving it"
            elif serving:
                detail = "nodes serving it: " + ", ".join(_node_words(n) for n in serving)
            else:
                detail = f"no node serves it; start one with manage.py runagent --services {key}"
            add(Stuck.NO_AGENT, per_tenant, "{tasks} queued for '{key}' and no live agent serves it", detail,
                links=tuple(_node_link(n.name) for n in serving) if show_nodes else ())
        elif required and not any(all(str(n.labels.get(k)) == str(v) for k, v in required.items()) for n in live):
            wanted = ", ".join(f"{k}={v}" for k, v in sorted(required.items()))
            add(Stuck.LABELS, per_tenant, "{tasks} queued for '{key}' and no live agent serving it has its labels",
                f"it requires {wanted}" + (f"; live: {', '.join(n.name for n in live)}" if show_nodes else ""))
        if (pause := holding.get(PAUSE_PREFIX + key)) is not None:
            until = f"until {pause.expires_at:%Y-%m-%d %H:%M}" if pause.expires_at else "until resumed"
            add(Stuck.PAUSED, per_tenant, "{tasks} queued for '{key}', which is paused",
                f"paused by {pause.raised_by or 'api'}" + (f" at {pause.raised_at:%Y-%m-%d %H:%M}" if pause.raised_at
                                                           else "") + f", {until}: {pause.reason}",
                links=(_link("resume it", f"{reverse('admin:workflows_service_changelist')}?q={key}"),)
                if show_nodes else ())
        for slug, n in sorted(per_tenant.items()):
            if (tpause := tenant_pauses.get(slug)) is not None:
                until = f"until {tpause.expires_at:%Y-%m-%d %H:%M}" if tpause.expires_at else "until resumed"
                add(Stuck.PAUSED, {slug: n}, f"{{tasks}} queued for '{{key}}' of tenant {slug}, which is paused",
                    f"paused by {tpause.raised_by or 'api'}, {until}: {tpause.reason}",
                    links=(_link("resume it", f"{reverse('admin:tenants_tenant_changelist')}?q={slug}"),))
        for name in block_during or []:
            if name in holding:
                c = holding[name]
                until = f"until {c.expires_at:%Y-%m-%d %H:%M}" if c.expires_at else "until cleared"
                add(Stuck.GOVERNOR, per_tenant,
                    f"{{tasks}} queued for '{{key}}' held back by governor condition '{name}'",
                    f"raised by {c.raised_by or 'api'}, {until}" + (f": {c.reason}" if c.reason else ""),
                    links=(_condition_link(name),) if show_nodes else ())
        if cap and held.get(service_id, 0) >= cap:
            add(Stuck.AT_CAP, per_tenant, "{tasks} queued for '{key}', which is at its global cap"
                f" ({held.get(service_id, 0)}/{cap} running)",
                "they start as running ones finish; the cap is the service's max_concurrent")
        if quarantined.get(service_id):
            hosts = sorted(quarantined_hosts[service_id])
            add(Stuck.QUARANTINED_HOST, quarantined[service_id],
                "{tasks} queued for '{key}' bound to quarantined hosts",
                f"clear the quarantine of {', '.join(hosts)}" + (" …" if len(hosts) >= 5 else "")
                + " (admin: Hosts)",
                links=(_link("quarantined hosts", f"{reverse('admin:nodes_host_changelist')}?status__exact=error"),)
                if show_nodes else ())
    out += _flow_reasons(flow if flow is not None else flow_limits(tenant_ids=tenant_ids, job_id=job_id))
    return sorted(out, key=lambda r: (r.service, r.reason, r.tenant))


def job_stuck_reasons(job: Any, *, show_nodes: bool = True, now: datetime | None = None) -> list[StuckReason]:
    """Return why a job, or its queued tasks, are not moving, each with what to do about it.

    The tasks' reasons are the dashboard's (:func:`stuck_reasons`, for this job's tasks only);
    before the job has tasks, the reason is its approval, its schedule or its admission cap.
    """
    now = now or timezone.now()
    target = job.target_name
    if job.status == "queued":
        return _job_queued_reasons(job, target=target, now=now)
    if job.status not in ("waiting", "running"):
        return []
    if not job.tasks.filter(status__in=("queued", "scheduled")).exists():  # task_job_open_idx
        return []  # nothing queued: a running job's page asks this on every refresh
    reasons = stuck_reasons(nodes=node_health(now=now), conditions=governor_conditions(now=now), job_id=job.pk,
                            show_nodes=show_nodes)
    backoff = list(job.tasks.filter(status="scheduled").order_by("next_attempt_at")
                   .values_list("task_key", "next_attempt_at", "attempt")[:5])
    for key, due, attempt in backoff:
        wait = (due - now).total_seconds()
        reasons.append(StuckReason(service=target, tenant="", reason=Stuck.BACKOFF, count=1,
                                   message=f"task {key} waits out its backoff after attempt {attempt} failed",
                                   detail=(f"it is due again in {human_age(wait)}" if wait > 0 else
                                           "it is due now; an agent serving it claims it at its next poll")
                                   + "; Retry on the task starts it at once"))
    return reasons


def _job_queued_reasons(job: Any, *, target: str, now: datetime) -> list[StuckReason]:
    """Why a job has no tasks yet: approval, a later schedule, or an admission cap that is full."""
    def reason(kind: str, message: str, detail: str) -> StuckReason:
        return StuckReason(service=target, tenant="", reason=kind, count=1, message=message, detail=detail)

    if job.approval_state == "pending":
        return [reason(Stuck.APPROVAL, "the job waits for approval",
                       "approve or reject it with the buttons above (a tenant admin or superuser)")]
    if job.scheduled_at and job.scheduled_at > now:
        when = f"{timezone.localtime(job.scheduled_at):%Y-%m-%d %H:%M}"
        return [reason(Stuck.SCHEDULED, f"the job is scheduled for {when}",
                       f"it starts in {human_age((job.scheduled_at - now).total_seconds())}")]
    out = []
    workflow = job.workflow if job.workflow_id else None
    if workflow is not None and workflow.max_active_jobs:
        active = type(job).objects.filter(workflow_id=workflow.pk, status__in=("waiting", "running")).count()
        if active >= workflow.max_active_jobs:
            out.append(reason(Stuck.ADMISSION, f"workflow {workflow} is at its cap ({active}/{workflow.max_active_jobs}"
                                               " jobs active)",
                              "it starts, oldest first, as active jobs of the workflow finish; the cap is the "
                              "workflow's max_active_jobs"))
    cap = job.tenant.max_in_flight
    if cap:
        active = type(job).objects.filter(tenant_id=job.tenant_id, status__in=("waiting", "running")).count()
        if active >= cap:
            out.append(reason(Stuck.ADMISSION, f"tenant {job.tenant.slug} is at its cap ({active}/{cap} jobs running)",
                              "it starts, oldest first, as the tenant's jobs finish; the cap is the tenant's "
                              "max_in_flight"))
    if not out:
        out.append(reason(Stuck.ADMISSION, "the job is due and waits for a builder to start it",
                          "a running builder (manage.py runbuilder) starts due jobs within seconds; if it stays, "
                          "check that one runs"))
    return out


def _flow_reasons(flow: list[FlowLimit]) -> list[StuckReason]:
    """Say which queued tasks wait on a rate limit or a per-key cap, per service and tenant."""
    out: list[StuckReason] = []
    for f in flow:
        period = human_age(f.period_seconds)
        said = {
            Stuck.RATE_LIMIT: (f"{{tasks}} queued for '{f.service}' wait for its rate limit"
                               f" ({f.started}/{f.rate_limit} starts in the last {period})",
                               "they start as the window moves on; the limit is the service's rate_limit"),
            Stuck.KEY_RATE_LIMIT: (f"{{tasks}} queued for '{f.service}' wait for their key's rate limit"
                                   f" ({f.keys_at_rate_limit} value(s) of {f.rate_key} at {f.rate_key_limit}"
                                   f" starts per {period})", "other keys still start; the limit is rate_key_limit"),
            Stuck.KEY_CAP: (f"{{tasks}} queued for '{f.service}' wait for their key's cap"
                            f" ({f.keys_at_cap} value(s) of {f.concurrency_key} at {f.concurrency_key_limit} running)",
                            "they start as running tasks of the same key finish; the cap is concurrency_key_limit"),
        }
        for reason, (message, detail) in said.items():
            counts = {slug: c[reason] for slug, c in f.by_tenant.items() if c[reason]}
            if counts:
                out.append(_reason(f.service, reason, counts, message, detail))
    return out


def _reason(service: str, reason: str, counts: dict[str, int], message: str, detail: str, *,
            links: list[dict[str, str]] | None = None) -> StuckReason:
    """Build one reason from the tasks it holds back per tenant (named when there is one tenant)."""
    n = sum(counts.values())
    tenant = next(iter(counts)) if len(counts) == 1 else ""
    if len(counts) > 1:
        split = " · ".join(f"{slug} {k}" for slug, k in sorted(counts.items()))
        detail = f"{detail} ({split})" if detail else split
    return StuckReason(service=service, tenant=tenant, reason=reason, count=n,
                       message=message.format(tasks=_tasks(n), key=service), detail=detail, links=links or [])


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------

@dataclass
class Overview:
    """The whole picture for one viewer (tenant-scoped unless ``tenant_ids`` is None)."""

    generated_at: datetime
    tenants: list[TenantQueue]
    services: list[ServiceQueue]
    totals: TenantQueue
    stats: RecentStats
    nodes: list[NodeHealth] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    stale_after: float = 0.0
    stuck: list[StuckReason] = field(default_factory=list)
    flow: list[FlowLimit] = field(default_factory=list)
    paused: list[Condition] = field(default_factory=list)  # the pauses of services that hold now
    paused_tenants: list[PausedTenant] = field(default_factory=list)  # the viewer's tenants paused now
    # The read replica's lag (accs_site.dbrouter.replica_lag), None without ACC_READ_DB_URL.
    replica: dict[str, Any] | None = None
    # The release of the code that read the picture (nodes show their own).
    version: str = VERSION

    def as_json(self) -> dict[str, Any]:
        """Return the overview as JSON-ready data (datetimes as ISO strings)."""
        def convert(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            if isinstance(value, list):
                return [convert(v) for v in value]
            return value

        return convert(asdict(self))


def overview(*, tenant_ids: set[UUID] | None = None, include_infra: bool = True,
             now: datetime | None = None) -> Overview:
    """Collect the dashboard's figures and why queued work is stuck; ``include_infra`` adds nodes and
    governor conditions (and names nodes in the stuck reasons)."""
    now = now or timezone.now()
    tenants, services = queue_depth(tenant_ids=tenant_ids, now=now)
    totals = TenantQueue(tenant_id="", tenant="all")
    for card in tenants:
        for name in ("jobs_queued", "awaiting_approval", "jobs_waiting", "jobs_running", "failed_24h", "waiting",
                     "queued", "running", "retrying", "dead_letter"):
            setattr(totals, name, getattr(totals, name) + getattr(card, name))
        totals.oldest_queued_age = _max_age(totals.oldest_queued_age, card.oldest_queued_age)
    # Nodes and conditions are read for everyone (the stuck reasons need them), shown to infra viewers only.
    nodes, conditions = node_health(now=now), governor_conditions(now=now)
    flow = flow_limits(tenant_ids=tenant_ids)
    return Overview(
        generated_at=now, tenants=tenants, services=services, totals=totals,
        stats=recent_stats(tenant_ids=tenant_ids, now=now),
        nodes=nodes if include_infra else [],
        conditions=conditions if include_infra else [],
        failures=recent_failures(tenant_ids=tenant_ids),
        stale_after=stale_after_seconds(),
        stuck=stuck_reasons(nodes=nodes, conditions=conditions, tenant_ids=tenant_ids, show_nodes=include_infra,
                            flow=flow),
        flow=flow,
        paused=[c for c in conditions if c.holds and c.paused_service],
        paused_tenants=paused_tenants(conditions, tenant_ids=tenant_ids),
        replica=replica_lag() if include_infra else None,
    )


def group_by_tenant(rows: list[ServiceQueue]) -> dict[str, list[ServiceQueue]]:
    """Group service rows under their tenant slug (for templates)."""
    out: dict[str, list[ServiceQueue]] = defaultdict(list)
    for row in rows:
        out[row.tenant].append(row)
    return dict(out)
