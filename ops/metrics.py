"""Prometheus endpoint: ``/metrics``, read from the database at scrape time.

Agents and builders are separate processes (often on other machines), so counting in-process with
prometheus_client counters would only see the web process. Instead a custom collector reads
PostgreSQL when scraped:

* **Gauges** — queue depth by tenant/service/status, dead letters, oldest queued age, jobs by
  status, node heartbeats, drain state and disk use, governor conditions — come from
  :mod:`ops.overview`, which reads only the live part of the tables.
* **Counters and histograms** — claims, finished attempts by outcome, retries, dead letters, fenced
  reports, jobs started and finished, queue latency and run time — are derived from the timeline,
  which records every transition exactly once whichever process made it. The collector folds new
  events (by primary key, through the ``(id, ts)`` index of each partition) into running totals,
  so a scrape reads only what happened since the previous one. A fresh web process counts the
  history once (in bounded chunks) and then reports the same totals as every other process.

Events younger than :attr:`TimelineCounters.settle_seconds` are left for the next scrape: ids are
drawn before commit, so a row with a smaller id may still become visible after a larger one.

The endpoint is open unless ``ACC_METRICS_TOKEN`` is set; then it requires
``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from accs_site.conf import accs
from accs_site.version import VERSION
from ops.overview import flow_limits, governor_conditions, node_health, queue_depth
from tenants.models import Tenant
from workflows.governor import paused_service_key

#: Histogram buckets (seconds) for queue latency and run time.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0)


def _bucket_sql(value: str, bounds: tuple[float, ...], prefix: str) -> str:
    """Return ``count(*) FILTER (WHERE value <= b)`` columns, one per bucket bound (constants only)."""
    return ", ".join(f"count(*) FILTER (WHERE {value} <= {float(b)!r}) AS {prefix}{i}" for i, b in enumerate(bounds))


FOLD_SQL = f"""
-- Classify new timeline rows by their structured data (not their message text), then label each
-- with its service (task events) or tenant (job events). A task's row that folds its job's moves in
-- (jobs.finalize: "job_before", "job"; a claim's row, its job's creation from a narrow start:
-- "created") counts each of them as the job's own row would.
WITH e AS (
    SELECT e.id, e.ts, m.task_id, e.job_id, m.attempt, e.type,
           CASE
             WHEN e.type = 'fenced' THEN 'fenced'
             WHEN e.type = 'retry' THEN 'retry'
             WHEN m.task_id IS NOT NULL AND m.d->>'to' = 'starting' THEN 'claim'
             WHEN m.task_id IS NOT NULL AND m.d->>'to' = 'done' THEN 'done'
             WHEN m.task_id IS NOT NULL AND m.d->>'dead_letter' = 'true' THEN 'dead_letter'
             WHEN m.task_id IS NOT NULL AND m.attempt IS NOT NULL AND m.d->>'to' = 'canceled' THEN 'canceled'
             -- a job started: admitted from queued, or created already waiting (the one-statement start)
             WHEN m.task_id IS NULL AND e.job_id IS NOT NULL AND m.d->>'from' IN ('queued', 'created')
                  AND m.d->>'to' IN ('waiting', 'running') THEN 'job_started'
             WHEN m.task_id IS NULL AND e.job_id IS NOT NULL
                  AND m.d->>'to' IN ('done', 'partial', 'error', 'canceled', 'rejected')
             THEN 'job_' || (m.d->>'to')
           END AS kind
      FROM accs_event e
     CROSS JOIN LATERAL (
         SELECT e.task_id, e.attempt, e.data AS d
         UNION ALL
         SELECT NULL, NULL, j.move
           FROM jsonb_array_elements(CASE WHEN e.task_id IS NOT NULL AND e.type = 'status'
                                          THEN coalesce(e.data->'job_before', '[]') || coalesce(e.data->'job', '[]')
                                               || CASE WHEN e.data ? 'created'
                                                       THEN '[{{"from": "created", "to": "waiting"}}]'::jsonb
                                                       ELSE '[]' END
                                          ELSE '[]' END) AS j(move)
     ) m
     WHERE e.id > %(lo)s AND e.id <= %(hi)s
), k AS (
    SELECT e.*, s.key AS service, tn.slug AS tenant,
           -- claim: time from claimable to claimed, known while the task is still on that attempt
           CASE WHEN e.kind = 'claim' AND e.attempt = t.attempt AND t.next_attempt_at <= e.ts
                THEN extract(epoch FROM e.ts - t.next_attempt_at) END AS latency,
           CASE WHEN e.kind IN ('done', 'retry', 'dead_letter') AND a.finished_at IS NOT NULL
                THEN extract(epoch FROM a.finished_at - a.started_at) END AS run_time
      FROM e
      LEFT JOIN accs_task t ON t.id = e.task_id
      LEFT JOIN accs_service s ON s.id = t.service_id
      LEFT JOIN accs_job j ON j.id = e.job_id AND e.task_id IS NULL
      LEFT JOIN accs_tenant tn ON tn.id = j.tenant_id
      LEFT JOIN accs_attempt a ON a.task_id = e.task_id AND a.attempt_no = e.attempt
                              AND e.kind IN ('done', 'retry', 'dead_letter')
     WHERE e.kind IS NOT NULL
)
SELECT kind, coalesce(service, ''), coalesce(tenant, ''), count(*),
       count(latency), coalesce(sum(latency), 0), {_bucket_sql("latency", LATENCY_BUCKETS, "l")},
       count(run_time), coalesce(sum(run_time), 0), {_bucket_sql("run_time", RUN_BUCKETS, "r")}
  FROM k GROUP BY 1, 2, 3
"""


@dataclass
class _Histogram:
    buckets: list[int]
    count: int = 0
    total: float = 0.0

    def add(self, count: int, total: float, buckets: tuple[int, ...]) -> None:
        self.count += count
        self.total += float(total)
        self.buckets = [a + b for a, b in zip(self.buckets, buckets, strict=True)]


@dataclass
class TimelineCounters:
    """The totals folded from the timeline, kept in the database (``accs_metric_totals``, one row).

    A scrape takes the row's lock (or, when another process holds it, reads the row as it stands),
    folds the settled events after its watermark, at most ``chunk`` events per statement and for
    ``budget_seconds``, and writes the totals back. So a scrape reads only what happened since the
    previous one, whichever process answers it, and a new process recounts nothing.
    """

    settle_seconds: float = 5.0
    chunk: int = 50_000
    budget_seconds: float = 0.5
    watermark: int = 0
    counts: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    latency: dict[str, _Histogram] = field(default_factory=dict)
    run_time: dict[str, _Histogram] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fold(self) -> int:
        """Fold the events settled since the stored watermark into the stored totals; return the new watermark."""
        # On the primary and in one transaction: the row is written back, and the events read must be
        # the primary's (a replica may lag behind the watermark).
        with self.lock, transaction.atomic(using=DEFAULT_DB_ALIAS), connections[DEFAULT_DB_ALIAS].cursor() as cur:
            cur.execute("SELECT watermark, totals FROM accs_metric_totals WHERE id = 1 FOR UPDATE SKIP LOCKED")
            row = cur.fetchone()
            if row is None:
                cur.execute("SELECT watermark, totals FROM accs_metric_totals WHERE id = 1")
                row = cur.fetchone()
                if row is not None:  # another process is folding: report the totals as they stand
                    self._load(*row)
                    return self.watermark
                # No row (a flushed test database): count from the first event.
                cur.execute("INSERT INTO accs_metric_totals (id, watermark, totals, updated_at)"
                            " VALUES (1, 0, '{}', now()) ON CONFLICT (id) DO NOTHING")
                cur.execute("SELECT watermark, totals FROM accs_metric_totals WHERE id = 1 FOR UPDATE")
                row = cur.fetchone()
            self._load(*row)
            start = self.watermark
            # The newest settled event: a backward walk of each partition's (id, ts) primary key.
            # clock_timestamp(), not now(): now() is frozen at the start of the surrounding transaction.
            cur.execute("SELECT max(id) FROM accs_event WHERE ts <= clock_timestamp() - make_interval(secs => %s)",
                        [self.settle_seconds])
            high = cur.fetchone()[0] or 0
            deadline = time.monotonic() + self.budget_seconds
            while self.watermark < high and time.monotonic() < deadline:
                # From the next event that exists: ids have gaps (rolled-back inserts, pruned months).
                cur.execute("SELECT min(id) FROM accs_event WHERE id > %s", [self.watermark])
                first = cur.fetchone()[0]
                if first is None or first > high:
                    self.watermark = high
                    break
                upper = min(high, first - 1 + self.chunk)
                cur.execute(FOLD_SQL, {"lo": self.watermark, "hi": upper})
                for folded in cur.fetchall():
                    self._add(folded)
                self.watermark = upper
            if self.watermark != start:
                cur.execute("UPDATE accs_metric_totals SET watermark = %s, totals = %s, updated_at = now()"
                            " WHERE id = 1", [self.watermark, json.dumps(self._dump())])
            return self.watermark

    def _load(self, watermark: int, totals: dict | str) -> None:
        data = json.loads(totals) if isinstance(totals, str) else (totals or {})
        self.watermark = watermark
        self.counts = defaultdict(int, {(k, s, t): n for k, s, t, n in data.get("counts", [])})
        self.latency = {s: _Histogram(list(b), c, t) for s, (c, t, b) in data.get("latency", {}).items()}
        self.run_time = {s: _Histogram(list(b), c, t) for s, (c, t, b) in data.get("run_time", {}).items()}

    def _dump(self) -> dict:
        return {"counts": [[k, s, t, n] for (k, s, t), n in sorted(self.counts.items())],
                "latency": {s: [h.count, h.total, h.buckets] for s, h in self.latency.items()},
                "run_time": {s: [h.count, h.total, h.buckets] for s, h in self.run_time.items()}}

    def _add(self, row: tuple) -> None:
        # Columns: kind, service, tenant, n, then (count, sum, buckets...) for latency and run time.
        kind, service, tenant, n = row[:4]
        self.counts[(kind, service, tenant)] += n
        split = 6 + len(LATENCY_BUCKETS)
        lat, run = row[4:split], row[split:]
        if lat[0]:
            self.latency.setdefault(service, _Histogram([0] * len(LATENCY_BUCKETS))).add(lat[0], lat[1], tuple(lat[2:]))
        if run[0]:
            self.run_time.setdefault(service, _Histogram([0] * len(RUN_BUCKETS))).add(run[0], run[1], tuple(run[2:]))

    def metrics(self) -> Iterator[Metric]:
        """Yield the counter and histogram families from the current totals."""
        with self.lock:
            counts = dict(self.counts)
            latency = {k: _Histogram(list(v.buckets), v.count, v.total) for k, v in self.latency.items()}
            run_time = {k: _Histogram(list(v.buckets), v.count, v.total) for k, v in self.run_time.items()}
        claims = CounterMetricFamily("accs_task_claims", "Tasks claimed by agents (attempts started).",
                                     labels=["service"])
        finished = CounterMetricFamily("accs_task_attempts_finished",
                                       "Attempts that ended, by outcome (done, retry, dead_letter, canceled).",
                                       labels=["service", "outcome"])
        retries = CounterMetricFamily("accs_task_retries", "Failed attempts that were scheduled for another try.",
                                      labels=["service"])
        dead = CounterMetricFamily("accs_task_dead_letters", "Tasks that failed for good (dead letter).",
                                   labels=["service"])
        fenced = CounterMetricFamily("accs_task_fenced_reports", "Late reports rejected by attempt fencing.",
                                     labels=["service"])
        jobs_started = CounterMetricFamily("accs_jobs_started",
                                           "Jobs instantiated (queued → waiting, their tasks created).",
                                           labels=["tenant"])
        jobs_finished = CounterMetricFamily("accs_jobs_finished", "Jobs that ended, by final status.",
                                            labels=["tenant", "status"])
        for (kind, service, tenant), n in sorted(counts.items()):
            if kind == "claim":
                claims.add_metric([service], n)
            elif kind in ("done", "retry", "dead_letter", "canceled"):
                finished.add_metric([service, kind], n)
                if kind == "retry":
                    retries.add_metric([service], n)
                elif kind == "dead_letter":
                    dead.add_metric([service], n)
            elif kind == "fenced":
                fenced.add_metric([service], n)
            elif kind == "job_started":
                jobs_started.add_metric([tenant], n)
            elif kind.startswith("job_"):
                jobs_finished.add_metric([tenant, kind[4:]], n)
        yield from (claims, finished, retries, dead, fenced, jobs_started, jobs_finished)
        yield _histogram("accs_task_queue_latency_seconds", "Time from claimable to claimed.", latency, LATENCY_BUCKETS)
        yield _histogram("accs_task_run_seconds", "Run time of finished attempts (claim to report).", run_time,
                         RUN_BUCKETS)
        watermark = GaugeMetricFamily("accs_metrics_timeline_watermark", "Newest timeline event id folded in.")
        watermark.add_metric([], self.watermark)
        yield watermark


def _histogram(name: str, doc: str, per_service: dict[str, _Histogram], bounds: tuple[float, ...]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["service"])
    for service, hist in sorted(per_service.items()):
        buckets = [(repr(float(b)), c) for b, c in zip(bounds, hist.buckets, strict=True)] + [("+Inf", hist.count)]
        family.add_metric([service], buckets, hist.total)
    return family


class AccsCollector:
    """Read ACCS's state from PostgreSQL at scrape time (a prometheus_client custom collector)."""

    def __init__(self, counters: TimelineCounters | None = None) -> None:
        self.counters = counters or TimelineCounters()

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        now = timezone.now()
        tenants, services = queue_depth(now=now)
        tasks = GaugeMetricFamily("accs_tasks", "Tasks by status (waiting, queued, starting, running) right now.",
                                  labels=["tenant", "service", "status"])
        dead = GaugeMetricFamily("accs_tasks_dead_letter", "Tasks failed for good (dead letters).",
                                 labels=["tenant", "service"])
        retrying = GaugeMetricFamily("accs_tasks_retrying", "Queued tasks waiting for another attempt.",
                                     labels=["tenant", "service"])
        oldest = GaugeMetricFamily("accs_queue_oldest_age_seconds", "Age of the oldest due, unclaimed task.",
                                   labels=["tenant", "service"])
        for row in services:
            for status in ("waiting", "queued", "starting", "running"):
                tasks.add_metric([row.tenant, row.service, status], getattr(row, status))
            dead.add_metric([row.tenant, row.service], row.dead_letter)
            retrying.add_metric([row.tenant, row.service], row.retrying)
            if row.oldest_queued_age is not None:
                oldest.add_metric([row.tenant, row.service], row.oldest_queued_age)
        jobs = GaugeMetricFamily("accs_jobs", "Jobs not finished, by status; failed = ended in error in the last 24 h.",
                                 labels=["tenant", "status"])
        for card in tenants:
            jobs.add_metric([card.tenant, "queued"], card.jobs_queued)
            jobs.add_metric([card.tenant, "awaiting_approval"], card.awaiting_approval)
            jobs.add_metric([card.tenant, "waiting"], card.jobs_waiting)
            jobs.add_metric([card.tenant, "running"], card.jobs_running)
            jobs.add_metric([card.tenant, "failed_24h"], card.failed_24h)
        yield from (tasks, dead, retrying, oldest, jobs)
        yield from _flow_metrics()

        up = GaugeMetricFamily("accs_node_up", "1 when the node is online and heartbeated within 3 × TTL/3.",
                               labels=["node"])
        seen = GaugeMetricFamily("accs_node_last_seen_timestamp_seconds", "Last heartbeat (Unix time).",
                                 labels=["node"])
        draining = GaugeMetricFamily("accs_node_draining", "1 when the node claims nothing new.", labels=["node"])
        running = GaugeMetricFamily("accs_node_running_tasks", "Tasks held by the node.", labels=["node"])
        disk = GaugeMetricFamily("accs_node_disk_used_ratio", "Disk use from the latest sample (0..1).",
                                 labels=["node", "level"])
        release = GaugeMetricFamily("accs_node_version_info", "1 per node, labelled with the release its agent "
                                    "last registered ('' for none).", labels=["node", "version"])
        for node in node_health(now=now):
            up.add_metric([node.name], 1 if node.presence == "online" and not node.stale else 0)
            if node.last_seen:
                seen.add_metric([node.name], node.last_seen.timestamp())
            draining.add_metric([node.name], 1 if node.state == "draining" else 0)
            release.add_metric([node.name, node.version], 1)
            running.add_metric([node.name], node.running)
            if node.disk_used_pct is not None:
                disk.add_metric([node.name, node.disk_level], node.disk_used_pct / 100.0)
        governor = GaugeMetricFamily("accs_governor_condition_active", "1 while the condition holds.", labels=["name"])
        paused = GaugeMetricFamily("accs_service_paused", "1 while the service is paused (no agent claims it).",
                                   labels=["service"])
        tenant_paused = GaugeMetricFamily("accs_tenant_paused", "1 while the tenant is paused (no agent claims its "
                                          "tasks).", labels=["tenant"])
        conditions = governor_conditions(now=now)
        # One read of the slugs of the tenants that have a pause, held or ended (a handful).
        slugs = dict(Tenant.objects.filter(pk__in=[c.paused_tenant for c in conditions if c.paused_tenant])
                     .values_list("pk", "slug"))
        for cond in conditions:
            governor.add_metric([cond.name], 1 if cond.holds else 0)
            if (service := paused_service_key(cond.name)) is not None:
                paused.add_metric([service], 1 if cond.holds else 0)
            if cond.paused_tenant is not None and (slug := slugs.get(cond.paused_tenant)) is not None:
                tenant_paused.add_metric([slug], 1 if cond.holds else 0)
        yield from (up, seen, draining, running, disk, release, governor, paused, tenant_paused)

        self.counters.fold()
        yield from self.counters.metrics()
        took = GaugeMetricFamily("accs_metrics_scrape_seconds", "Time spent reading the database for this scrape.")
        took.add_metric([], time.monotonic() - started)
        yield took
        build = GaugeMetricFamily("accs_build_info", "1, labelled with the release of the web process scraped.",
                                  labels=["version"])
        build.add_metric([VERSION], 1)
        yield build


def _flow_metrics() -> Iterator[Metric]:
    """Rate limits and per-key caps: starts left in the window, keys at a limit, tasks held back."""

    left = GaugeMetricFamily("accs_rate_limit_starts_left", "Starts the service's rate limit still allows in its"
                             " window.", labels=["service"])
    keys = GaugeMetricFamily("accs_flow_keys_at_limit", "Key values at their per-key rate limit or cap.",
                             labels=["service", "limit"])
    waiting = GaugeMetricFamily("accs_flow_waiting_tasks", "Queued tasks held back by a flow limit.",
                                labels=["service", "limit"])
    for f in flow_limits():
        if f.starts_left is not None:
            left.add_metric([f.service], f.starts_left)
            waiting.add_metric([f.service, "rate_limit"], f.waiting_on_rate)
        if f.rate_key_limit:
            keys.add_metric([f.service, "key_rate_limit"], f.keys_at_rate_limit)
            waiting.add_metric([f.service, "key_rate_limit"], f.waiting_on_key_rate)
        if f.concurrency_key_limit:
            keys.add_metric([f.service, "key_cap"], f.keys_at_cap)
            waiting.add_metric([f.service, "key_cap"], f.waiting_on_key_cap)
    yield from (left, keys, waiting)


_registry: CollectorRegistry | None = None
_collector: AccsCollector | None = None
_registry_lock = threading.Lock()


def collector() -> AccsCollector:
    """Return this process's collector, creating it (and its registry) on first use."""
    global _registry, _collector
    with _registry_lock:
        if _collector is None:
            _collector = AccsCollector()
            # auto_describe=False: registering must not run collect(), which reads the database.
            _registry = CollectorRegistry(auto_describe=False)
            _registry.register(_collector)
        return _collector


def _authorized(request: HttpRequest) -> bool:
    token = accs.metrics_token
    if not token:
        # Tenant names and queue depths are not for everyone: without a token, only a development
        # site (DEBUG) or a superuser's session may read them.
        user = getattr(request, "user", None)
        return settings.DEBUG or bool(user and user.is_active and user.is_superuser)
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve the metrics in the Prometheus text format (token-protected; open without a token only with DEBUG)."""
    if not _authorized(request):
        need = ("metrics need 'Authorization: Bearer <ACC_METRICS_TOKEN>'" if accs.metrics_token else
                "metrics are closed: set ACC_METRICS_TOKEN and scrape with 'Authorization: Bearer <token>'")
        response = HttpResponse(need + "\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="accs-metrics"'
        return response
    collector()
    assert _registry is not None
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)
