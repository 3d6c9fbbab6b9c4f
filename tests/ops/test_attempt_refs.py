"""Attempts carry their task's service, tenant and claimable time (jobs.attempt_refs): the copy is always
the task's, the attempts written before it are filled in batches, and the dashboard's rates, its charts
and the attempts list by service show the same figures read from the copy as through the task, equal to
a direct count (a tenant's view counting only its own attempts)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from jobs import api
from jobs.attempt_refs import fill_claimable, fill_missing, refs_complete
from jobs.models import Attempt, Task
from ops.charts import chart_data
from ops.rates import ATTEMPT_REFS, TASK_REFS, rates, refs_source
from tests.engine_helpers import claim_for, run_fail
from tests.ops_helpers import _service, pipeline_scene, two_tenants
from workflows.models import Service

FAILED = ("failed", "timeout")


def _forget_refs(ids: list[int] | None = None) -> int:
    """Make attempts look written before the copy existed (an UPDATE: the insert trigger does not fire)."""
    rows = Attempt.objects.all() if ids is None else Attempt.objects.filter(pk__in=ids)
    return rows.update(service=None, tenant=None, claimable_at=None)


def _claimable_through_task(a: Attempt):
    """The claimable time the attempt's task still holds for it (its last attempt only), else None."""
    t = a.task
    return t.next_attempt_at if a.attempt_no == t.attempt and t.next_attempt_at <= a.started_at else None


def _complete() -> bool:
    with connection.cursor() as cur:
        return refs_complete(cur)


def _direct_counts(*, tenant_id=None) -> tuple[dict, dict]:
    """(per node, per service): (succeeded, failed, total), counted through each attempt's task."""
    nodes: Counter = Counter()
    services: Counter = Counter()
    for a in Attempt.objects.select_related("task__service"):
        if tenant_id is not None and a.task.tenant_id != tenant_id:
            continue
        for counter, key in ((nodes, a.node or "(no node)"), (services, a.task.service.key)):
            counter[key, "ok"] += a.status == "succeeded"
            counter[key, "bad"] += a.status in FAILED
            counter[key, "all"] += 1

    def table(c: Counter) -> dict:
        return {k: (c[k, "ok"], c[k, "bad"], c[k, "all"]) for k in {k for k, _ in c}}

    return table(nodes), table(services)


def _shown(found) -> tuple[dict, dict]:
    return ({r.name: (r.succeeded, r.failed, r.total) for r in found.nodes},
            {r.name: (r.succeeded, r.failed, r.total) for r in found.services})


@pytest.mark.django_db
def test_every_writer_s_attempt_carries_its_task_s_service_and_tenant_whatever_it_said():
    tenants = two_tenants()
    pipeline_scene(tenants)
    attempts = list(Attempt.objects.select_related("task"))
    assert attempts, "the scene's claims wrote attempts"
    for a in attempts:  # written by the claim function, which names neither
        assert (a.service_id, a.tenant_id) == (a.task.service_id, a.task.tenant_id)
    task = attempts[0].task
    other = Service.objects.exclude(pk=task.service_id).first()
    with connection.cursor() as cur:  # a writer naming another service and tenant gets the task's
        cur.execute("INSERT INTO accs_attempt (task_id, attempt_no, node, agent_id, status, started_at, stdout_tail,"
                    " stderr_tail, error_text, service_id, tenant_id) VALUES (%s, 99, 'n', 'a', 'running', now(),"
                    " '', '', '', %s, %s) RETURNING service_id, tenant_id",
                    [task.pk, other.pk, tenants.globex.id])
        assert cur.fetchone() == (task.service_id, task.tenant_id)
    assert _complete()


@pytest.mark.django_db
def test_the_rates_equal_a_direct_count_read_from_the_copy_or_through_the_task():
    tenants = two_tenants()
    pipeline_scene(tenants)
    now = timezone.now()
    window = {"since": now - timedelta(hours=1), "until": now + timedelta(seconds=1)}
    with connection.cursor() as cur:
        assert refs_source(cur) is ATTEMPT_REFS
    expected = _direct_counts()
    assert _shown(rates(**window)) == expected
    mine = _direct_counts(tenant_id=tenants.acme.id)
    assert _shown(rates(**window, tenant_ids={tenants.acme.id})) == mine
    some = list(Attempt.objects.order_by("id").values_list("id", flat=True))[::2]
    assert _forget_refs(some) == len(some)
    with connection.cursor() as cur:
        assert refs_source(cur) is TASK_REFS, "an attempt without its copy: counted through the task"
    assert _shown(rates(**window)) == expected
    assert _shown(rates(**window, tenant_ids={tenants.acme.id})) == mine


@pytest.mark.django_db
@settings(deadline=None, max_examples=10)
@given(batch=st.integers(min_value=1, max_value=7))
def test_the_fill_copies_every_missing_attempt_in_batches_and_then_has_nothing_to_do(batch):
    if not Attempt.objects.exists():
        pipeline_scene(two_tenants())
    total = Attempt.objects.count()
    assert _forget_refs() == total and not _complete()
    seen: list[int] = []
    assert fill_missing(batch=batch, progress=seen.append) == total
    assert seen == sorted(seen) and all(b - a <= batch for a, b in zip([0, *seen], seen, strict=False))
    assert _complete() and fill_missing(batch=batch) == 0
    assert not Attempt.objects.exclude(service_id__isnull=False, tenant_id__isnull=False).exists()
    for a in Attempt.objects.select_related("task"):
        assert (a.service_id, a.tenant_id) == (a.task.service_id, a.task.tenant_id)
        assert a.claimable_at == _claimable_through_task(a), a


@given(batch=st.integers(max_value=0))
def test_a_batch_of_no_attempts_is_refused(batch):
    with pytest.raises(ValueError, match="a batch is at least one attempt"):
        fill_missing(batch=batch)


@pytest.mark.django_db
def test_the_command_fills_the_attempts_and_says_how_many(capsys):
    pipeline_scene(two_tenants())
    total = _forget_refs()
    call_command("accs_attempt_refs", "--batch", "3")
    assert f"filled {total} attempts" in capsys.readouterr().out
    assert _complete()


@pytest.mark.django_db
def test_the_attempts_list_by_service_shows_the_same_rows_from_the_copy_or_through_the_task(client, root):
    pipeline_scene(two_tenants())
    render = Service.objects.get(key="render")
    expected = set(Attempt.objects.filter(task__in=Task.objects.filter(service=render)).values_list("pk", flat=True))
    assert len(expected) == 5

    def listed() -> set[int]:
        page = client.get(f"/admin/jobs/attempt/?service={render.pk}").content.decode()
        return {a for a in Attempt.objects.values_list("pk", flat=True) if f"/admin/jobs/attempt/{a}/change/" in page}

    assert listed() == expected
    _forget_refs()
    assert listed() == expected


# --------------------------------------------------------------------------------------------
# The claimable time, and the charts read from the copy
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_attempt_carries_the_time_its_task_became_claimable_for_it_and_a_retry_its_own():
    tenants = two_tenants()
    svc = _service("flaky-once", max_attempts=3, backoff_base_seconds=30, backoff_cap_seconds=30)
    job = api.start_service("flaky-once", tenant=tenants.acme)
    task = Task.objects.get(job=job)
    first_due = task.next_attempt_at
    run_fail(claim_for(svc))
    task.refresh_from_db()
    assert task.status == "scheduled" and task.next_attempt_at > first_due, "the retry is due later"
    assert len(claim_for(svc, now=task.next_attempt_at + timedelta(seconds=7))) == 1
    task.refresh_from_db()
    first, second = Attempt.objects.filter(task=task).order_by("attempt_no")
    assert first.claimable_at == first_due, "the first attempt keeps the time of its own claim"
    assert second.claimable_at == task.next_attempt_at, "the claim left next_attempt_at as it was"
    assert first.claimable_at <= first.started_at and second.claimable_at <= second.started_at


def _direct_charts(charts, *, tenant_id=None, through_task: bool) -> dict:
    """Per service key ('' for all): (attempts, failed, median wait) per bar, counted through each task.

    The wait is ``started_at`` minus the time the task became claimable for the attempt: through the
    task (``through_task``) only for its last attempt, the one whose time the task still holds; from the
    copy (whose equality to the task's time at the claim the test above checks) for every attempt.
    """
    since, bucket = charts.since, charts.bucket_seconds
    started: Counter = Counter()
    failed: Counter = Counter()
    waits: dict = defaultdict(list)
    for a in Attempt.objects.select_related("task__service"):
        if a.started_at < since or (tenant_id is not None and a.task.tenant_id != tenant_id):
            continue
        bar = int((a.started_at - since).total_seconds() // bucket)
        claimable = _claimable_through_task(a) if through_task else a.claimable_at
        for key in ("", a.task.service.key):
            started[key, bar] += 1
            failed[key, bar] += a.status in FAILED
            if claimable is not None and claimable <= a.started_at:
                waits[key, bar].append((a.started_at - claimable).total_seconds())
    return {(key, bar): (n, failed[key, bar], statistics.median(waits[key, bar]) if waits[key, bar] else None)
            for (key, bar), n in started.items()}


def _charted(charts) -> dict:
    out = {}
    for s in [charts.overall, *charts.services]:
        for bar, n in enumerate(s.started):
            if n:
                out[s.service, bar] = (n, s.failed[bar], s.latency[bar])
    return out


def _same(shown: dict, expected: dict) -> None:
    assert shown.keys() == expected.keys()
    for key, (n, bad, wait) in expected.items():
        assert shown[key][:2] == (n, bad), key
        assert shown[key][2] == (None if wait is None else pytest.approx(wait, abs=1e-3)), key


@pytest.mark.django_db
def test_the_charts_equal_a_direct_count_read_from_the_copy_or_through_the_task_per_tenant():
    tenants = two_tenants()
    pipeline_scene(tenants)
    with connection.cursor() as cur:
        assert refs_complete(cur)
    assert Attempt.objects.filter(attempt_no__gt=1).exists(), "the scene retried a task: a wait the task forgot"
    now = timezone.now() + timedelta(seconds=1)
    views = (None, tenants.acme.id, tenants.globex.id)
    for tenant_id in views:
        charts = chart_data(now=now, tenant_ids=None if tenant_id is None else {tenant_id})
        _same(_charted(charts), _direct_charts(charts, tenant_id=tenant_id, through_task=False))
    acme = _charted(chart_data(now=now, tenant_ids={tenants.acme.id}))
    globex = _charted(chart_data(now=now, tenant_ids={tenants.globex.id}))
    assert "globex-sync" in {k for k, _b in globex} and "globex-sync" not in {k for k, _b in acme}, \
        "a tenant sees its own attempts and never another's"
    # An attempt without its copy: the charts read through the tasks, as before the copy existed.
    assert _forget_refs(list(Attempt.objects.order_by("id").values_list("id", flat=True))[::2])
    for tenant_id in views:
        charts = chart_data(now=now, tenant_ids=None if tenant_id is None else {tenant_id})
        _same(_charted(charts), _direct_charts(charts, tenant_id=tenant_id, through_task=True))


@pytest.mark.django_db
@settings(deadline=None, max_examples=5)
@given(batch=st.integers(min_value=1, max_value=7))
def test_the_claimable_fill_walks_every_attempt_once_and_copies_what_the_task_still_holds(batch):
    if not Attempt.objects.exists():
        pipeline_scene(two_tenants())
    total = Attempt.objects.count()
    Attempt.objects.update(claimable_at=None)  # their service and tenant copied before the time was
    assert _complete(), "the service and tenant are there: only the time is missing"
    walked: list[int] = []
    filled = fill_claimable(batch=batch, progress=lambda w, n: walked.append(w))
    assert walked[-1] == total and all(b - a <= batch for a, b in zip([0, *walked], walked, strict=False))
    known = [a for a in Attempt.objects.select_related("task") if _claimable_through_task(a) is not None]
    assert filled == len(known) > 0
    for a in Attempt.objects.select_related("task"):
        assert a.claimable_at == _claimable_through_task(a), a
    assert fill_claimable(batch=batch) == 0


@pytest.mark.django_db
def test_the_command_fills_the_claimable_times_when_asked(capsys):
    pipeline_scene(two_tenants())
    Attempt.objects.update(claimable_at=None)
    call_command("accs_attempt_refs", "--claimable")
    out = capsys.readouterr().out
    assert "filled 0 attempts" in out and "filled the claimable time of " in out
    assert Attempt.objects.filter(claimable_at__isnull=False).exists()
