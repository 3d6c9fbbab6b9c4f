"""Python callables used by test services (executor ``python``)."""

from __future__ import annotations

from typing import Any


def noop(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    return {}


def echo(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    return {"echo": params}


def fail(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    raise RuntimeError(params.get("message", "failing on purpose"))


def sleep(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    import time

    seconds = float(params.get("seconds", 0.2))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx is not None and ctx.cancel.is_set():
            break
        time.sleep(0.01)
    return {"slept": seconds}


def orm_then_wait(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Query through the ORM, work a while without the database, query again (as task code does)."""
    from jobs.models import Task

    before = Task.objects.filter(status="running").count()
    sleep({"seconds": params.get("seconds", 1.0)}, ctx)
    after = Task.objects.filter(status="running").count()
    return {"running_before": before, "running_after": after}


def host_of(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Return the host the task runs for (a fan-out step's per-host output)."""
    return {"host": ctx.task.host if ctx is not None else None}


def inputs_of(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Return what the task received from its parent steps, whole and through ``task_output``."""
    assert ctx is not None
    return {"inputs": ctx.inputs, "task_output": {key: ctx.task_output(key) for key in params.get("parents", [])}}


def until_released(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Work until the file ``params["release"]`` exists (at most ``params["limit"]`` seconds, 120 by
    default), or until stopped: a task whose length the test decides."""
    import pathlib
    import time

    release = pathlib.Path(params["release"])
    deadline = time.monotonic() + float(params.get("limit", 120))
    while not release.exists() and time.monotonic() < deadline:
        if ctx is not None and ctx.cancel.is_set():
            return {"released": False}
        time.sleep(0.02)
    return {"released": release.exists()}
