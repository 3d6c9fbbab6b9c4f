"""The Python API: starting jobs inside the caller's transaction, idempotency,
dedupe keys, param overrides, validation that writes nothing."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from events.models import Event
from jobs import api, transitions, triggers
from jobs.models import Job, Task, Trigger
from tenants.models import Tenant
from tests.engine_helpers import claim_for
from workflows.api import create_workflow
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


@pytest.fixture
def flow(make_service):
    make_service("fetch", params_schema={"type": "object", "properties": {"url": {"type": "string"},
                                                                          "retries": {"type": "integer"}}})
    make_service("store")
    create_workflow(name="ingest", steps=[
        {"key": "fetch", "service": "fetch", "default_params": {"url": "http://a", "retries": 1}},
        {"key": "store", "service": "store", "depends_on": ["fetch"]},
    ])
    return create_workflow(name="ingest", steps=[
        {"key": "fetch", "service": "fetch", "default_params": {"url": "http://b", "retries": 2}},
        {"key": "store", "service": "store", "depends_on": ["fetch"]},
    ])


def test_workflow_and_service_jobs_created_in_a_rolled_back_transaction_do_not_exist(flow, default_tenant):
    with pytest.raises(RuntimeError), transaction.atomic():
        wf_job = api.start_workflow("ingest")
        svc_job = api.start_service("store")
        ids = api.start_many([api.JobSpec(service="store") for _ in range(3)])
        assert Task.objects.filter(job_id__in=[wf_job.id, svc_job.id]).count() == 3
        assert Job.objects.filter(pk__in=ids).count() == 3
        raise RuntimeError("caller rolls back")
    assert Job.objects.count() == 0 and Task.objects.count() == 0


def test_emit_event_in_a_rolled_back_transaction_starts_nothing(flow, default_tenant):
    triggers.create_trigger(tenant=default_tenant, label="on upload", trigger_type="event", event_name="upload",
                            service="store", dedupe_window_seconds=0)
    with pytest.raises(RuntimeError), transaction.atomic():
        assert len(api.emit_event("upload", {"k": 1}).jobs) == 1
        raise RuntimeError("caller rolls back")
    assert Job.objects.count() == 0 and Task.objects.count() == 0
    assert not Event.objects.filter(type="app_event").exists()
    assert Trigger.objects.count() == 1


def test_job_exists_when_the_caller_commits(flow, default_tenant):
    with transaction.atomic():
        job = api.start_workflow("ingest")
    assert Job.objects.filter(pk=job.pk, status="waiting").exists()


def test_workflow_by_name_runs_the_latest_active_version_or_the_one_given(flow):
    assert api.start_workflow("ingest").workflow.version == 2
    assert api.start_workflow("ingest", version=1).workflow.version == 1
    flow.is_active = False
    flow.save()
    assert api.start_workflow("ingest").workflow.version == 1, "an inactive version is skipped"
    with pytest.raises(api.NotFound):
        api.start_workflow("nope")


def test_step_params_override_defaults_and_options_priority_correlation_are_kept(flow):
    job = api.start_workflow("ingest", step_params={"fetch": {"retries": 5}}, priority=7, correlation_id="c-1",
                             options={"note": "x"})
    fetch = Task.objects.get(job=job, step_key="fetch")
    assert fetch.params == {"url": "http://b", "retries": 5}
    assert (job.priority, job.correlation_id, job.options) == (7, "c-1", {"note": "x"})


def test_future_job_waits_for_its_time_then_the_builder_starts_it(flow):
    later = timezone.now() + timedelta(hours=1)
    job = api.start_service("store", scheduled_at=later)
    assert job.status == "queued" and not Task.objects.filter(job=job).exists()
    assert transitions.start_due_jobs() == []
    assert transitions.start_due_jobs(now=later + timedelta(seconds=1)) == [job.id]


def test_repeated_external_id_returns_the_same_job_per_tenant(flow, default_tenant):
    first = api.start_service("store", external_id="hook-1")
    again = api.start_service("store", external_id="hook-1", priority=9)
    assert (first.was_created, again.was_created, again.id) == (True, False, first.id)
    other = Tenant.objects.create(slug="other", name="Other")
    assert api.start_service("store", external_id="hook-1", tenant=other).id != first.id
    assert api.start_many([api.JobSpec(service="store", external_id="hook-1")]) == [first.id]
    assert Job.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_identical_calls_create_one_job(flow, default_tenant):
    barrier = threading.Barrier(50)
    ids: list = []
    errors: list = []

    def call() -> None:
        try:
            barrier.wait(timeout=30)
            ids.append(api.start_service("store", external_id="race-1").id)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=call) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert len(ids) == 50 and len(set(ids)) == 1
    assert Job.objects.filter(external_id="race-1").count() == 1


def test_dedupe_key_allows_one_active_job_and_names_the_holder(flow):
    holder = api.start_service("store", dedupe_key="nightly")
    with pytest.raises(api.JobConflict) as info:
        api.start_service("store", dedupe_key="nightly")
    assert info.value.job_id == holder.id and "nightly" in str(info.value)
    with pytest.raises(api.JobConflict):
        api.start_many([api.JobSpec(service="store"), api.JobSpec(service="store", dedupe_key="nightly")])
    assert Job.objects.count() == 1, "nothing of a conflicting bulk call remains; the caller's transaction goes on"
    api.cancel(holder.id, by="ops")
    assert api.start_service("store", dedupe_key="nightly").id != holder.id, "a finished job frees the key"


@pytest.mark.parametrize(("kwargs", "where"), [
    ({"step_params": {"nope": {}}}, "step_params.nope"),
    ({"step_params": {"fetch": {"retries": "many"}}}, "step 'fetch' params"),
    ({"priority": 2**31}, "priority"),
    ({"scheduled_at": timezone.now().replace(tzinfo=None)}, "scheduled_at"),
    ({"correlation_id": "x" * 201}, "correlation_id"),
    ({"external_id": ""}, "external_id"),
])
def test_invalid_requests_name_the_problem_and_write_nothing(flow, kwargs, where):
    with pytest.raises(DefinitionError) as info:
        api.start_workflow("ingest", **kwargs)
    assert where in [p.where for p in info.value.problems], info.value.problems
    assert not Job.objects.exists()


@pytest.mark.parametrize("schema", [{"$ref": "#/$defs/missing"}, {"$ref": "http://127.0.0.1:9/remote.json"}])
def test_unusable_params_schema_is_a_validation_error_not_a_crash(make_service, schema):
    make_service("refs", params_schema=schema)
    with pytest.raises(DefinitionError, match="cannot be applied"):
        api.start_service("refs", params={})


def test_cancel_and_retry_through_the_api(flow):
    job = api.start_workflow("ingest")
    assert api.cancel(job.id, by="ops").changed
    assert set(Task.objects.filter(job=job).values_list("status", flat=True)) == {"canceled"}
    assert not api.cancel(job.id).changed
    result = api.retry(job.id, by="ops")
    assert result.changed, result.message
    job.refresh_from_db()
    assert job.status == "waiting"
    assert sorted(Task.objects.filter(job=job).values_list("status", flat=True)) == ["queued", "waiting"]


def test_a_retry_lists_its_tasks_moves_in_the_order_the_tasks_were_created(make_service):
    # The retry moves every failed task in one statement, whose rows come back in whatever order
    # its plan reads them: here the steps' keys sort in the reverse of their creation, and each
    # task's row is rewritten last-created first, so neither the key's nor the physical order is
    # the ids'. The timeline (one transaction, one time) must still list them as created.
    make_service("part", max_attempts=1)
    create_workflow(name="parts", steps=[{"key": f"p{7 - i}", "service": "part"} for i in range(8)])
    job = api.start_workflow("parts")
    tasks = sorted(Task.objects.filter(job=job), key=lambda t: t.id)
    assert api.cancel(job.id, by="ops").changed
    for task in reversed(tasks):
        Task.objects.filter(pk=task.pk).update(error_message=f"row of {task.task_key} written again")

    assert api.retry(job.id, by="ops").changed
    moved = [e.task_id for e in Event.objects.filter(job_id=job.id, data__retry=True).order_by("id")]
    assert moved == [t.id for t in tasks]


def test_a_cancel_lists_its_tasks_moves_and_stop_requests_in_the_order_the_tasks_were_created(make_service):
    # As for a retry: the cancel moves the unstarted tasks, and asks the held ones to stop, one
    # statement each, whose rows come back in whatever order the plan reads them. Every row is
    # rewritten last-created first, so the physical order is the reverse of the ids'.
    service = make_service("part")
    create_workflow(name="parts", steps=[{"key": f"p{7 - i}", "service": "part"} for i in range(8)])
    job = api.start_workflow("parts")
    tasks = sorted(Task.objects.filter(job=job), key=lambda t: t.id)
    held = {t.id for t in claim_for(service, 4)}
    assert len(held) == 4
    for task in reversed(tasks):
        Task.objects.filter(pk=task.pk).update(error_message=f"row of {task.task_key} written again")

    assert api.cancel(job.id, by="ops").changed
    skipped = [e.task_id for e in Event.objects.filter(job_id=job.id, task_id__isnull=False, data__to="canceled")
               .order_by("id")]
    asked = [e.task_id for e in Event.objects.filter(job_id=job.id, type="cancel").order_by("id")]
    assert skipped == [t.id for t in tasks if t.id not in held]
    assert asked == [t.id for t in tasks if t.id in held]
