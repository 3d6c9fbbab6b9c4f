"""Django's Tasks API on ACCS: ``@task`` functions enqueued in the caller's transaction and run by
real agents (``manage.py runagent`` processes) against PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.db import connections, transaction
from django.utils import timezone
from django_tasks import TaskResultStatus, task_backends
from django_tasks.exceptions import TaskResultDoesNotExist

from jobs.models import Job
from jobs.tasks_backend import AccsTaskBackend, service_key
from tests import task_funcs
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

RUN_TASKS = [task_funcs.add, task_funcs.boom, task_funcs.whoami, task_funcs.async_double, task_funcs.not_json,
             task_funcs.record]


def _services(*tasks) -> str:
    """Create the tasks' services up front (agents load their services at start) and return their keys."""
    return ",".join(task_backends["default"].ensure_service(t).key for t in tasks)


def _finished(result, *, timeout: float = 30.0):
    def done():
        result.refresh()
        return result.is_finished

    wait_for(done, timeout=timeout, message=f"task result {result.id} to finish")
    return result


def test_backend_declares_what_it_supports():
    backend = task_backends["default"]
    assert isinstance(backend, AccsTaskBackend)
    assert (backend.supports_defer, backend.supports_async_task, backend.supports_get_result,
            backend.supports_priority) == (True, True, True, True)


def test_enqueue_rolled_back_with_the_callers_transaction_leaves_nothing(default_tenant):
    with pytest.raises(RuntimeError), transaction.atomic():
        result = task_funcs.add.enqueue(1, 2)
        assert Job.objects.filter(pk=result.id).exists(), "the job exists inside the transaction"
        raise RuntimeError("the caller changes its mind")
    assert not Job.objects.exists()
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(result.id)
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("not-a-job-id")


def test_first_enqueue_creates_one_python_service_per_task_and_queue(default_tenant):
    first = task_funcs.add.enqueue(1, 2)
    task_funcs.add.enqueue(3, 4)
    job = Job.objects.select_related("service").get(pk=first.id)
    assert job.service.key == service_key(task_funcs.add) == "task-default-tests-task_funcs-add"
    assert job.service.executor == "python"
    assert job.service.executor_config["task"] == "tests.task_funcs.add"
    assert Job.objects.filter(service=job.service).count() == 2
    assert first.status == TaskResultStatus.READY and first.args == [1, 2] and first.kwargs == {}
    other = task_funcs.add.using(queue_name="emails")
    assert service_key(other) == "task-emails-tests-task_funcs-add"
    assert len(service_key(task_funcs.add.using(queue_name="q" * 90))) <= 55


def test_accs_tasks_command_creates_services_and_prints_keys_for_runagent(default_tenant, capsys):
    call_command("accs_tasks", "tests.task_funcs", "--keys")
    keys = capsys.readouterr().out.strip().split(",")
    assert service_key(task_funcs.add) in keys and service_key(task_funcs.boom) in keys


def test_tasks_run_on_real_agents_with_results_errors_context_and_async(default_tenant, daemons):
    daemons.agent("tasks-1", _services(*RUN_TASKS))
    ok = task_funcs.add.enqueue(2, b=3)
    failed = task_funcs.boom.enqueue("the disk is full")
    ctx = task_funcs.whoami.enqueue("t1")
    awaited = task_funcs.async_double.enqueue(21)
    bad_return = task_funcs.not_json.enqueue()

    async def enqueue_from_async_code():
        result = await task_funcs.add.aenqueue(40, 2)
        await sync_to_async(connections.close_all)()
        return result

    from_async = asyncio.run(enqueue_from_async_code())

    assert _finished(ok).status == TaskResultStatus.SUCCESSFUL
    assert ok.return_value == 5 and ok.attempts == 1 and ok.errors == []
    assert ok.started_at and ok.finished_at and ok.finished_at >= ok.started_at >= ok.enqueued_at
    assert len(ok.worker_ids) == 1 and ok.worker_ids[0], "the agent that ran it"

    assert _finished(failed).status == TaskResultStatus.FAILED
    (error,) = failed.errors
    assert error.exception_class is ValueError
    assert "the disk is full" in error.traceback and "Traceback" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018 - the property raises for a failed task

    assert _finished(ctx).return_value == {"tag": "t1", "attempt": 1, "id": ctx.id}
    assert _finished(awaited).return_value == 42
    assert _finished(from_async).return_value == 42
    assert _finished(bad_return).status == TaskResultStatus.FAILED
    assert bad_return.errors[0].exception_class is TypeError
    assert task_funcs.add.get_result(ok.id).return_value == 5


def test_higher_priority_runs_first_and_deferred_task_waits_for_run_after(default_tenant, daemons, tmp_path):
    order = tmp_path / "order.jsonl"
    keys = _services(task_funcs.record)
    soon = timezone.now() + timedelta(seconds=2)
    deferred = task_funcs.record.using(run_after=soon).enqueue(str(order), "deferred")
    task_funcs.record.using(priority=-5).enqueue(str(order), "low")
    task_funcs.record.enqueue(str(order), "middle")
    last = task_funcs.record.using(priority=50).enqueue(str(order), "high")
    assert task_backends["default"].get_result(deferred.id).status == TaskResultStatus.READY
    assert Job.objects.get(pk=deferred.id).scheduled_at == soon

    daemons.agent("tasks-prio", keys, "--max-concurrent", "1")
    daemons.builder()
    _finished(last)
    _finished(deferred)
    labels = [json.loads(line) for line in order.read_text().splitlines()]
    assert labels == ["high", "middle", "low", "deferred"]
    assert deferred.started_at >= soon
