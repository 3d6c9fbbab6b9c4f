"""What the system looks like now: the read model behind the dashboard, ``accs_status`` and /metrics.

Every query here must stay cheap when the tables hold millions of rows, so each one reads only
the live part of the data through a partial index or a bounded window:

* active tasks (queued / starting / running) through ``task_claim_idx`` and the held-task indexes;
* waiting tasks through running jobs (``job_workflow_running_idx`` holds exactly those);
* failed jobs and dead letters through the jobs in ``error`` (``job_tenant_status_created_idx``);
* latency, run time, throughput and recent failures from the newest attempts only
  (``ORDER BY id DESC LIMIT n`` on the primary key), never from a scan of the whole history.

No exact ``COUNT(*)`` over a whole table happens here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection
from django.utils import timezone

from accs_site.conf import accs

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
-- Only queued/starting/running rows: a BitmapOr over the partial indexes task_claim_idx (queued)
-- and task_lease_idx / task_held_service_idx (held), so the cost follows the live queue.
-- Retries waiting out their backoff (scheduled) count as queued and retrying.
SELECT t.tenant_id, t.service_id, CASE WHEN t.status = 'scheduled' THEN 'queued' ELSE t.status END, count(*),
       count(*) FILTER (WHERE t.status IN ('queued', 'scheduled') AND t.attempt > 0),
       min(t.next_attempt_at) FILTER (WHERE t.status = 'queued' AND t.next_attempt_at <= %(now)s)
  FROM accs_task t
 WHERE t.status IN ('queued', 'scheduled', 'starting', 'running') AND {tenants}
 GROUP BY 1, 2, 3
"""

WAITING_TASKS_SQL = """
-- Waiting tasks only exist in running jobs; job_workflow_running_idx holds exactly those jobs.
SELECT t.tenant_id, t.service_id, count(*)
  FROM accs_job j JOIN accs_task t ON t.job_id = j.id AND t.status = 'waiting'
 WHERE j.status = 'running' AND {tenants}
 GROUP BY 1, 2
"""

QUEUED_JOBS_SQL = """
-- Jobs not instantiated yet (due later, waiting for approval or for the builder): job_due_idx.
SELECT j.tenant_id, count(*), count(*) FILTER (WHERE j.approval_state = 'pending'),
       min(j.created_at) FILTER (WHERE j.scheduled_at <= %(now)s AND j.approval_state IN ('not_required', 'approved'))
  FROM accs_job j
 WHERE j.status = 'queued' AND {tenants}
 GROUP BY 1
"""

ERROR_JOBS_SQL = """
-- Jobs in error, per tenant (job_tenant_status_created_idx: tenant, status, created_at DESC), and
-- the dead letters inside them: tasks that failed for good (task_job_status_idx). Bounded by the
-- jobs in error, not by the jobs table.
SELECT j.tenant_id,
       count(DISTINCT j.id) FILTER (WHERE j.finished_at >= %(since)s),
       count(t.id)
  FROM accs_job j LEFT JOIN accs_task t ON t.job_id = j.id AND t.status = 'error'
 WHERE j.tenant_id = ANY(%(ids)s::uuid[]) AND j.status = 'error'
 GROUP BY 1
"""

DEAD_LETTER_BY_SERVICE_SQL = """
SELECT t.tenant_id, t.service_id, count(*)
  FROM accs_job j JOIN accs_task t ON t.job_id = j.id AND t.status = 'error'
 WHERE j.tenant_id = ANY(%(ids)s::uuid[]) AND j.status = 'error'
 GROUP BY 1, 2
"""


@dataclass
class TenantQueue:
    """Queue figures of one tenant (the dashboard's summary cards)."""

    tenant_id: str
    tenant: str
    jobs_queued: int = 0
    awaiting_approval: int = 0
    waiting: int = 0
    queued: int = 0
    running: int = 0
    retrying: int = 0
    failed_24h: int = 0  # jobs that ended in error in the last 24 h
    dead_letter: int = 0
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
    with connection.cursor() as cur:
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
        cur.execute(QUEUED_JOBS_SQL.format(tenants=where), {"now": now, **params})
        for tenant_id, n, pending, oldest_due in cur.fetchall():
            card = per_tenant.get(tenant_id)
            if card:
                card.jobs_queued, card.awaiting_approval = n, pending
                # A due job the builder has not instantiated yet is queued work too.
                card.oldest_queued_age = _max_age(card.oldest_queued_age,
                                                  (now - oldest_due).total_seconds() if oldest_due else None)
        ids = [str(t) for t in tenants]
        cur.execute(ERROR_JOBS_SQL, {"since": now - FAILED_WINDOW, "ids": ids})
        for tenant_id, failed, dead in cur.fetchall():
            per_tenant[tenant_id].failed_24h, per_tenant[tenant_id].dead_letter = failed, dead
        cur.execute(DEAD_LETTER_BY_SERVICE_SQL, {"ids": ids})
        for tenant_id, service_id, n in cur.fetchall():
            svc(tenant_id, service_id).dead_letter = n
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
    with connection.cursor() as cur:
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
SELECT n.name, n.state, n.awake_state, n.last_seen, n.version, n.services, n.disk_level, n.agent_id,
       d.used_pct, d.level, d.ts, d.path
  FROM accs_node n
  LEFT JOIN LATERAL (SELECT used_pct, level, ts, path FROM accs_disk_sample s
                      WHERE s.node_id = n.name ORDER BY s.ts DESC LIMIT 1) d ON TRUE
 ORDER BY n.name
"""


@dataclass
class NodeHealth:
    """A node's heartbeat, drain state and disk, as an operator needs them at a glance."""

    name: str
    state: str
    awake_state: str
    last_seen: datetime | None
    seen_ago: float | None
    stale: bool
    version: str
    services: list[str]
    running: int
    disk_level: str
    disk_used_pct: float | None
    disk_path: str
    disk_sampled_at: datetime | None
    agent_id: str


def stale_after_seconds() -> float:
    """Return how old a heartbeat may be before a node is flagged: three missed beats (TTL/3 each)."""
    return 3 * accs.heartbeat_ttl_sec / 3


def node_health(*, now: datetime | None = None) -> list[NodeHealth]:
    """Return every node with its last heartbeat (stale ones flagged), held tasks and latest disk sample."""
    now = now or timezone.now()
    stale_after = stale_after_seconds()
    with connection.cursor() as cur:
        # Held tasks only: task_held_service_idx / task_lease_idx (partial).
        cur.execute("SELECT node, count(*) FROM accs_task WHERE status IN ('starting', 'running') GROUP BY node")
        held = dict(cur.fetchall())
        cur.execute(NODES_SQL)
        rows = cur.fetchall()
    out = []
    for name, state, awake, last_seen, version, services, disk_level, agent_id, pct, level, ts, path in rows:
        ago = (now - last_seen).total_seconds() if last_seen else None
        asleep = awake == "sleep"
        out.append(NodeHealth(
            name=name, state=state, awake_state=awake, last_seen=last_seen, seen_ago=ago,
            stale=not asleep and (ago is None or ago > stale_after), version=version,
            services=list(services or []) if isinstance(services, list) else [], running=held.get(name, 0),
            disk_level=level or disk_level or "ok", disk_used_pct=pct, disk_path=path or "", disk_sampled_at=ts,
            agent_id=agent_id,
        ))
    return out


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


def governor_conditions(*, now: datetime | None = None) -> list[Condition]:
    """Return the governor conditions, those holding first."""
    from workflows.models import GovernorCondition

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


def recent_failures(*, tenant_ids: set[UUID] | None = None, limit: int = 10,
                    sample: int = ATTEMPT_SAMPLE) -> list[Failure]:
    """Return the newest failed attempts (retried or final)."""
    where, params = _tenant_filter("t.tenant_id", tenant_ids)
    with connection.cursor() as cur:
        cur.execute(RECENT_FAILURES_SQL.format(tenants=where), {"sample": sample, "limit": limit, **params})
        return [Failure(at=r[0], job_id=str(r[1]), task_id=str(r[2]), task_key=r[3], service=r[4], node=r[5],
                        attempt=r[6], max_attempts=r[7], status=r[8], exit_code=r[9], error=(r[10] or "")[:300],
                        final=bool(r[11]), tenant=r[12]) for r in cur.fetchall()]


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
    """Collect the dashboard's figures; ``include_infra`` adds nodes and governor conditions."""
    now = now or timezone.now()
    tenants, services = queue_depth(tenant_ids=tenant_ids, now=now)
    totals = TenantQueue(tenant_id="", tenant="all")
    for card in tenants:
        for name in ("jobs_queued", "awaiting_approval", "waiting", "queued", "running", "retrying", "failed_24h",
                     "dead_letter"):
            setattr(totals, name, getattr(totals, name) + getattr(card, name))
        totals.oldest_queued_age = _max_age(totals.oldest_queued_age, card.oldest_queued_age)
    return Overview(
        generated_at=now, tenants=tenants, services=services, totals=totals,
        stats=recent_stats(tenant_ids=tenant_ids, now=now),
        nodes=node_health(now=now) if include_infra else [],
        conditions=governor_conditions(now=now) if include_infra else [],
        failures=recent_failures(tenant_ids=tenant_ids),
        stale_after=stale_after_seconds(),
    )


def human_age(seconds: float | None) -> str:
    """Format a duration for people: ``42 s``, ``7 min``, ``3 h 5 min``, ``2 d 4 h``."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = int(minutes // 60)
    if hours < 48:
        return f"{hours} h {int(minutes % 60)} min"
    return f"{hours // 24} d {hours % 24} h"


def group_by_tenant(rows: list[ServiceQueue]) -> dict[str, list[ServiceQueue]]:
    """Group service rows under their tenant slug (for templates)."""
    out: dict[str, list[ServiceQueue]] = defaultdict(list)
    for row in rows:
        out[row.tenant].append(row)
    return dict(out)
