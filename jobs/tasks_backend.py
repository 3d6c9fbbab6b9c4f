"""Django's Tasks API on ACCS: ``@task`` functions run on ACCS agents, with results in PostgreSQL.

    # settings.py
    TASKS = {"default": {"BACKEND": "jobs.tasks_backend.AccsTaskBackend",
                         "QUEUES": ["default", "emails"],
                         "OPTIONS": {"TENANT": "acme", "MAX_ATTEMPTS": 3}}}

    # myapp/tasks.py
    from django.tasks import task          # Django 5.2 (django-tasks): from django_tasks import task

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
  results), one ``TaskError`` per failed attempt (the raised exception's class, or one of the
  :class:`AccsTaskError` classes when the engine ended the attempt) and one worker id per attempt.
* Per-task options (retries and backoff, timeout, rate limit, concurrency key, isolation) are
  :class:`AccsTask` fields set on ``@task(...)`` or in ``OPTIONS``; they become the service's fields.

docs/tasks.md is the guide: options, statuses and errors, migrating from django-tasks and Celery.
"""

from __future__ import annotations

import builtins
import math
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from hashlib import sha1
from typing import Any, cast
from uuid import UUID

from django.db import IntegrityError, connection, transaction
from django.db.models import Field
from django.db.models.signals import post_delete, post_migrate, post_save
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.module_loading import import_string

# One code path for Django 6.1's built-in framework and the django-tasks backport on Django 5.2: the
# names are the same, only the package differs (Django 6.1 moved normalize_json to django.utils.json).
# ``task``, ``task_backends`` and the rest are importable from here too, so code that runs on both
# (ACCS's tests, the examples in docs/tasks.md) names one module.
try:
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, default_task_backend, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:
    # mypy reads Django 6.1's names (django-stubs); the backport's are the same API under other classes.
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, default_task_backend, task, task_backends  # type: ignore[assignment, no-redef]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[assignment]
    from django_tasks.base import Task, TaskError  # type: ignore[assignment]
    from django_tasks.exceptions import InvalidTaskError as InvalidTask, TaskResultDoesNotExist, TaskResultMismatch  # type: ignore[assignment]
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

from jobs import api
from jobs.definitions import TTL as DEFINITIONS_TTL
from jobs.models import Attempt, AttemptStatus, Job, JobSource, JobStatus, Task as TaskRow, TaskStatus
from jobs.narrow import widen
from workflows.code import ServiceDef, takes_inputs, task_origin
from workflows.models import Service
from workflows.validation import TASKS_ADAPTER

# Named here so the linter sees the re-exports above as used.
REEXPORTED = (default_task_backend, task, task_backends, TaskResultMismatch)

ADAPTER = TASKS_ADAPTER  # the callable of every Tasks service (workflows.validation allows it by name)
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
# A queue name of these characters and a module path of identifiers joined by dots map to a readable
# key that can be read back: "-" separates the queue from the path, whose dots become "-".
_PLAIN_QUEUE = re.compile(r"^[A-Za-z0-9_]+$")
_PLAIN_PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): ")


# --------------------------------------------------------------------------------------------
# The errors a result names when the engine, not the task's code, ended an attempt
# --------------------------------------------------------------------------------------------

class AccsTaskError(Exception):
    """The base of the errors ACCS records for attempts that the engine ended (``TaskError.exception_class``)."""


class TaskTimedOut(AccsTaskError, TimeoutError):
    """The attempt ran past its timeout and was stopped."""


class TaskCanceled(AccsTaskError):
    """An operator (or ``cancel_job``) canceled the task; a running attempt was stopped."""


class LeaseExpired(AccsTaskError):
    """The agent running the attempt stopped renewing its lease (it died or lost the database)."""


class BadTaskOutput(AccsTaskError):
    """The attempt's output could not be stored (too large, NaN or Infinity in the return value)."""


class TaskFailed(AccsTaskError):
    """The attempt failed without a Python exception to name (its process crashed or could not start)."""


# --------------------------------------------------------------------------------------------
# Per-task options, set where the task is defined or in TASKS[alias]["OPTIONS"]["TASKS"]
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class AccsTask(Task):
    """A Task with ACCS's options; ``@task(max_attempts=3, timeout=30, ...)`` makes one on an ACCS backend.

    None leaves an option to the backend's OPTIONS. Each option is a field of the service the task
    runs as (:data:`SERVICE_FIELDS`), so operators see it on the service's admin page.
    """

    max_attempts: int | None = None  # attempts in all, the first included (retries = max_attempts - 1)
    timeout: int | None = None  # seconds one attempt may run
    backoff: float | None = None  # seconds before the first retry, doubling (with jitter) after each
    backoff_cap: float | None = None  # the longest wait between two attempts, in seconds
    rate_limit: int | None = None  # task starts per rate_period across every agent (0: none)
    rate_period: int | None = None  # seconds
    max_concurrent: int | None = None  # attempts running at once across every agent (0: unlimited)
    concurrency_key: str | None = None  # params path, e.g. "kwargs.customer_id": a cap per value
    concurrency_limit: int | None = None  # attempts running at once per concurrency_key value
    isolation: str | None = None  # "process" (the default) or "thread"


# Each option, the backend-wide OPTIONS name of its default and the service field it sets.
OPTION_SETTINGS = {
    "max_attempts": ("MAX_ATTEMPTS", "max_attempts"), "timeout": ("TIMEOUT_SECONDS", "timeout_seconds"),
    "backoff": ("BACKOFF_SECONDS", "backoff_base_seconds"),
    "backoff_cap": ("BACKOFF_CAP_SECONDS", "backoff_cap_seconds"),
    "rate_limit": ("RATE_LIMIT", "rate_limit"), "rate_period": ("RATE_PERIOD_SECONDS", "rate_period_seconds"),
    "max_concurrent": ("MAX_CONCURRENT", "max_concurrent"),
    "concurrency_key": ("CONCURRENCY_KEY", "concurrency_key"),
    "concurrency_limit": ("CONCURRENCY_LIMIT", "concurrency_key_limit"),
    "isolation": ("ISOLATION", None),
}
# Django's own backends run a task once; a process can always be stopped at its timeout (a thread
# blocked in C code cannot, and a timed-out attempt could then overlap its retry).
OPTION_DEFAULTS = {"max_attempts": 1, "timeout": 600, "isolation": "process"}
ISOLATIONS = ("process", "thread")


def option_problems(options: dict[str, Any], *, where: str) -> list[str]:
    """Return what is wrong with task options (unknown names, values of the wrong kind or range)."""
    problems = [f"{where}: unknown option {name!r} (known: {', '.join(OPTION_SETTINGS)})"
                for name in options if name not in OPTION_SETTINGS]
    for name, value in options.items():
        if value is None or name not in OPTION_SETTINGS:
            continue
        if name == "isolation":
            if value not in ISOLATIONS:
                problems.append(f"{where}: isolation must be one of {ISOLATIONS}, not {value!r}")
        elif name == "concurrency_key":
            if not isinstance(value, str):
                problems.append(f"{where}: concurrency_key must be a params path such as 'kwargs.customer_id'")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                name in ("max_attempts", "timeout", "rate_period") and value < 1):
            problems.append(f"{where}: {name} must be a number of at least "
                            f"{1 if name in ('max_attempts', 'timeout', 'rate_period') else 0}, not {value!r}")
        elif name not in ("backoff", "backoff_cap") and int(value) != value:
            problems.append(f"{where}: {name} must be a whole number, not {value!r}")
    return problems


class AccsTaskResult(TaskResult):
    """A TaskResult that links to its job in the ACCS cockpit."""

    __slots__ = ()

    @property
    def accs_url(self) -> str | None:
        """Return the path of the job's admin page (None when the site does not serve ACCS's admin)."""
        try:
            return reverse("admin:jobs_job_change", args=[self.id])
        except NoReverseMatch:
            return None


class TaskServices:
    """This process's map of task (alias, module path, queue, options) to its service, with a time to live.

    Cleared whenever this process saves or deletes a service (:func:`connect_invalidation`); an
    entry older than ``ttl`` seconds is read again, so another process's edit is seen within that time.
    """

    def __init__(self, *, ttl: float = DEFINITIONS_TTL, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._items: dict[Hashable, tuple[float, Service]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Service | None:
        """Return the service cached for ``key``, or None when absent or older than the time to live."""
        with self._lock:
            hit = self._items.get(key)
        if hit is None or self._clock() - hit[0] >= self.ttl:
            return None
        return hit[1]

    def put(self, key: Hashable, service: Service) -> None:
        with self._lock:
            if len(self._items) >= self.max_entries:
                self._items.clear()
            self._items[key] = (self._clock(), service)

    def clear(self, *_args: Any, **_kwargs: Any) -> None:
        """Forget every mapping (connected to the services' save and delete signals)."""
        with self._lock:
            self._items.clear()


task_services = TaskServices()


def connect_invalidation() -> None:
    """Forget the task → service mappings whenever this process saves, deletes or flushes services."""
    post_save.connect(task_services.clear, sender=Service, dispatch_uid="accs-task-services-save")
    post_delete.connect(task_services.clear, sender=Service, dispatch_uid="accs-task-services-delete")
    # A flushed database (a test's teardown, ``manage.py flush``) loses every service without a delete signal.
    post_migrate.connect(task_services.clear, dispatch_uid="accs-task-services-migrate")


connect_invalidation()


def service_key(task: Task) -> str:
    """Return the ACCS service key of a task function on its queue: distinct tasks get distinct keys.

    Plain names give a readable key (``task-<queue>-<module-path-with-dashes>``) that maps back to one
    queue and path; any other name, or a key longer than 55 characters, ends in a digest of the exact
    queue and path instead.
    """
    readable = f"task-{task.queue_name}-{task.module_path.replace('.', '-')}"
    plain = _PLAIN_QUEUE.match(task.queue_name) and _PLAIN_PATH.match(task.module_path)
    if plain and len(readable) <= MAX_KEY:
        return readable
    digest = sha1(f"{task.queue_name}\0{task.module_path}".encode()).hexdigest()[:12]
    prefix = _SLUG_UNSAFE.sub("-", f"task-{task.queue_name}-{task.module_path}").strip("-")
    return f"{prefix[:MAX_KEY - 13].rstrip('-')}-{digest}"


class AccsTaskBackend(BaseTaskBackend):
    """Run Django Tasks as ACCS jobs; see the module docstring for the mapping."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True
    task_class = AccsTask

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        self.tenant: str | None = self.options.get("TENANT")
        self.defaults = {**OPTION_DEFAULTS, **{name: self.options[setting] for name, (setting, _) in
                                               OPTION_SETTINGS.items() if setting in self.options}}
        self.per_task: dict[str, dict[str, Any]] = dict(self.options.get("TASKS") or {})
        problems = option_problems(self.defaults, where=f"TASKS[{alias!r}]['OPTIONS']")
        for path, options in self.per_task.items():
            problems += option_problems(options, where=f"TASKS[{alias!r}]['OPTIONS']['TASKS'][{path!r}]")
        if problems:
            raise InvalidTask("; ".join(problems))
        self._importable: set[str] = set()
        self._checked: set[Task] = set()

    def validate_task(self, task: Task) -> None:
        """Check the task as Django's backends do, and its ACCS options."""
        super().validate_task(task)
        problems = option_problems(_declared_options(task), where=f"@task {task.module_path}")
        if problems:
            raise InvalidTask("; ".join(problems))

    def task_options(self, task: Task) -> dict[str, Any]:
        """Return the task's options: the backend's defaults, then the decorator's, then OPTIONS["TASKS"]'s.

        Settings win over the decorator, so a deployment can tune a task without changing its code.
        """
        return {**self.defaults, **_declared_options(task), **self.per_task.get(task.module_path, {})}

    # ----------------------------------------------------------------------------------------
    # Services
    # ----------------------------------------------------------------------------------------

    def service_fields(self, task: Task) -> dict[str, Any]:
        """Return the fields of the service a task runs as (its key, executor and options)."""
        options = self.task_options(task)
        fields = {
            "key": service_key(task), "executor": "python", "params_schema": ARGS_SCHEMA,
            "description": f"Django task {task.module_path} (queue {task.queue_name!r})",
            # A task is the site's own code: in a child process it needs the agent's settings and database.
            "executor_config": {"callable": ADAPTER, "task": task.module_path, "queue": task.queue_name,
                                "isolation": options["isolation"], "inherit_env": True, "options": options},
        }
        for name, (_, field) in OPTION_SETTINGS.items():
            if field is not None:  # an option no longer set goes back to the field's default
                value = options.get(name)
                model_field = cast("Field[Any, Any]", Service._meta.get_field(field))
                fields[field] = model_field.get_default() if value is None else value
        return fields

    def ensure_service(self, task: Task) -> Service:
        """Return the task's service, creating it when missing.

        An operator's later edits are kept until the task's options change in code or settings; then
        the service takes the new options. Raises InvalidTask when the key already belongs to another
        task or queue, so two tasks can never share a service (and read each other's queue name back).
        """
        fields = self.service_fields(task)
        found = Service.objects.filter(key=fields["key"]).first()
        if found is not None:
            _check_owner(found, task)
            if (found.executor_config or {}).get("options") == fields["executor_config"]["options"]:
                return found
        from workflows.api import save_service  # workflows imports nothing of jobs' Tasks side

        try:
            with transaction.atomic():
                return save_service(**fields)  # an existing service keeps the fields not named here
        except IntegrityError:  # another process created it first; the unique key decided
            found = Service.objects.get(key=fields["key"])
            _check_owner(found, task)
            return found

    # ----------------------------------------------------------------------------------------
    # The Tasks API
    # ----------------------------------------------------------------------------------------

    def service_for(self, task: Task) -> Service:
        """Return the task's service as :meth:`ensure_service` does, from this process's cache when it can.

        The common path of ``enqueue()``: a task already mapped to its service costs no query. The
        mapping (:data:`task_services`) is dropped at once when this process saves or deletes a
        service (the admin's edit), and read again after the definitions' time to live (10 s) when
        another process does, as :func:`jobs.api.start_service` resolves a service by key. It is
        keyed by the task's options too, so changed options still reach the service. A service read
        or created inside an uncommitted transaction is remembered only once that transaction
        commits: a rollback must not leave a mapping to a row that does not exist. A service another
        process deletes (possible only while no job names it) stays mapped here for up to the time
        to live: in autocommit enqueue then looks it up again, inside a transaction the reference
        fails at the caller's commit (an IntegrityError), as a start by key does.
        """
        options = self.task_options(task)
        cache_key = (self.alias, task.module_path, task.queue_name, tuple(sorted(options.items())))
        service = task_services.get(cache_key)
        if service is not None:
            return service
        service = self.ensure_service(task)
        if connection.in_atomic_block:
            transaction.on_commit(lambda: task_services.put(cache_key, service))
        else:
            task_services.put(cache_key, service)
        return service

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Start a one-task job for ``task(*args, **kwargs)`` in the caller's transaction.

        A task whose service this process already knows is started by one statement (jobs.enqueue's
        one-statement start): no service lookup, no savepoint. Outside a transaction (autocommit) a
        cached service that was deleted meanwhile by another process is looked up afresh once.
        """
        self._check_task(task)
        params: dict[str, Any] = {"args": [_json_argument(value, f"argument {i}") for i, value in enumerate(args)],
                  "kwargs": {_json_key(name): _json_argument(value, f"keyword argument {name!r}")
                             for name, value in dict(kwargs).items()}}
        options: dict[str, Any] = {
            "params": params, "priority": task.priority, "scheduled_at": task.run_after, "tenant": self.tenant,
            "source": JobSource.SYSTEM, "source_ref": (SOURCE_REF_PREFIX + task.module_path)[:200]}
        service = self.service_for(task)
        try:
            job = api.start_service(service, **options)
        except IntegrityError:
            # Only a service row deleted since it was cached breaks the insert's reference, checked at
            # the end of the statement in autocommit (inside a transaction: at its commit, past here).
            # Nothing was written, so forget the mapping and start with a fresh one.
            if connection.in_atomic_block:
                raise
            task_services.clear()
            job = api.start_service(self.service_for(task), **options)
        result = AccsTaskResult(
            task=task, id=str(job.id), status=TaskResultStatus.READY, enqueued_at=job.created_at,
            started_at=None, finished_at=None, last_attempted_at=None, args=params["args"],
            kwargs=params["kwargs"], backend=self.alias, errors=[], worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    def _check_task(self, task: Task) -> None:
        """Validate the task and check that agents can import it, once per distinct task object."""
        try:
            if task in self._checked:
                return
        except TypeError:  # an unhashable field (a task class of another library): check every time
            self.validate_task(task)
            self._check_importable(task)
            return
        self.validate_task(task)
        self._check_importable(task)
        if len(self._checked) >= 1000:  # run_after makes a new object per call for some callers
            self._checked.clear()
        self._checked.add(task)

    def _check_importable(self, task: Task) -> None:
        """Refuse a task that agents could not import by its module path (a lambda, a nested function)."""
        if task.module_path in self._importable:
            return
        if not imports_back(task):
            raise InvalidTask(
                f"task {task.module_path!r} cannot be imported by its module path, so no agent could run it: "
                "define it with def at module level and decorate it with @task")
        self._importable.add(task.module_path)

    def get_result(self, result_id: str) -> TaskResult:
        """Return the task result read from the job, its task and its attempts."""
        job = _task_job(result_id)
        row = TaskRow.objects.filter(job=job).first()
        attempts = list(Attempt.objects.filter(task=row).order_by("attempt_no")) if row else []
        return self._result(job, row, attempts)

    def _result(self, job: Job, row: TaskRow | None, attempts: list[Attempt]) -> TaskResult:
        service = job.service
        assert service is not None, "a job of the Tasks API runs one service"
        config = service.executor_config
        task = _load_task(config["task"]).using(
            priority=max(-100, min(100, job.priority)), queue_name=config.get("queue") or None, backend=self.alias,
            run_after=_run_after(job))
        params = (row.params if row else (job.step_params or {}).get(service.key)) or {}
        status = _status(job, row)
        errors = [_error(a) for a in attempts if a.status in FAILED_ATTEMPTS]
        if status == TaskResultStatus.FAILED and not errors:  # canceled (or failed) before any attempt ran
            errors = [_engine_error(TaskCanceled if job.status == JobStatus.CANCELED else TaskFailed,
                                    job.error_message or job.error_code)]
        result = AccsTaskResult(
            task=task, id=str(job.id), status=status, enqueued_at=job.created_at,
            started_at=attempts[0].started_at if attempts else None,
            finished_at=_finished_at(job, row) if status in FINISHED else None,
            last_attempted_at=attempts[-1].started_at if attempts else None,
            args=params.get("args", []), kwargs=params.get("kwargs", {}), backend=self.alias,
            errors=errors, worker_ids=[a.agent_id or a.node for a in attempts],
        )
        if status == TaskResultStatus.SUCCESSFUL and row is not None and isinstance(row.results, dict):
            object.__setattr__(result, "_return_value", row.results.get("return_value"))
        return result


FAILED_ATTEMPTS = frozenset({AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.CANCELED})
FINISHED = frozenset({TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED})
TASK_FINAL = frozenset({TaskStatus.DONE, TaskStatus.ERROR, TaskStatus.CANCELED, TaskStatus.SKIPPED})


def imports_back(task: Task) -> bool:
    """Return whether the task's module path imports back to it (what an agent does to run it)."""
    try:
        found = import_string(task.module_path)
    except ImportError:
        return False
    return isinstance(found, Task) and found.func is task.func


def _declared_options(task: Task) -> dict[str, Any]:
    """Return the options set on the ``@task`` decorator (those not left to the backend)."""
    if not isinstance(task, AccsTask):
        return {}
    return {name: getattr(task, name) for name in OPTION_SETTINGS if getattr(task, name) is not None}


def _check_owner(service: Service, task: Task) -> None:
    config = service.executor_config or {}
    owner = (config.get("callable"), config.get("task"), config.get("queue"))
    if owner != (ADAPTER, task.module_path, task.queue_name):
        raise InvalidTask(
            f"ACCS service {service.key!r} already runs {config.get('task') or config.get('callable')!r} on queue "
            f"{config.get('queue')!r}; it cannot also run {task.module_path!r} on queue {task.queue_name!r} "
            "(rename the queue or the function, or remove the other service)")


def _json_key(name: Any) -> str:
    if not isinstance(name, str) or "\0" in name:
        raise TypeError(f"keyword argument name {name!r} cannot be stored: names must be strings without NUL")
    return name


def _json_argument(value: Any, where: str) -> Any:
    """Return ``value`` as JSON the database stores, or raise naming ``where`` and what cannot be stored."""
    try:
        value = normalize_json(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where} cannot be stored as JSON: {exc}") from None
    problem = _json_problem(value)
    if problem:
        raise ValueError(f"{where} cannot be stored as JSON: {problem}")
    return value


def _json_problem(value: Any) -> str:
    """Return what PostgreSQL's jsonb refuses in ``value`` (NaN, Infinity, NUL characters), or ""."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a JSON number"
    if isinstance(value, str) and "\0" in value:
        return "a string contains a NUL character"
    if isinstance(value, dict):
        return next((p for k, v in value.items() for p in (_json_problem(k), _json_problem(v)) if p), "")
    if isinstance(value, list):
        return next((p for v in value for p in (_json_problem(v),) if p), "")
    return ""


def _task_job(result_id: str) -> Job:
    """Return the job behind a result id, or raise TaskResultDoesNotExist."""
    try:
        job_id = UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None
    widen([job_id])  # a task just enqueued on the narrow path (jobs.narrow) reads as its queued job
    job = (Job.objects.select_related("service")
           .filter(pk=job_id, service__executor_config__callable=ADAPTER).first())
    if job is None:
        raise TaskResultDoesNotExist(result_id)
    return job


def _run_after(job: Job) -> Any:
    """Return the task's run_after: the job's scheduled_at when enqueue gave one.

    A job started without one is scheduled at its creation, in the same statement and so at the same
    instant (PostgreSQL's now()); a run_after given by a caller cannot fall on that instant.
    """
    return None if job.scheduled_at == job.created_at else job.scheduled_at


def _status(job: Job, row: TaskRow | None) -> TaskResultStatus:
    """Map the job and task states onto the four Tasks states.

    A job canceled while its task runs is final at once, but its attempt goes on until the agent
    stops it: the result stays RUNNING until the task row is final too, so a result that says
    finished never changes afterwards.
    """
    if row is not None and row.status in (TaskStatus.STARTING, TaskStatus.RUNNING):
        return TaskResultStatus.RUNNING
    if job.status == JobStatus.DONE:
        return TaskResultStatus.SUCCESSFUL
    if job.status in (JobStatus.ERROR, JobStatus.CANCELED):
        return TaskResultStatus.FAILED
    return TaskResultStatus.READY  # queued, scheduled, or waiting for its next attempt


def _finished_at(job: Job, row: TaskRow | None) -> Any:
    """Return when the result finished: the task's end once it has one, else the job's."""
    if row is not None and row.status in TASK_FINAL and row.finished_at:
        return max(row.finished_at, job.finished_at) if job.finished_at else row.finished_at
    return job.finished_at


def _engine_error(kind: type[BaseException], text: str) -> TaskError:
    return TaskError(exception_class_path=f"{kind.__module__}.{kind.__qualname__}", traceback=text)


def _error(attempt: Attempt) -> TaskError:
    """Describe a failed attempt as Django's TaskError: the exception's class path and its traceback.

    An attempt whose code raised names the exception (the python executor writes its class path at
    the start of the error); an attempt the engine ended names one of the classes above.
    """
    text = attempt.error_text or ""
    if attempt.status == AttemptStatus.TIMEOUT:
        return _engine_error(TaskTimedOut, text)
    if attempt.status == AttemptStatus.CANCELED:
        return _engine_error(TaskCanceled, text)
    if text.startswith("lease_expired"):
        return _engine_error(LeaseExpired, text)
    if text.startswith("bad output"):
        return _engine_error(BadTaskOutput, text)
    path = _raised_class_path(text)
    if path is None:
        return _engine_error(TaskFailed, attempt.stderr_tail or text)
    trace = attempt.stderr_tail or text
    return TaskError(exception_class_path=path, traceback=trace if trace.endswith("\n") else trace + "\n")


def _raised_class_path(error_text: str) -> str | None:
    """Return the class path at the start of an error ``Name: message``, or None when it names none."""
    match = _EXCEPTION_NAME.match(error_text)
    if match is None:
        return None
    name = match.group(1)
    if "." in name:
        return name
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return f"builtins.{name}"
    return None


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

    The ``python`` executor calls this as ``fn(params, ctx)``, in the agent's worker thread or in a
    child process (``isolation``). ``task_started`` is sent before the function runs and
    ``task_finished`` after it, as Django's own backends send them; an exception (any
    BaseException) fails the attempt with its class path and traceback, and a return value that
    is not JSON fails it with a TypeError naming the type.
    """
    task = _load_task(ctx.service_config["task"])
    own_job = _is_own_job(ctx)
    result = _running_result(task, ctx, own_job=own_job)
    sender = type(task.get_backend())
    task_started.send(sender=sender, task_result=result)
    args = list(params.get("args") or [])
    kwargs = dict(params.get("kwargs") or {})
    if task.takes_context:
        args.insert(0, TaskContext(task_result=result))
    if takes_inputs(task.func) and not own_job:
        # A step of a workflow: the function declared where its parents' outputs go (workflows.code.step).
        kwargs["inputs"] = dict(ctx.inputs)
    try:
        value = normalize_json(task.call(*args, **kwargs))
    except BaseException as exc:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        object.__setattr__(result, "finished_at", timezone.now())
        result.errors.append(TaskError(exception_class_path=_class_path_of(exc, ctx),
                                       traceback="".join(traceback.format_exception(*sys.exc_info()))))
        task_finished.send(sender=sender, task_result=result)  # inside the handler: receivers see exc_info
        raise
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(sender=sender, task_result=result)
    return {"return_value": value}


def _class_path_of(exc: BaseException, ctx: Any) -> str:
    """Return the class path a result will name for ``exc`` (the executor's stop is the engine's error)."""
    kind = type(exc)
    if kind.__name__ == "TaskStopped" and kind.__module__ == "nodes.executors":
        kind = TaskCanceled if ctx.cancel.is_set() else TaskTimedOut
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_own_job(ctx: Any) -> bool:
    """Return whether the running task is the one task of a job started by ``enqueue()`` (not a workflow's step)."""
    return Job.objects.filter(pk=ctx.task.job_id, service__isnull=False).exists()


def _running_result(task: Task, ctx: Any, *, own_job: bool) -> TaskResult:
    """Return the result as the task itself sees it while it runs (status RUNNING, attempts so far)."""
    backend = task.get_backend()
    if not own_job:
        return _step_result(task, ctx)
    job = _task_job(str(ctx.task.job_id))
    row = TaskRow.objects.filter(pk=ctx.task.id).first()
    attempts = list(Attempt.objects.filter(task_id=ctx.task.id, attempt_no__lte=ctx.task.attempt)
                    .order_by("attempt_no"))
    if not isinstance(backend, AccsTaskBackend):  # pragma: no cover - the service was made under another alias
        backend = AccsTaskBackend(task.backend, {})
    result = backend._result(job, row, attempts)
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    object.__setattr__(result, "finished_at", None)
    return result


def _step_result(task: Task, ctx: Any) -> TaskResult:
    """Return the running result of a ``@task`` run as a step of a workflow (workflows.code): its id is the
    task row's, since the job is the workflow's, not the function's."""
    row = TaskRow.objects.get(pk=ctx.task.id)
    params = row.params or {}
    return AccsTaskResult(
        task=task, id=str(row.id), status=TaskResultStatus.RUNNING, enqueued_at=row.created_at,
        started_at=row.started_at, finished_at=None, last_attempted_at=row.started_at,
        args=params.get("args", []), kwargs=params.get("kwargs", {}), backend=task.backend, errors=[],
        worker_ids=[row.node] if row.node else [])


def task_step_service(task: Task) -> ServiceDef:
    """Return the service a ``@task`` used as a workflow step runs as (workflows.code), as enqueue makes it."""
    backend = task.get_backend()
    if not isinstance(backend, AccsTaskBackend):
        raise TypeError(f"@task {task.module_path} does not use an ACCS Tasks backend (TASKS[{task.backend!r}])")
    fields = backend.service_fields(task)
    return ServiceDef(key=fields.pop("key"), fields=fields, origin=task_origin(task.func))


def tasks_in(module: Any, *, backend: str | None = None) -> list[Task]:
    """Return the ``@task`` objects defined in ``module`` that use an ACCS backend (or ``backend``).

    A task no agent could import by its module path (a lambda) is left out: enqueue refuses it.
    """
    found = []
    for value in vars(module).values():
        if isinstance(value, Task) and (backend is None or value.backend == backend):
            if isinstance(value.get_backend(), AccsTaskBackend) and imports_back(value):
                found.append(value)
    return found
