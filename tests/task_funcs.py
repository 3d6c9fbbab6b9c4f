"""``@task`` functions the Tasks-backend tests enqueue; agents import them by module path."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from django_tasks import task


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
