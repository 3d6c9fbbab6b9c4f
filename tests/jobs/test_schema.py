"""The database holds the invariants: sequences, partitions, partial unique indexes, contracts."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction

from jobs.models import Job, JobStatus, Task, TaskStatus
from tenants.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def service(make_service):
    return make_service("svc")


def _insert_jobs(url: str, tenant_id, service_id: int, count: int, out: list[int], barrier: threading.Barrier) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        barrier.wait()
        for _ in range(count):
            row = conn.execute(
                "INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority,"
                " options, step_params, scheduled_at, error_code, error_message, source, source_ref, correlation_id,"
                " approval_state, approved_by, created_at, updated_at)"
                " VALUES (%s, %s, %s, 'queued', 0, '', 0, '{}', '{}', now(), '', '', 'manual', '', '', 'not_required',"
                " '', now(), now())"
                " RETURNING order_seq",
                (uuid.uuid4(), tenant_id, service_id),
            ).fetchone()
            out.append(row[0])


def test_order_seq_strictly_increases_across_four_concurrent_connections(db_url, service, default_tenant):
    results: list[list[int]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)
    threads = [
        threading.Thread(target=_insert_jobs, args=(db_url, default_tenant.id, service.id, 250, results[i], barrier))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seqs in results:
        assert len(seqs) == 250
        assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False)), (
            "each connection sees strictly increasing order_seq")
    everything = [s for seqs in results for s in seqs]
    assert len(set(everything)) == 1000, "no order_seq is handed out twice"
    stored = list(Job.objects.order_by("created_at", "order_seq").values_list("order_seq", flat=True))
    assert sorted(stored) == sorted(everything)


def _partition_of(event_id: int) -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT tableoid::regclass::text FROM accs_event WHERE id = %s", [event_id])
        return cur.fetchone()[0]


def _month_name(ts: datetime) -> str:
    return f"accs_event_{ts:%Y_%m}"


def test_event_dated_next_month_lands_in_next_months_partition():
    from events.models import Event

    now = datetime.now(timezone.utc)
    next_month = (now.replace(day=1) + timedelta(days=32)).replace(day=3)
    event = Event.objects.create(ts=next_month, type="log", message="from the future")
    assert _partition_of(event.id) == _month_name(next_month)


def test_event_for_a_month_without_partition_is_kept_then_moved_into_its_partition():
    from events.models import Event

    far = datetime(2031, 7, 14, 12, 0, tzinfo=timezone.utc)
    events = [Event.objects.create(ts=far + timedelta(hours=i), type="log", message=f"m{i}") for i in range(3)]
    assert {_partition_of(e.id) for e in events} == {"accs_event_default"}
    with connection.cursor() as cur:
        cur.execute("SELECT accs_create_event_partition(%s)", [far])
        assert cur.fetchone()[0] == "accs_event_2031_07"
        cur.execute("SELECT accs_create_event_partition(%s)", [far])  # idempotent
    assert {_partition_of(e.id) for e in events} == {"accs_event_2031_07"}
    assert Event.objects.filter(ts__year=2031).count() == 3


def _job(tenant, service, **fields) -> Job:
    return Job.objects.create(tenant=tenant, service=service, **fields)


def test_second_active_job_with_same_dedupe_key_is_rejected(service, default_tenant):
    first = _job(default_tenant, service, dedupe_key="nightly")
    with pytest.raises(IntegrityError), transaction.atomic():
        _job(default_tenant, service, dedupe_key="nightly")
    other = Tenant.objects.create(slug="other", name="Other")
    _job(other, service, dedupe_key="nightly")  # another tenant may use the key
    Job.objects.filter(pk=first.pk).update(status=JobStatus.DONE, finished_at=datetime.now(timezone.utc))
    _job(default_tenant, service, dedupe_key="nightly")  # the key is free once the first job is final


def test_external_id_is_unique_per_tenant(service, default_tenant):
    _job(default_tenant, service, external_id="hook-1")
    with pytest.raises(IntegrityError), transaction.atomic():
        _job(default_tenant, service, external_id="hook-1")


def _task(job, service, host, *, status=TaskStatus.QUEUED, exclusive=True, key="t") -> Task:
    now = datetime.now(timezone.utc)
    held = status in (TaskStatus.STARTING, TaskStatus.RUNNING)
    return Task.objects.create(
        job=job, tenant=job.tenant, task_key=key, step_key=key, service=service, host=host, exclusive=exclusive,
        status=status, order_seq=job.order_seq if isinstance(job.order_seq, int) else 0,
        claimed_by="agent" if held else "", lease_expires_at=now + timedelta(minutes=2) if held else None,
    )


def test_second_running_task_on_an_exclusive_host_is_rejected(service, default_tenant):
    from nodes.models import Host

    host = Host.objects.create(name="h1")
    job1, job2 = _job(default_tenant, service), _job(default_tenant, service)
    job1.refresh_from_db(), job2.refresh_from_db()
    _task(job1, service, host, status=TaskStatus.RUNNING)
    with pytest.raises(IntegrityError), transaction.atomic():
        _task(job2, service, host, status=TaskStatus.STARTING)
    _task(job2, service, host, status=TaskStatus.RUNNING, exclusive=False, key="t2")  # non-exclusive work may share


@pytest.mark.parametrize(
    ("model", "bad"),
    [
        ("jobs.Job", {"status": "bogus"}),
        ("jobs.Task", {"status": "bogus"}),
        ("jobs.Task", {"status": "done"}),  # a final task needs finished_at
        ("jobs.Task", {"status": "running", "claimed_by": "", "lease_expires_at": None}),
    ],
)
def test_status_check_constraints_hold_in_the_database(service, default_tenant, model, bad):
    job = _job(default_tenant, service)
    job.refresh_from_db()
    task = _task(job, service, None, exclusive=False)
    target = job if model == "jobs.Job" else task
    with pytest.raises(IntegrityError), transaction.atomic():
        type(target).objects.filter(pk=target.pk).update(**bad)
