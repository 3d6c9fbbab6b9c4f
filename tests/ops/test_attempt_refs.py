"""Attempts carry their task's service and tenant (jobs.attempt_refs): the copy is always the task's, the
attempts written before it are filled in batches, and the dashboard's rates and the attempts list by
service show the same figures read from the copy as through the task, equal to a direct count."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from jobs.attempt_refs import fill_missing, refs_complete
from jobs.models import Attempt, Task
from ops.rates import ATTEMPT_REFS, TASK_REFS, rates, refs_source
from tests.ops_helpers import pipeline_scene, two_tenants
from workflows.models import Service

FAILED = ("failed", "timeout")


def _forget_refs(ids: list[int] | None = None) -> int:
    """Make attempts look written before the copy existed (an UPDATE: the insert trigger does not fire)."""
    rows = Attempt.objects.all() if ids is None else Attempt.objects.filter(pk__in=ids)
    return rows.update(service=None, tenant=None)


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
