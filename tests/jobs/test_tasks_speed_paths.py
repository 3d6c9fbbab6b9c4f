"""The Tasks backend's common enqueue path: a task already mapped to its service costs one statement,
and the mapping follows the service when it is edited, deleted or rolled back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from jobs.api import NotFound
from jobs.models import Job, Task as TaskRow
from jobs.tasks_backend import TaskServices, service_key, task_backends, task_services
from tests import task_funcs
from workflows.models import Service


@pytest.fixture(autouse=True)
def _fresh_task_services() -> Iterator[None]:
    task_services.clear()
    yield
    task_services.clear()


@contextmanager
def statements() -> Iterator[list[str]]:
    """Record every statement sent: Django's cursors and the raw psycopg cursor of the one-statement start."""
    sent: list[str] = []
    real = psycopg.Cursor.execute

    def counting(self, query, *args, **kwargs):
        sent.append(str(query)[:80])
        return real(self, query, *args, **kwargs)

    with CaptureQueriesContext(connection) as django_queries:
        psycopg.Cursor.execute = counting  # type: ignore[method-assign]
        try:
            yield sent
        finally:
            psycopg.Cursor.execute = real  # type: ignore[method-assign]
    # Django's own cursors also go through psycopg.Cursor.execute; name them for the failure message.
    sent.extend(f"(django) {q['sql'][:60]}" for q in django_queries.captured_queries if q["sql"] not in sent)


def test_enqueue_of_a_mapped_task_sends_one_statement(default_tenant, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        task_funcs.add.enqueue(1, 2)  # creates the service and maps it once this transaction commits
    with statements() as sent:
        result = task_funcs.add.enqueue(3, 4)
    assert len([s for s in sent if not s.startswith("(django)")]) == 1, sent
    row = TaskRow.objects.get(job_id=result.id)
    assert row.params == {"args": [3, 4], "kwargs": {}}
    assert row.service.key == service_key(task_funcs.add)


def test_a_service_created_in_a_rolled_back_transaction_is_not_remembered(default_tenant,
                                                                          django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic():
            task_funcs.add.enqueue(1, 2)
            raise RuntimeError("the caller changes its mind")
    assert not Service.objects.filter(key=service_key(task_funcs.add)).exists()
    assert task_backends["default"].service_for(task_funcs.add).pk is not None  # looked up afresh, not cached
    result = task_funcs.add.enqueue(5, 6)
    assert Job.objects.filter(pk=result.id).exists()


def test_an_edit_saved_in_this_process_reaches_the_next_enqueue(default_tenant, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        task_funcs.add.enqueue(1, 2)
    service = Service.objects.get(key=service_key(task_funcs.add))
    service.is_active = False
    service.save()  # the admin's save: its signal drops the mapping
    with pytest.raises(NotFound, match="not active"):
        task_funcs.add.enqueue(3, 4)


def test_an_edit_made_elsewhere_is_seen_after_the_time_to_live(default_tenant, django_capture_on_commit_callbacks,
                                                              monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(task_services, "_clock", lambda: now[0])
    with django_capture_on_commit_callbacks(execute=True):
        task_funcs.add.enqueue(1, 2)
    # Another process's edit: no signal reaches this one.
    Service.objects.filter(key=service_key(task_funcs.add)).update(is_active=False)
    task_funcs.add.enqueue(3, 4)  # within the time to live the mapping still holds
    now[0] += task_services.ttl
    with pytest.raises(NotFound, match="not active"):
        task_funcs.add.enqueue(5, 6)


@pytest.mark.django_db(transaction=True)
def test_a_cached_service_deleted_elsewhere_is_looked_up_again_in_autocommit(default_tenant):
    first = task_funcs.add.enqueue(1, 2)  # autocommit: mapped at once
    old = Service.objects.get(key=service_key(task_funcs.add))
    with connection.cursor() as cur:  # another process removes the service and its jobs (no signal here)
        cur.execute("TRUNCATE accs_job, accs_task, accs_attempt, accs_event CASCADE")
        cur.execute("DELETE FROM accs_service WHERE id = %s", [old.id])
    assert not Job.objects.filter(pk=first.id).exists()
    result = task_funcs.add.enqueue(3, 4)
    job = Job.objects.get(pk=result.id)
    assert job.service_id != old.id and job.service.key == old.key


@pytest.mark.django_db(transaction=True)
def test_inside_a_transaction_a_service_deleted_elsewhere_fails_the_commit_until_the_time_to_live(
        default_tenant, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(task_services, "_clock", lambda: now[0])
    task_funcs.add.enqueue(1, 2)
    with connection.cursor() as cur:
        cur.execute("TRUNCATE accs_job, accs_task, accs_attempt, accs_event CASCADE")
        cur.execute("DELETE FROM accs_service WHERE key = %s", [service_key(task_funcs.add)])
    # The reference is checked at commit (a deferred constraint), past enqueue: the caller sees the error.
    with pytest.raises(IntegrityError), transaction.atomic():
        task_funcs.add.enqueue(3, 4)
    now[0] += task_services.ttl
    with transaction.atomic():
        result = task_funcs.add.enqueue(5, 6)
    assert Job.objects.filter(pk=result.id).exists()


def test_changed_options_reach_the_service_despite_the_mapping(default_tenant, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        task_funcs.add.enqueue(1, 2)
    backend = task_backends["default"]
    backend.per_task[task_funcs.add.module_path] = {"timeout": 7}
    try:
        task_funcs.add.enqueue(3, 4)
    finally:
        del backend.per_task[task_funcs.add.module_path]
    assert Service.objects.get(key=service_key(task_funcs.add)).timeout_seconds == 7


def test_task_services_forget_entries_past_their_time_to_live_and_stay_bounded():
    now = [0.0]
    cache = TaskServices(ttl=10, clock=lambda: now[0], max_entries=2)
    a, b, c = Service(key="a"), Service(key="b"), Service(key="c")
    cache.put("a", a)
    assert cache.get("a") is a
    now[0] = 10
    assert cache.get("a") is None
    cache.put("a", a)
    cache.put("b", b)
    cache.put("c", c)  # full: the map starts over rather than grow
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, None, c)
