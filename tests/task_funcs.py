"""``@task`` functions the Tasks-backend tests enqueue; agents import them by module path."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from jobs.tasks_backend import task, task_finished, task_started


@task()
def add(a: int, b: int) -> int:
    """Return the sum."""
    return a + b


@task()
def boom(message: str) -> None:
    """Fail with a ValueError carrying ``message``."""
    raise ValueError(message)


@task(takes_context=True)
def whoami(context, tag: str) -> dict:
    """Return the attempt number and result id the context carries."""
    return {"tag": tag, "attempt": context.attempt, "id": context.task_result.id}


@task()
def record(path: str, label: str) -> str:
    """Append ``label`` to the file at ``path`` (the run order) and return it."""
    with Path(path).open("a") as out:
        out.write(json.dumps(label) + "\n")
    return label


@task()
async def async_double(value: int) -> int:
    """An async task: await, then return twice the value."""
    await asyncio.sleep(0)
    return value * 2


@task()
def not_json() -> object:
    """Return something JSON cannot carry."""
    return {1, 2}


@task(queue_name="other")
def pid() -> int:
    """Return the agent's process id."""
    return os.getpid()


class ShopError(Exception):
    """An exception a site defines; a result names it by its module path."""

    class Nested(Exception):
        """A nested class: its qualified name has a dot of its own."""


@task()
def raises(kind: str, message: str) -> None:
    """Raise the exception ``kind`` names (a site's own, a nested one, a builtin, SystemExit)."""
    exceptions = {"shop": ShopError, "nested": ShopError.Nested, "value": ValueError, "exit": SystemExit,
                  "base": GeneratorExit}
    raise exceptions[kind](message)


@task()
def exits(code: int) -> None:
    """Leave through SystemExit, as ``sys.exit`` does."""
    raise SystemExit(code)


@task(takes_context=True)
def queue_of(context) -> str:
    """Return the queue name the running task reads back from its own result."""
    return context.task_result.task.queue_name


@task()
def hold(path: str, seconds: float) -> str:
    """Write ``started`` to ``path``, then keep running (ignoring a cancel) until ``path`` says ``go``."""
    marker = Path(path)
    marker.write_text("started")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and marker.read_text() != "go":
        time.sleep(0.05)
    return "held"


@task()
def returns_nan() -> float:
    """Return NaN, which JSON (and so the result) cannot carry."""
    return float("nan")


not_importable = task()(lambda: 1)  # a module-level lambda: no module path leads back to it


def _record_signal(name: str):
    def receiver(sender, task_result, **kwargs) -> None:
        path = os.environ.get("ACCS_TEST_SIGNAL_LOG")
        if not path:
            return
        record = {"signal": name, "sender": sender.__name__, "id": task_result.id, "status": str(task_result.status),
                  "task": task_result.task.module_path, "args": task_result.args, "pid": os.getpid(),
                  "started_at": bool(task_result.started_at), "finished_at": bool(task_result.finished_at),
                  "workers": len(task_result.worker_ids),
                  "errors": [e.exception_class_path for e in task_result.errors]}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")

    return receiver


_on_started = _record_signal("task_started")
_on_finished = _record_signal("task_finished")
task_started.connect(_on_started)
task_finished.connect(_on_finished)


@task(max_attempts=3, backoff=0, timeout=20, rate_limit=500, rate_period=10, concurrency_key="kwargs.customer",
      concurrency_limit=2, isolation="thread")
def flaky(path: str, customer: str = "c1", fail_times: int = 1) -> int:
    """Fail the first ``fail_times`` attempts (counted in the file at ``path``), then return the attempt."""
    counter = Path(path)
    seen = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(seen))
    if seen <= fail_times:
        raise ConnectionError(f"attempt {seen} failed")
    return seen


@task(timeout=1)
def slow(seconds: float) -> str:
    """Sleep longer than the decorator's timeout allows."""
    time.sleep(seconds)
    return "woke"


@task()
def count_parcels(order: str, inputs: dict | None = None) -> str:
    """A workflow step: its parents' outputs arrive in ``inputs``."""
    return f"{order}: {len((inputs or {}).get('pick', {}).get('parcels', []))} parcel(s)"
