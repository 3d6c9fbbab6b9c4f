"""``@task`` functions of the Tasks-framework benchmark (bench/tasks_api.py); agents import them."""

from __future__ import annotations

import time

from jobs.tasks_backend import task


@task()
def noop(n: int) -> None:
    """Do nothing (the peers' benchmark task)."""
    return None


@task()
def stamp(t0: float) -> float:
    """Return the pick-up latency in ms: now minus the enqueue time the caller passed."""
    return (time.time() - t0) * 1000


@task(isolation="thread")
def stamp_thread(t0: float) -> float:
    """The same, run in the agent's worker thread."""
    return (time.time() - t0) * 1000
