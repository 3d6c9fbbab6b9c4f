"""The backend-generic cases of Django's own ``tests/tasks`` suite and of django-tasks' tests, adapted to
ACCS: the same tasks and assertions, with results read back after real agents ran them (a worker
backend, so a result is READY at enqueue and finished once an agent has reported).

Left out, because they test a particular backend rather than the contract: the immediate backend's
"runs at enqueue" and "cannot get results", the dummy backend's in-memory list. Adapted: a
KeyboardInterrupt raised by a task re-raises in the immediate backend (the caller's own process);
in an agent it fails the attempt like any other exception (tests/jobs/test_tasks_backend.py)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from jobs.tasks_backend import (
    AccsTaskBackend,
    InvalidTask,
    Task,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
)
from tests import contract_tasks as tasks
from tests.daemons import wait_for_result

pytestmark = pytest.mark.django_db(transaction=True)


def _agent(daemons, name: str, *task_objects: Task) -> None:
    keys = ",".join(task_backends["default"].ensure_service(t).key for t in task_objects)
    daemons.agent(name, keys)



def _assert_ran(result, task_obj: Task, *, args: list, kwargs: dict) -> None:
    assert result.is_finished is True
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.finished_at is not None
    assert result.started_at >= result.enqueued_at
    assert result.finished_at >= result.started_at
    assert result.task == task_obj
    assert result.args == args and result.kwargs == kwargs
    assert result.attempts == 1


# --------------------------------------------------------------------------------------------
# Without a worker: the backend, Task objects and validation
# --------------------------------------------------------------------------------------------

def test_using_correct_backend():
    assert default_task_backend.alias == task_backends["default"].alias == "default"
    assert isinstance(task_backends["default"], AccsTaskBackend)
    assert isinstance(tasks.noop_task, Task)
    assert tasks.noop_task.priority == 0 and tasks.noop_task.queue_name == "default"
    assert tasks.noop_task.backend == "default" and tasks.noop_task.run_after is None
    assert isinstance(tasks.noop_task_from_bare_decorator, Task)


def test_using_returns_new_tasks_with_changed_defaults():
    now = timezone.now()
    changed = tasks.noop_task.using(priority=1).using(queue_name="queue_1").using(run_after=now)
    assert changed is not tasks.noop_task
    assert (changed.priority, changed.queue_name, changed.run_after) == (1, "queue_1", now)
    assert (tasks.noop_task.priority, tasks.noop_task.queue_name, tasks.noop_task.run_after) == (0, "default", None)
    assert tasks.noop_task.using(priority=1).using(priority=2).priority == 2


def test_name_and_module_path():
    assert tasks.noop_task.name == "noop_task"
    assert tasks.noop_task.module_path == "tests.contract_tasks.noop_task"
    assert tasks.noop_task_async.module_path == "tests.contract_tasks.noop_task_async"


def test_invalid_priority_naive_run_after_and_context_argument_are_refused(default_tenant):
    for priority in (-101, 101, 1.5):
        with pytest.raises(InvalidTask, match="priority must be a whole number"):
            tasks.noop_task.using(priority=priority)
    with pytest.raises(InvalidTask, match="run_after must be an aware datetime"):
        tasks.noop_task.using(run_after=datetime.now())
    with pytest.raises(InvalidTask, match="Task takes context but does not have a first argument of 'context'"):
        task(takes_context=True)(_no_context)


def _no_context(value: int) -> None:
    return None


def test_function_not_at_module_level_is_refused():
    def local() -> None:
        return None

    for invalid in (any, local):
        with pytest.raises(InvalidTask, match="Task function must be defined at a module level"):
            task()(invalid)


def test_unknown_queue_is_refused_at_enqueue(default_tenant, settings):
    settings.TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend", "QUEUES": ["queue-1"]}}
    with pytest.raises(InvalidTask, match="Queue 'unknown_queue' is not valid for backend"):
        tasks.noop_task.using(queue_name="unknown_queue").enqueue()

    async def aenqueue():
        with pytest.raises(InvalidTask, match="Queue 'unknown_queue' is not valid for backend"):
            await tasks.noop_task.using(queue_name="unknown_queue").aenqueue()

    asyncio.run(aenqueue())


def test_enqueue_with_invalid_argument(default_tenant):
    with pytest.raises(TypeError, match="Unsupported type: <class 'datetime.datetime'>"):
        tasks.noop_task.enqueue(datetime.now())

    async def aenqueue():
        await tasks.noop_task.aenqueue(datetime.now())

    with pytest.raises(TypeError, match="Unsupported type: <class 'datetime.datetime'>"):
        asyncio.run(aenqueue())


def test_enqueue_logs_and_sends_task_enqueued(default_tenant, caplog):
    with caplog.at_level(logging.DEBUG, logger="django.tasks" if _builtin() else "django_tasks"):
        result = tasks.noop_task.enqueue()
    assert any("enqueued" in r.getMessage() and result.id in r.getMessage() for r in caplog.records)


def _builtin() -> bool:
    return AccsTaskBackend.__mro__[1].__module__.startswith("django.tasks")


def test_get_result_before_a_worker_ran_it_is_ready_and_refreshes(default_tenant):
    result = tasks.noop_task.enqueue(1, two=3)
    assert result.status == TaskResultStatus.READY and result.is_finished is False
    assert result.started_at is None and result.finished_at is None and result.attempts == 0
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018 - the property raises
    read = default_task_backend.get_result(result.id)
    assert read == result and read.id == result.id and read.task == result.task
    assert tasks.noop_task.get_result(result.id) == result
    result.refresh()
    assert result.status == TaskResultStatus.READY

    async def read_async():
        got = await tasks.noop_task.aget_result(result.id)
        await result.arefresh()
        await sync_to_async(connections.close_all)()
        return got

    assert asyncio.run(read_async()) == result


def test_get_missing_and_mismatched_results_raise(default_tenant):
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("123")
    with pytest.raises(TaskResultDoesNotExist):
        tasks.noop_task.get_result("00000000-0000-0000-0000-000000000000")
    result = tasks.noop_task.enqueue()
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        tasks.calculate_meaning_of_life.get_result(result.id)

    async def missing():
        with pytest.raises(TaskResultDoesNotExist):
            await default_task_backend.aget_result("123")
        with pytest.raises(TaskResultMismatch):
            await tasks.calculate_meaning_of_life.aget_result(result.id)
        await sync_to_async(connections.close_all)()

    asyncio.run(missing())


def test_call_runs_the_function_in_process():
    assert tasks.calculate_meaning_of_life.call() == 42
    assert tasks.noop_task_async.call() is None

    async def acall():
        return await tasks.calculate_meaning_of_life.acall(), await tasks.noop_task_async.acall()

    assert asyncio.run(acall()) == (42, None)


# --------------------------------------------------------------------------------------------
# With real agents
# --------------------------------------------------------------------------------------------

def test_enqueued_tasks_run_on_an_agent_and_report_like_django_backends(default_tenant, daemons):
    _agent(daemons, "contract-ok", tasks.noop_task, tasks.noop_task_async, tasks.calculate_meaning_of_life,
           tasks.get_task_id, tasks.check_context)
    sync = tasks.noop_task.enqueue(1, two=3)
    coroutine = tasks.noop_task_async.enqueue(1, two=3)

    async def aenqueue():
        results = [await tasks.noop_task.aenqueue(), await tasks.noop_task_async.aenqueue()]
        await sync_to_async(connections.close_all)()
        return results

    from_async = asyncio.run(aenqueue())
    meaning = default_task_backend.enqueue(tasks.calculate_meaning_of_life, [], {})
    own_id = tasks.get_task_id.enqueue()
    context = tasks.check_context.enqueue(1)

    for result, task_obj, args, kwargs in [(sync, tasks.noop_task, [1], {"two": 3}),
                                           (coroutine, tasks.noop_task_async, [1], {"two": 3}),
                                           (from_async[0], tasks.noop_task, [], {}),
                                           (from_async[1], tasks.noop_task_async, [], {})]:
        assert wait_for_result(result).status == TaskResultStatus.SUCCESSFUL
        assert result.return_value is None
        _assert_ran(result, task_obj, args=args, kwargs=kwargs)
    assert wait_for_result(meaning).return_value == 42
    assert wait_for_result(own_id).return_value == own_id.id
    assert wait_for_result(context).status == TaskResultStatus.SUCCESSFUL


def test_failing_tasks_report_their_exception_and_traceback(default_tenant, daemons):
    _agent(daemons, "contract-fail", tasks.failing_task_value_error, tasks.failing_task_system_exit,
           tasks.complex_exception, tasks.complex_return_value, tasks.exit_task)
    cases = [(tasks.failing_task_value_error, ValueError, "This task failed due to ValueError"),
             (tasks.failing_task_system_exit, SystemExit, "This task failed due to SystemExit")]
    results = [(task_obj.enqueue(), task_obj, exception, message) for task_obj, exception, message in cases]
    complex_exception = tasks.complex_exception.enqueue()
    complex_return = tasks.complex_return_value.enqueue()
    exited = tasks.exit_task.enqueue()

    for result, task_obj, exception, message in results:
        assert wait_for_result(result).status == TaskResultStatus.FAILED
        with pytest.raises(ValueError, match="Task failed"):
            result.return_value  # noqa: B018 - the property raises
        _assert_ran(result, task_obj, args=[], kwargs={})
        assert result.errors[0].exception_class is exception
        assert result.errors[0].traceback.endswith(f"{exception.__name__}: {message}\n"), result.errors[0].traceback

    assert wait_for_result(complex_exception).status == TaskResultStatus.FAILED
    assert complex_exception.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in complex_exception.errors[0].traceback
    assert wait_for_result(complex_return).status == TaskResultStatus.FAILED
    assert complex_return.errors[0].exception_class is TypeError
    assert "Unsupported type" in complex_return.errors[0].traceback
    assert wait_for_result(exited).status == TaskResultStatus.FAILED
    assert exited.errors[0].exception_class is SystemExit


def test_deferred_task_runs_after_run_after(default_tenant, daemons):
    _agent(daemons, "contract-defer", tasks.calculate_meaning_of_life)
    daemons.builder()
    after = timezone.now() + timedelta(seconds=1)
    result = tasks.calculate_meaning_of_life.using(run_after=after).enqueue()
    assert result.task.run_after == after
    assert wait_for_result(result).return_value == 42
    assert result.started_at >= after
