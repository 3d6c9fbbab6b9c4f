"""Services and workflows defined in Python, in a ``pipelines`` module of each installed app.

    # myapp/pipelines.py
    from workflows import code
    from myapp.tasks import send_receipt          # a Django @task function

    fetch = code.service("fetch", executor="command", executor_config={"argv": ["fetch", "{url}"]},
                         params_schema={"type": "object", "properties": {"url": {"type": "string"}}})
    code.workflow("nightly", steps=[
        code.step("fetch", fetch, default_params={"url": "https://example.test/"}),
        code.step("report", "report-service", depends_on=["fetch"]),     # a service defined in the admin
        code.step("receipt", send_receipt, depends_on=["report"], default_params={"order": "R-1"}),
    ])

Declaring only records: nothing reads or writes the database at import. ``manage.py accs_sync``
discovers the modules (:func:`discover`, as Django's admin discovers ``admin.py``), compares them
with the stored rows and applies the difference (:mod:`workflows.sync`). Each declaration remembers
the file and line it was made on, so a problem the validator finds is reported there.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from django.apps import apps
from django.utils.module_loading import import_string, module_has_submodule

#: The module of each installed app that holds its definitions.
MODULE_NAME = "pipelines"


@dataclass(frozen=True)
class Origin:
    """Where a definition was written: the module and line stored on its rows, the file for errors."""

    module: str
    path: str
    line: int

    @property
    def label(self) -> str:
        """Return ``module:line``, what the rows record and the admin shows."""
        return f"{self.module}:{self.line}"

    @property
    def place(self) -> str:
        """Return ``file:line``, where an error points an editor."""
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class ServiceDef:
    """A service as code declares it: its key and the fields it sets (others take the model's defaults)."""

    key: str
    fields: Mapping[str, Any]
    origin: Origin


@dataclass(frozen=True)
class StepDef:
    """One step of a workflow: the step as stored (``data``) and, when code declares it, its service."""

    data: Mapping[str, Any]
    service: ServiceDef | None
    origin: Origin

    @property
    def key(self) -> str:
        return str(self.data.get("key"))


@dataclass(frozen=True)
class WorkflowDef:
    """A workflow as code declares it; ``accs_sync`` stores it as a version of ``name``."""

    name: str
    steps: tuple[StepDef, ...]
    description: str
    max_active_jobs: int
    origin: Origin


@dataclass
class Definitions:
    """What one discovery found, in declaration order."""

    services: dict[str, ServiceDef] = field(default_factory=dict)
    workflows: dict[str, WorkflowDef] = field(default_factory=dict)
    duplicates: list[tuple[str, Origin, Origin]] = field(default_factory=list)  # (what, first, second)

    def add_service(self, definition: ServiceDef) -> None:
        first = self.services.get(definition.key)
        if first is not None and first.fields != definition.fields:
            self.duplicates.append((f"service {definition.key!r}", first.origin, definition.origin))
        self.services.setdefault(definition.key, definition)

    def add_workflow(self, definition: WorkflowDef) -> None:
        first = self.workflows.get(definition.name)
        if first is not None:
            self.duplicates.append((f"workflow {definition.name!r}", first.origin, definition.origin))
        self.workflows.setdefault(definition.name, definition)


# Declarations made while a discovery imports the modules land here; outside one they are
# recorded too (a module imported by hand), and :func:`discover` starts from an empty registry.
_registry = Definitions()


def _origin(frame: FrameType | None) -> Origin:
    """Return where the caller of a declaring function is (the frame given is that caller's)."""
    if frame is None:  # pragma: no cover - CPython always has frames
        return Origin("?", "?", 0)
    return Origin(str(frame.f_globals.get("__name__", "?")), frame.f_code.co_filename, frame.f_lineno)


def _caller() -> Origin:
    frame = inspect.currentframe()
    return _origin(frame.f_back.f_back if frame and frame.f_back else None)


def service(key: str, **fields: Any) -> ServiceDef:
    """Declare a service ``key`` with the fields of :class:`workflows.models.Service` (keyword arguments).

    Unknown field names are reported by ``accs_sync`` with the rest of the validator's problems.
    """
    definition = ServiceDef(key=key, fields=dict(fields), origin=_caller())
    _registry.add_service(definition)
    return definition


def _is_django_task(value: Any) -> bool:
    # Duck-typed so this module imports nothing of the Tasks framework: a Task has these three.
    return all(hasattr(value, name) for name in ("func", "module_path", "queue_name")) and callable(
        getattr(value, "get_backend", None))


# The function that turns a Django ``@task`` into the service it runs as, by dotted path: the Tasks
# side lives in the jobs app above this one, which registers it from its AppConfig.ready().
_task_service_path: str | None = None


def register_task_services(path: str) -> None:
    """Name the function (``module.function``) that returns a ``@task``'s :class:`ServiceDef`."""
    global _task_service_path
    _task_service_path = path


def task_service(task: Any) -> ServiceDef:
    """Return the service a Django ``@task`` function runs as, placed where the function is defined."""
    if _task_service_path is None:
        raise TypeError(f"@task {task.module_path}: no Tasks backend is registered (is the jobs app installed?)")
    return import_string(_task_service_path)(task)


def takes_inputs(func: Any) -> bool:
    """Return whether a ``@task`` function declares an ``inputs`` parameter (its parents' outputs go there)."""
    try:
        parameter = inspect.signature(func).parameters.get("inputs")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def task_origin(func: Any) -> Origin:
    """Return where a function is defined (a ``@task`` step's service is placed there)."""
    func = inspect.unwrap(func)
    return Origin(func.__module__, inspect.getsourcefile(func) or "?", func.__code__.co_firstlineno)


def step(key: str, service: ServiceDef | str | Any, *, depends_on: Sequence[str] = (),
         default_params: Mapping[str, Any] | None = None, fan_out: str | Mapping[str, str] | None = None,
         on_failure: str | None = None, always: bool | None = None,
         output_schema: Mapping[str, Any] | None = None, when: str | None = None) -> StepDef:
    """Declare a workflow step run by ``service``: a :func:`service`, a stored service's key or a ``@task``.

    A ``@task`` step's ``default_params`` are the function's keyword arguments. ``output_schema`` (a JSON
    Schema) is what the step's output must meet: an attempt whose output breaks it fails. ``when`` (a
    PostgreSQL jsonpath predicate over ``{parent step key: output}``, e.g. ``"$.check.ok == true"``) makes
    the step run only when it holds; otherwise its tasks are skipped. ``fan_out`` is ``"hosts"`` (one task per
    host) or ``{"over": "$.pick.parcels"}``: one task per item of the list a parent returned, each given its
    item as ``inputs["item"]`` and its place as ``inputs["index"]``. A ``@task`` function that declares an
    ``inputs`` parameter is given ``{parent step key: output}`` in it.
    """
    declared: ServiceDef | None
    if isinstance(service, ServiceDef):
        declared, service_key = service, service.key
    elif isinstance(service, str):
        declared, service_key = None, service
    elif _is_django_task(service):
        declared = task_service(service)
        _registry.add_service(declared)
        service_key = declared.key
        if default_params and "inputs" in default_params and takes_inputs(service.func):
            raise TypeError(f"step {key!r}: {service.module_path} receives its parents' outputs as inputs=;"
                            " default_params cannot set it")
        default_params = {"args": [], "kwargs": dict(default_params or {})}
    else:
        raise TypeError(f"step {key!r}: service must be code.service(...), a service key or a @task function,"
                        f" not {type(service).__name__}")
    data: dict[str, Any] = {"key": key, "service": service_key, "depends_on": list(depends_on),
                            "default_params": dict(default_params or {})}
    if isinstance(fan_out, Mapping):
        fan_out = dict(fan_out)
    for name, value in (("fan_out", fan_out), ("on_failure", on_failure), ("always", always),
                        ("output_schema", output_schema), ("when", when)):
        if value is not None:
            data[name] = value
    return StepDef(data=data, service=declared, origin=_caller())


def workflow(name: str, *, steps: Iterable[StepDef], description: str = "", max_active_jobs: int = 0) -> WorkflowDef:
    """Declare the workflow ``name``; ``accs_sync`` stores a new version whenever its definition changes."""
    steps = tuple(steps)
    for item in steps:
        if not isinstance(item, StepDef):
            raise TypeError(f"workflow {name!r}: steps must be made with code.step(...), not {type(item).__name__}")
    definition = WorkflowDef(name=name, steps=steps, description=description, max_active_jobs=max_active_jobs,
                             origin=_caller())
    _registry.add_workflow(definition)
    return definition


def app_modules() -> list[str]:
    """Return ``<app>.pipelines`` for every installed app that has one (as autodiscover_modules looks)."""
    return [f"{config.name}.{MODULE_NAME}" for config in apps.get_app_configs()
            if module_has_submodule(config.module, MODULE_NAME)]


def discover(modules: Iterable[str] | None = None) -> Definitions:
    """Import (or import again) the definition modules and return what they declared.

    ``modules`` defaults to :func:`app_modules`. A module already imported is reloaded, so its
    declarations are recorded again into this discovery's registry.
    """
    global _registry
    previous, _registry = _registry, Definitions()
    try:
        for name in app_modules() if modules is None else modules:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
        return _registry
    finally:
        _registry = previous
