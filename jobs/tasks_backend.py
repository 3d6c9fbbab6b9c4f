"""Django's Tasks API on ACCS: ``@task`` functions run on ACCS agents, with results in PostgreSQL.

    # settings.py
    TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend",
                         "QUEUES": ["default", "emails"],
                         "OPTIONS": {"TENANT": "acme", "MAX_ATTEMPTS": 3}}}

    # myapp/tasks.py
    from django_tasks import task          # Django 6: from django.tasks import task

    @task(priority=10, queue_name="emails")
    def send_welcome(user_id: int) -> dict:
        ...

    result = send_welcome.enqueue(42)      # a job, in the caller's transaction
    result.refresh(); result.status, result.return_value, result.errors, result.attempts

How the Tasks concepts map onto ACCS:

* Each task function, per queue, is one ``python`` service whose key is derived from the queue and
  the function's module path (:func:`service_key`). The service is created on first enqueue (or by
  ``manage.py accs_tasks``); agents run it with ``runagent --services <keys>``, so a queue is the set
  of services an agent is started for. The service calls :func:`run_task`, which unpacks the job's
  params ``{"args": [...], "kwargs": {...}}`` and calls the function.
* ``enqueue()`` starts a one-task job through :func:`jobs.api.start_service` in the caller's
  transaction: rolled back, nothing remains. The result id is the job id.
* ``priority`` is the job's priority (both: higher runs first), ``run_after`` its ``scheduled_at``,
  ``takes_context`` passes a ``TaskContext`` whose ``attempt`` is the ACCS attempt number.
* ``get_result()`` reads the job, its task and its attempts: status, return value (the task's JSON
  results), one ``TaskError`` per failed attempt (exception class and traceback) and one worker id
  per attempt. Retries are ACCS's: ``OPTIONS["MAX_ATTEMPTS"]`` (default 1, as Django's own
  backends run a task once) with the service's backoff.
"""

from __future__ import annotations

import re
from hashlib import sha1
from typing import Any
from uuid import UUID

from django.db import IntegrityError, transaction
from django.utils.module_loading import import_string

try:  # Django 6 ships the Tasks framework; on Django 5.2 the django-tasks package provides it.
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
    from django.tasks.utils import normalize_json
except ImportError:
    from django_tasks import TaskContext, TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued
    from django_tasks.utils import normalize_json

from jobs import api
from jobs.models import Attempt, AttemptStatus, Job, JobSource, JobStatus, Task as TaskRow, TaskStatus
from workflows.models import Service

ADAPTER = "jobs.tasks_backend:run_task"
SOURCE_REF_PREFIX = "django-tasks:"
# PostgreSQL channel names stop at 63 bytes and agents listen on prefix + key, so keys stay short.
MAX_KEY = 55
ARGS_SCHEMA = {
    "type": "object",
    "properties": {"args": {"type": "array"}, "kwargs": {"type": "object"}},
    "required": ["args", "kwargs"],
    "additionalProperties": False,
}
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def service_key(task: Task) -> str:
    """Return the ACCS service key for a task function on its queue (stable, at most 55 characters)."""
    key = _SLUG_UNSAFE.sub("-", f"task-{task.queue_name}-{task.module_path}").strip("-")
    if len(key) > MAX_KEY:
        digest = sha1(key.encode()).hexdigest()[:8]
        key = f"{key[:MAX_KEY - 9].rstrip('-')}-{digest}"
    return key


class AccsTaskBackend(BaseTaskBackend):
    """Run Django Tasks as ACCS jobs; see the module docstring for the mapping."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        self.tenant: str | None = self.options.get("TENANT")
        self.max_attempts = int(self.options.get("MAX_ATTEMPTS", 1))
        self.timeout_seconds = int(self.options.get("TIMEOUT_SECONDS", 600))
        self._known_services: set[str] = set()

    # ----------------------------------------------------------------------------------------
    # Services
    # ----------------------------------------------------------------------------------------

    def ensure_service(self, task: Task) -> Service:
        """Return the task's service, creating it when missing (an operator's later edits are kept)."""
        key = service_key(task)
        found = Service.objects.filter(key=key).first()
        if found is not None:
            return found
        from workflows.api import save_service

        fields = {
            "key": key, "executor": "python", "params_schema": ARGS_SCHEMA,
            "description": f"Django task {task.module_path} (queue {task.queue_name!r})",
            "executor_config": {"callable": ADAPTER, "task": task.module_path, "queue": task.queue_name},
            "max_attempts": self.max_attempts, "timeout_seconds": self.timeout_seconds,
        }
        try:
            with transaction.atomic():
                return save_service(**fields)
        except IntegrityError:  # another process created it first; the unique key decided
            return Service.objects.get(key=key)

    # ----------------------------------------------------------------------------------------
    # The Tasks API
    # ----------------------------------------------------------------------------------------

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Start a one-task job for ``task(*args, **kwargs)`` in the caller's transaction."""
        self.validate_task(task)
        params = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        with transaction.atomic():
            service = self.ensure_service(task)
            job = api.start_service(
                service, params=params, priority=task.priority, scheduled_at=task.run_after, tenant=self.tenant,
                source=JobSource.SYSTEM, source_ref=(SOURCE_REF_PREFIX + task.module_path)[:200],
            )
        result = TaskResult(
            task=task, id=str(job.id), status=TaskResultStatus.READY, enqueued_at=job.created_at,
            started_at=None, finished_at=None, last_attempted_at=None, args=params["args"],
            kwargs=params["kwargs"], backend=self.alias, errors=[], worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """Return the task result read from the job, its task and its attempts."""
        job = _task_job(result_id)
        row = TaskRow.objects.filter(job=job).first()
        attempts = list(Attempt.objects.filter(task=row).order_by("attempt_no")) if row else []
        return self._result(job, row, attempts)

    def _result(self, job: Job, row: TaskRow | None, attempts: list[Attempt]) -> TaskResult:
        config = job.service.executor_config
        task = _load_task(config["task"]).using(
            priority=max(-100, min(100, job.priority)), queue_name=config.get("queue") or None, backend=self.alias)
        params = (row.params if row else (job.step_params or {}).get(job.service.key)) or {}
        status = _status(job, row)
        result = TaskResult(
            task=task, id=str(job.id), status=status, enqueued_at=job.created_at,
            started_at=attempts[0].started_at if attempts else None,
            finished_at=job.finished_at if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
            last_attempted_at=attempts[-1].started_at if attempts else None,
            args=params.get("args", []), kwargs=params.get("kwargs", {}), backend=self.alias,
            errors=[_error(a) for a in attempts if a.status in FAILED_ATTEMPTS],
            worker_ids=[a.agent_id or a.node for a in attempts],
        )
        if status == TaskResultStatus.SUCCESSFUL and isinstance(row.results, dict):
            object.__setattr__(result, "_return_value", row.results.get("return_value"))
        return result


FAILED_ATTEMPTS = frozenset({AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.CANCELED})


def _task_job(result_id: str) -> Job:
    """Return the job behind a result id, or raise TaskResultDoesNotExist."""
    try:
        job_id = UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None
    job = (Job.objects.select_related("service")
           .filter(pk=job_id, service__executor_config__callable=ADAPTER).first())
    if job is None:
        raise TaskResultDoesNotExist(result_id)
    return job


def _status(job: Job, row: TaskRow | None) -> str:
    """Map the job and task states onto the four Tasks states."""
    if job.status == JobStatus.DONE:
        return TaskResultStatus.SUCCESSFUL
    if job.status in (JobStatus.ERROR, JobStatus.CANCELED):
        return TaskResultStatus.FAILED
    if row is not None and row.status in (TaskStatus.STARTING, TaskStatus.RUNNING):
        return TaskResultStatus.RUNNING
    return TaskResultStatus.READY  # queued, scheduled, or waiting for its next attempt


def _error(attempt: Attempt) -> TaskError:
    """Describe a failed attempt as Django's TaskError: exception class path and traceback."""
    if attempt.status == AttemptStatus.TIMEOUT:
        return TaskError(exception_class_path="builtins.TimeoutError", traceback=attempt.error_text)
    text = attempt.stderr_tail or attempt.error_text
    return TaskError(exception_class_path=_exception_path(text), traceback=text)


def _exception_path(traceback_text: str) -> str:
    """Read the exception class from a traceback's last line (Python prints builtins without a module)."""
    lines = [line for line in traceback_text.strip().splitlines() if line and not line.startswith(" ")]
    name = lines[-1].split(":", 1)[0].strip() if lines else ""
    if not name or " " in name:
        return "builtins.Exception"
    return name if "." in name else f"builtins.{name}"


def _load_task(path: str) -> Task:
    """Import the Task object a service runs (the module attribute the ``@task`` decorator made)."""
    found = import_string(path)
    if not isinstance(found, Task):
        raise TypeError(f"{path} is not a @task function (got {type(found).__name__})")
    return found


# --------------------------------------------------------------------------------------------
# The agent's side
# --------------------------------------------------------------------------------------------

def run_task(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Call the service's task function with the job's args and kwargs; return its JSON result.

    The ``python`` executor calls this as ``fn(params, ctx)``; an exception fails the attempt with
    its traceback, and a return value that is not JSON fails it with a TypeError naming the type.
    """
    task = _load_task(ctx.service_config["task"])
    args = list(params.get("args") or [])
    kwargs = dict(params.get("kwargs") or {})
    if task.takes_context:
        args.insert(0, TaskContext(task_result=_running_result(task, ctx)))
    value = task.call(*args, **kwargs)
    return {"return_value": normalize_json(value)}


def _running_result(task: Task, ctx: Any) -> TaskResult:
    """Return the result as the task itself sees it while it runs (status RUNNING, attempts so far)."""
    backend = task.get_backend()
    job = _task_job(str(ctx.task.job_id))
    row = TaskRow.objects.filter(pk=ctx.task.id).first()
    attempts = list(Attempt.objects.filter(task_id=ctx.task.id, attempt_no__lte=ctx.task.attempt).order_by("attempt_no"))
    if isinstance(backend, AccsTaskBackend):
        result = backend._result(job, row, attempts)
    else:  # pragma: no cover - the service was created by an ACCS backend under another alias
        result = AccsTaskBackend(task.backend, {})._result(job, row, attempts)
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    return result


def tasks_in(module: Any, *, backend: str | None = None) -> list[Task]:
    """Return the ``@task`` objects defined in ``module`` that use an ACCS backend (or ``backend``)."""
    found = []
    for value in vars(module).values():
        if isinstance(value, Task) and (backend is None or value.backend == backend):
            if isinstance(value.get_backend(), AccsTaskBackend):
                found.append(value)
    return found
