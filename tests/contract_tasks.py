"""``@task`` functions of the contract suite (tests/jobs/test_tasks_contract.py), shaped like the ones Django's
own ``tests/tasks`` and django-tasks' tests enqueue; agents import them by module path."""

from __future__ import annotations

from typing import Any

from jobs.tasks_backend import TaskContext, task


@task()
def noop_task(*args: Any, **kwargs: Any) -> None:
    """Do nothing."""
    return None


@task
def noop_task_from_bare_decorator(*args: Any, **kwargs: Any) -> None:
    """Do nothing (decorated without parentheses)."""
    return None


@task()
async def noop_task_async(*args: Any, **kwargs: Any) -> None:
    """Do nothing, as a coroutine."""
    return None


@task()
def calculate_meaning_of_life() -> int:
    """Return 42."""
    return 42


@task()
def failing_task_value_error() -> None:
    """Fail with a ValueError."""
    raise ValueError("This task failed due to ValueError")


@task()
def failing_task_system_exit() -> None:
    """Fail with SystemExit."""
    raise SystemExit("This task failed due to SystemExit")


@task()
def complex_exception() -> None:
    """Fail with an exception whose argument is an exception."""
    raise ValueError(ValueError("This task failed"))


@task()
def complex_return_value() -> Any:
    """Return something JSON cannot carry."""
    return lambda: True


@task()
def exit_task() -> None:
    """Leave through exit(1)."""
    exit(1)


@task(takes_context=True)
def get_task_id(context: TaskContext) -> str:
    """Return the result id the context carries."""
    return context.task_result.id


@task(takes_context=True)
def check_context(context: TaskContext, attempt: int) -> None:
    """Fail unless the context is a TaskContext of the given attempt."""
    assert isinstance(context, TaskContext)
    assert context.attempt == attempt
