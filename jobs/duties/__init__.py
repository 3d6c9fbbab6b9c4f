"""The builder leader's maintenance duties: one small module each, listed explicitly below.

Duties of the apps above ``jobs`` (the fleet's presence and wake duties, :mod:`nodes.duties`) are
not imported here: each app registers its own from its ``AppConfig.ready`` with
:func:`register_duties`, as River's maintainer takes its services from the caller, and the
builder runs them after its own.

Each duty has a name, how often it runs (``every`` seconds), a batch size (``limit`` per call)
and a budget per run (at most ``max_batches`` calls, stopping early when a call did less than a
full batch). Every duty is idempotent and bounded, so a duty that has a large backlog never
starves the others: the builder runs every due duty every tick, each within its own budget.
"""

from __future__ import annotations

from jobs.duties import (
    archive,
    attempt_rollup,
    cron,
    governor,
    narrow,
    partitions,
    prune,
    rate_window,
    rescue,
    scheduled,
)
from jobs.duties.base import Duty, register_duties, registered_duties

__all__ = ["Duty", "all_duties", "register_duties", "registered_duties"]


def all_duties(*, batch: int) -> list[Duty]:
    """Return the leader's duties, in the order they run each tick: rescue first, the apps' own last."""
    return [rescue.duty(batch=batch), scheduled.duty(batch=batch), narrow.duty(batch=batch), cron.duty(),
            governor.duty(), partitions.duty(), archive.duty(), rate_window.duty(), attempt_rollup.duty(),
            *prune.duties(), *registered_duties()]
