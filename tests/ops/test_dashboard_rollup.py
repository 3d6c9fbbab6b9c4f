"""The dashboard's charts and rates read folded buckets from the rollup (jobs.attempt_rollup) and the rest from
the attempts: whatever the fold has reached, they equal a direct count over the attempts, for everyone and
for each tenant (who sees only its own attempts), and once the history is folded they read no attempt of it."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs.attempt_rollup import LAG, SERVICE_GRID, WAIT_BINS, fold, wait_bin, wait_median
from jobs.models import Attempt
from ops.charts import chart_data, chart_span
from ops.rates import rates
from tests.ops_helpers import pipeline_scene, two_tenants

FAILED = ("failed", "timeout")
#: Attempts added to the scene's, spread over the last six days (with waits from none to hours).
EXTRA = 240


def _history(now) -> None:
    """Add attempts of the scene's tasks spread over six days, of every outcome, some still running, with
    waits across the histogram (and some unknown), on three nodes."""
    statuses = ("succeeded", "succeeded", "failed", "timeout", "canceled", "interrupted", "running")
    with connection.cursor() as cur:
        cur.execute("SELECT id FROM accs_task ORDER BY id")
        tasks = [r[0] for r in cur.fetchall()]
        for i in range(EXTRA):
            started = now - timedelta(minutes=37 * i + 3)
            status = statuses[i % len(statuses)]
            wait = [None, 0.05, 1.0, 1.7, 4.0, 45.0, 700.0, 9000.0][i % 8]
            cur.execute(
                "INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, status, started_at, finished_at,"
                " stdout_tail, stderr_tail, error_text) VALUES (%s, %s, %s, 'a', %s, %s, %s, '', '', '')"
                " RETURNING id",
                [tasks[i % len(tasks)], 100 + i, ("node-x", "node-y", "gpu-z")[i % 3], status, started,
                 None if status == "running" else started + timedelta(seconds=30)])
            cur.execute("UPDATE accs_attempt SET claimable_at = %s WHERE id = %s",
                        [None if wait is None else started - timedelta(seconds=wait), cur.fetchone()[0]])


def _scene():
    """The pipeline scene in two tenants and six days of attempts before now; return (tenants, now)."""
    tenants = two_tenants()
    pipeline_scene(tenants)
    now = timezone.now()
    _history(now)
    return tenants, now


def _mark() -> tuple:
    with connection.cursor() as cur:
        cur.execute("SELECT folded_until, pending FROM accs_attempt_rollup_mark WHERE name = 'attempts'")
        return cur.fetchone() or (None, [])  # no row before the first fold


def _waited(a: Attempt) -> float | None:
    return (a.started_at - a.claimable_at).total_seconds() if a.claimable_at and a.claimable_at <= a.started_at \
        else None


def _direct_charts(charts, *, tenant_id=None) -> dict:
    """Per service key ('' for all) and bar: (attempts, failed, median wait), counted over the attempts; a bar
    holding a folded attempt has the median its histogram gives, the others the exact one (bars that are not
    whole rollup buckets are read raw, folded or not)."""
    folded_until, pending = _mark()
    if charts.bucket_seconds % SERVICE_GRID.total_seconds():
        folded_until = None
    since, width = charts.since, charts.bucket_seconds
    started: Counter = Counter()
    failed: Counter = Counter()
    waits: dict = defaultdict(list)
    rolled = set()
    for a in Attempt.objects.select_related("service"):
        bar = int((a.started_at - since).total_seconds() // width)
        if not 0 <= bar < charts.bars or (tenant_id is not None and a.tenant_id != tenant_id):
            continue
        for key in ("", a.service.key):
            started[key, bar] += 1
            failed[key, bar] += a.status in FAILED
            if (wait := _waited(a)) is not None:
                waits[key, bar].append(wait)
            if folded_until is not None and a.started_at < folded_until and a.pk not in pending:
                rolled.add((key, bar))

    def median(key) -> float | None:
        if not waits[key]:
            return None
        if key not in rolled:
            return statistics.median(waits[key])
        bins = [0] * WAIT_BINS
        for w in waits[key]:
            bins[wait_bin(w)] += 1
        return wait_median(bins)

    return {key: (n, failed[key], median(key)) for key, n in started.items()}


def _charted(charts) -> dict:
    return {(s.service, bar): (n, s.failed[bar], s.latency[bar])
            for s in [charts.overall, *charts.services] for bar, n in enumerate(s.started) if n}


def _direct_rates(since, until, *, tenant_id=None) -> tuple[dict, dict]:
    nodes: Counter = Counter()
    services: Counter = Counter()
    for a in Attempt.objects.filter(started_at__gte=since, started_at__lt=until).select_related("service"):
        if tenant_id is not None and a.tenant_id != tenant_id:
            continue
        for counter, key in ((nodes, a.node), (services, a.service.key)):
            counter[key, "ok"] += a.status == "succeeded"
            counter[key, "bad"] += a.status in FAILED
            counter[key, "all"] += 1
    return tuple({k: (c[k, "ok"], c[k, "bad"], c[k, "all"]) for k in {k for k, _ in c}} for c in (nodes, services))


def _shown(found) -> tuple[dict, dict]:
    return ({r.name: (r.succeeded, r.failed, r.total) for r in found.nodes},
            {r.name: (r.succeeded, r.failed, r.total) for r in found.services})


def _same_charts(shown: dict, expected: dict) -> None:
    assert shown.keys() == expected.keys()
    for key, (n, bad, wait) in expected.items():
        assert shown[key][:2] == (n, bad), key
        assert shown[key][2] == (None if wait is None else pytest.approx(wait, abs=1e-3)), key


def _check_every_view(tenants, now) -> None:
    """Charts over 7 days (bars of whole buckets) and 6 hours (raw), rates over ranges whose ends fall inside
    an hour: equal to a direct count, for everyone and each tenant."""
    for tenant_id in (None, tenants.acme.id, tenants.globex.id):
        scope = None if tenant_id is None else {tenant_id}
        for length in (timedelta(days=7), timedelta(hours=6)):
            span, bucket = chart_span(now - length, now)
            charts = chart_data(now=now, span=span, bucket=bucket, tenant_ids=scope)
            _same_charts(_charted(charts), _direct_charts(charts, tenant_id=tenant_id))
            assert not charts.partial
        for since, until in ((now - timedelta(days=7), now), (now - timedelta(days=3, minutes=17), now - timedelta(
                days=1, minutes=41)), (now - timedelta(minutes=50), now - timedelta(minutes=10))):
            assert _shown(rates(since=since, until=until, tenant_ids=scope)) == \
                _direct_rates(since, until, tenant_id=tenant_id), (tenant_id, since, until)


@pytest.mark.django_db
def test_charts_and_rates_equal_a_direct_count_before_during_and_after_the_fold_per_tenant():
    tenants, now = _scene()
    _check_every_view(tenants, now)  # nothing folded: every attempt read raw
    assert fold(limit=50, now=now) > 0
    assert fold(limit=50, now=now) > 0
    assert _mark()[0] < now - timedelta(days=2), "two small batches: the mark is inside the history"
    _check_every_view(tenants, now)
    while fold(limit=50, now=now):
        pass
    folded_until, pending = _mark()
    assert folded_until > now - LAG - timedelta(minutes=20) and pending, "caught up; the running ones pending"
    _check_every_view(tenants, now)
    # The running attempts finish (one failed): the next fold counts each once.
    Attempt.objects.filter(pk__in=pending[::2]).update(status="failed", finished_at=now)
    Attempt.objects.filter(pk__in=pending[1::2]).update(status="succeeded", finished_at=now)
    assert fold(limit=50, now=now) == len(pending)
    assert _mark()[1] == []
    _check_every_view(tenants, now)
    acme = {s.service for s in chart_data(now=now, span=timedelta(days=7), bucket=timedelta(minutes=280),
                                          tenant_ids={tenants.acme.id}).services}
    assert "globex-sync" not in acme and "fetch" in acme, "a tenant sees its own services only"


@pytest.mark.django_db
def test_once_folded_the_week_is_read_from_the_rollup_not_from_its_attempts():
    _tenants, now = _scene()
    Attempt.objects.filter(status="running").update(status="canceled", finished_at=now)
    Attempt.objects.filter(started_at__gt=now - LAG - timedelta(minutes=20)).delete()
    while fold(limit=1000, now=now):
        pass
    span, bucket = chart_span(now - timedelta(days=7), now)
    # A sample of one attempt: the old read counted one attempt of the week and said so; the rollup all.
    charts = chart_data(now=now, span=span, bucket=bucket, sample=1)
    assert not charts.partial and charts.overall.total == Attempt.objects.count()
    found = rates(since=now - timedelta(days=7), until=now, sample=1)
    assert sum(r.total for r in found.nodes) == Attempt.objects.count()
    assert _shown(found) == _direct_rates(now - timedelta(days=7), now)
