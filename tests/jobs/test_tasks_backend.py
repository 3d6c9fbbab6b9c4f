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

from jobs import verbs
from jobs.models import Attempt, AttemptStatus, Job
from jobs.tasks_backend import (
    AccsTaskBackend,
    BadTaskOutput,
    InvalidTask,
    LeaseExpired,
    TaskCanceled,
    TaskResultDoesNotExist,
    TaskResultStatus,
    TaskTimedOut,
    _error,
    service_key,
    task_backends,
)
from tests import task_funcs
from tests.daemons import wait_for, wait_for_result
from workflows.models import Service

pytestmark = pytest.mark.django_db(transaction=True)

RUN_TASKS = [task_funcs.add, task_funcs.boom, task_funcs.whoami, task_funcs.async_double, task_funcs.not_json,
             task_funcs.record]


def _services(*tasks) -> str:
    """Create the tasks' services up front (agents load their services at start) and return their keys."""
    return ",".join(task_backends["default"].ensure_service(t).key for t in tasks)



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
    assert service_key(task_funcs.not_importable) not in keys, "a lambda gets no service"


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

    assert wait_for_result(ok).status == TaskResultStatus.SUCCESSFUL
    assert ok.return_value == 5 and ok.attempts == 1 and ok.errors == []
    assert ok.started_at and ok.finished_at and ok.finished_at >= ok.started_at >= ok.enqueued_at
    assert len(ok.worker_ids) == 1 and ok.worker_ids[0], "the agent that ran it"

    assert wait_for_result(failed).status == TaskResultStatus.FAILED
    (error,) = failed.errors
    assert error.exception_class is ValueError
    assert "the disk is full" in error.traceback and "Traceback" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018 - the property raises for a failed task

    assert wait_for_result(ctx).return_value == {"tag": "t1", "attempt": 1, "id": ctx.id}
    assert wait_for_result(awaited).return_value == 42
    assert wait_for_result(from_async).return_value == 42
    assert wait_for_result(bad_return).status == TaskResultStatus.FAILED
    assert bad_return.errors[0].exception_class is TypeError
    assert task_funcs.add.get_result(ok.id).return_value == 5


def test_higher_priority_runs_first_and_deferred_task_waits_for_run_after(default_tenant, daemons, tmp_path):
    order = tmp_path / "order.jsonl"
    keys = _services(task_funcs.record)
    soon = timezone.now() + timedelta(seconds=2)
    deferred = task_funcs.record.using(run_after=soon).enqueue(str(order), "deferred")
    low = task_funcs.record.using(priority=-5).enqueue(str(order), "low")
    middle = task_funcs.record.enqueue(str(order), "middle")
    high = task_funcs.record.using(priority=50).enqueue(str(order), "high")
    assert task_backends["default"].get_result(deferred.id).status == TaskResultStatus.READY
    assert Job.objects.get(pk=deferred.id).scheduled_at == soon

    daemons.agent("tasks-prio", keys, "--max-concurrent", "1")
    daemons.builder()
    for result in (high, middle, low, deferred):
        wait_for_result(result)
    labels = [json.loads(line) for line in order.read_text().splitlines()]
    assert [label for label in labels if label != "deferred"] == ["high", "middle", "low"]
    assert "deferred" in labels and deferred.started_at >= soon


def _isolate(task, isolation: str) -> str:
    """Create the task's service with the given isolation (before its agent starts) and return its key."""
    service = task_backends["default"].ensure_service(task)
    Service.objects.filter(pk=service.pk).update(executor_config={**service.executor_config, "isolation": isolation})
    return service.key


def test_tasks_services_default_to_process_isolation(default_tenant):
    service = task_backends["default"].ensure_service(task_funcs.add)
    assert service.executor_config["isolation"] == "process"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_system_exit_and_other_base_exceptions_fail_the_attempt_and_the_agent_goes_on(
        default_tenant, daemons, isolation):
    keys = ",".join([_isolate(task_funcs.exits, isolation), _isolate(task_funcs.raises, isolation),
                     _isolate(task_funcs.add, isolation)])
    daemons.agent(f"tasks-exit-{isolation}", keys, "--max-concurrent", "1")
    exited = task_funcs.exits.enqueue(0)
    generator_exit = task_funcs.raises.enqueue("base", "closed")
    after = task_funcs.add.enqueue(1, 1)

    assert wait_for_result(exited).status == TaskResultStatus.FAILED
    assert exited.errors[0].exception_class is SystemExit
    assert wait_for_result(generator_exit).status == TaskResultStatus.FAILED
    assert generator_exit.errors[0].exception_class is GeneratorExit
    assert wait_for_result(after).return_value == 2, "the agent's worker survived and ran the next task"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_error_names_the_raised_class_even_for_site_nested_and_multi_line_exceptions(
        default_tenant, daemons, isolation):
    daemons.agent(f"tasks-err-{isolation}", _isolate(task_funcs.raises, isolation))
    shop = task_funcs.raises.enqueue("shop", "out of stock")
    nested = task_funcs.raises.enqueue("nested", "deep")
    multi = task_funcs.raises.enqueue("value", "a\nb: c")
    assert wait_for_result(shop).errors[0].exception_class is task_funcs.ShopError
    assert "out of stock" in shop.errors[0].traceback
    # The path of a nested class, as Django's own backends record it (import_string reads one attribute).
    assert wait_for_result(nested).errors[0].exception_class_path == "tests.task_funcs.ShopError.Nested"
    assert wait_for_result(multi).errors[0].exception_class is ValueError
    assert "b: c" in multi.errors[0].traceback


def test_engine_outcomes_name_importable_accs_exception_classes(default_tenant, daemons, tmp_path):
    keys = _services(task_funcs.hold, task_funcs.returns_nan)
    Service.objects.filter(key=service_key(task_funcs.hold)).update(timeout_seconds=1)
    daemons.agent("tasks-engine", keys)
    timed_out = task_funcs.hold.enqueue(str(tmp_path / "never-released"), 30)
    nan = task_funcs.returns_nan.enqueue()
    assert wait_for_result(timed_out).errors[0].exception_class is TaskTimedOut
    assert wait_for_result(nan).errors[0].exception_class is BadTaskOutput
    for status, text, kind in [(AttemptStatus.FAILED, "lease_expired: no heartbeat", LeaseExpired),
                               (AttemptStatus.CANCELED, "canceled: process group killed", TaskCanceled),
                               (AttemptStatus.FAILED, "bad output: results are not a JSON object", BadTaskOutput)]:
        assert _error(Attempt(status=status, error_text=text)).exception_class is kind


def test_canceled_running_task_says_finished_only_once_its_attempt_ended_and_never_changes(
        default_tenant, daemons, tmp_path):
    marker = tmp_path / "hold"
    daemons.agent("tasks-cancel", _services(task_funcs.hold), "--lease-seconds", "6")
    result = task_funcs.hold.enqueue(str(marker), 60)
    wait_for(lambda: marker.exists(), timeout=30, message="the held task to start")
    assert verbs.cancel_job(Job.objects.get(pk=result.id).pk, by="test").changed
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and result.finished_at is None, \
        "the job is canceled but its attempt still runs"
    wait_for_result(result)
    attempt = Attempt.objects.get(task__job_id=result.id)
    assert attempt.finished_at is not None and result.finished_at >= attempt.finished_at
    assert result.status == TaskResultStatus.FAILED and result.errors[0].exception_class is TaskCanceled
    again = task_backends["default"].get_result(result.id)
    assert (again.status, again.finished_at, again.errors) == (result.status, result.finished_at, result.errors)


def test_signals_started_and_finished_are_sent_by_the_agent_with_the_result(default_tenant, daemons, tmp_path):
    log = tmp_path / "signals.jsonl"
    daemons.agent("tasks-signals", _services(task_funcs.add, task_funcs.boom), env={"ACCS_TEST_SIGNAL_LOG": str(log)})
    ok = task_funcs.add.enqueue(2, 3)
    failed = task_funcs.boom.enqueue("no")
    wait_for_result(ok), wait_for_result(failed)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by = {(r["id"], r["signal"]): r for r in records}
    started, finished = by[(ok.id, "task_started")], by[(ok.id, "task_finished")]
    assert started["sender"] == finished["sender"] == "AccsTaskBackend"
    assert (started["status"], started["started_at"], started["finished_at"], started["workers"]) == (
        "RUNNING", True, False, 1)
    assert (finished["status"], finished["finished_at"], finished["args"]) == ("SUCCESSFUL", True, [2, 3])
    assert started["task"] == "tests.task_funcs.add"
    bad = by[(failed.id, "task_finished")]
    assert bad["status"] == "FAILED" and bad["errors"] == ["builtins.ValueError"]
    assert records.index(started) < records.index(finished)


def test_queue_names_differing_in_punctuation_get_their_own_services(default_tenant, daemons):
    one, dot = task_funcs.queue_of.using(queue_name="q-one"), task_funcs.queue_of.using(queue_name="q.one")
    assert service_key(one) != service_key(dot)
    assert len({service_key(task_funcs.add.using(queue_name=q)) for q in ("a_b", "a-b", "a.b", "a b")}) == 4
    daemons.agent("tasks-queues", _services(one, dot))
    first, second = one.enqueue(), dot.enqueue()
    assert wait_for_result(first).return_value == "q-one"
    assert wait_for_result(second).return_value == "q.one"


def test_a_service_key_held_by_another_task_is_refused(default_tenant):
    task_backends["default"].ensure_service(task_funcs.boom)
    Service.objects.filter(key=service_key(task_funcs.boom)).update(key=service_key(task_funcs.add))
    with pytest.raises(InvalidTask, match="already runs 'tests.task_funcs.boom'"):
        task_funcs.add.enqueue(1, 2)


def test_get_result_equals_the_enqueued_result_including_run_after(default_tenant):
    later = timezone.now() + timedelta(hours=1)
    result = task_funcs.add.using(run_after=later, priority=7).enqueue(1, b=2)
    read = task_backends["default"].get_result(result.id)
    assert read.task.run_after == later
    assert read == result


def test_module_level_lambda_is_refused_at_enqueue(default_tenant):
    with pytest.raises(InvalidTask, match="cannot be imported by its module path"):
        task_funcs.not_importable.enqueue()
    assert not Job.objects.exists()


@pytest.mark.parametrize("args, kwargs, named", [
    ((float("nan"),), {}, "argument 0"),
    ((1,), {"b": float("inf")}, "keyword argument 'b'"),
    (("ok", "nul\x00here"), {}, "argument 1"),
    ((1,), {"b": {"deep": ["x\x00"]}}, "keyword argument 'b'"),
])
def test_nan_infinity_and_nul_arguments_are_refused_naming_the_argument(default_tenant, args, kwargs, named):
    with pytest.raises(ValueError, match=named):
        task_funcs.add.enqueue(*args, **kwargs)
    assert not Job.objects.exists()


def test_non_json_argument_is_refused_naming_the_argument(default_tenant):
    with pytest.raises(TypeError, match="keyword argument 'b'"):
        task_funcs.add.enqueue(1, b=object())


def test_options_set_on_the_decorator_become_the_services_fields(default_tenant):
    service = task_backends["default"].ensure_service(task_funcs.flaky)
    assert (service.max_attempts, service.timeout_seconds, service.backoff_base_seconds, service.rate_limit,
            service.rate_period_seconds, service.concurrency_key, service.concurrency_key_limit) == (
        3, 20, 0, 500, 10, "kwargs.customer", 2)
    assert service.executor_config["isolation"] == "thread"
    plain = task_backends["default"].ensure_service(task_funcs.add)
    assert (plain.max_attempts, plain.timeout_seconds, plain.executor_config["isolation"]) == (1, 600, "process")


def test_settings_options_override_the_decorator_and_update_the_service(default_tenant, settings):
    before = task_backends["default"].ensure_service(task_funcs.flaky)
    settings.TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend", "QUEUES": [], "OPTIONS": {
        "TIMEOUT_SECONDS": 30, "TASKS": {"tests.task_funcs.flaky": {"max_attempts": 5, "isolation": "process"}}}}}
    after = task_backends["default"].ensure_service(task_funcs.flaky)
    assert after.pk == before.pk
    assert (after.max_attempts, after.timeout_seconds, after.executor_config["isolation"]) == (5, 20, "process")
    assert task_backends["default"].ensure_service(task_funcs.add).timeout_seconds == 30


def test_bad_options_are_refused_naming_the_option(settings):
    with pytest.raises(InvalidTask, match="isolation must be one of"):
        task_funcs.task(isolation="fork")(task_funcs.add.func)
    with pytest.raises(InvalidTask, match="max_attempts must be a number of at least 1"):
        task_funcs.task(max_attempts=0)(task_funcs.add.func)
    settings.TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend",
                                  "OPTIONS": {"TASKS": {"tests.task_funcs.add": {"retries": 3}}}}}
    with pytest.raises(InvalidTask, match="unknown option 'retries'"):
        task_backends["default"]  # noqa: B018 - the backend is built (and its options checked) on first use


def test_retries_with_backoff_and_a_per_task_timeout_on_real_agents(default_tenant, daemons, tmp_path):
    daemons.agent("tasks-options", _services(task_funcs.flaky, task_funcs.slow))
    retried = task_funcs.flaky.enqueue(str(tmp_path / "count"), customer="acme", fail_times=1)
    timed_out = task_funcs.slow.enqueue(30)
    assert wait_for_result(retried).status == TaskResultStatus.SUCCESSFUL
    assert retried.return_value == 2 and retried.attempts == 2
    (first,) = retried.errors
    assert first.exception_class is ConnectionError
    assert wait_for_result(timed_out).status == TaskResultStatus.FAILED
    assert timed_out.errors[0].exception_class is TaskTimedOut and timed_out.attempts == 1


def test_result_links_to_its_job_page_which_shows_path_args_and_return_value(default_tenant, daemons, admin_client):
    daemons.agent("tasks-page", _services(task_funcs.add))
    result = task_funcs.add.enqueue(20, b=22)
    assert result.accs_url == f"/admin/jobs/job/{result.id}/change/"
    assert wait_for_result(result).return_value == 42
    assert task_backends["default"].get_result(result.id).accs_url == result.accs_url
    page = admin_client.get(result.accs_url)
    assert page.status_code == 200
    html = page.content.decode()
    assert "Django task" in html and "tests.task_funcs.add" in html
    assert "[20]" in html and "{&quot;b&quot;: 22}" in html and "<code>42</code>" in html
