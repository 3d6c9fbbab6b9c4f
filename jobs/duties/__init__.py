"""The builder leader's maintenance duties: one small module each, listed explicitly below.

Each duty has a name, how often it runs (``every`` seconds), a batch size (``limit`` per call)
and a budget per run (at most ``max_batches`` calls, stopping early when a call did less than a
full batch). Every duty is idempotent and bounded, so a duty that has a large backlog never
starves the others: the builder runs every due duty every tick, each within its own budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Duty:
    """One maintenance service of the leader."""

    name: str
    every: float
    limit: int
    run: Callable[[int], int]  # do at most ``limit`` units of work; return how many were done
    max_batches: int = 1


def all_duties(*, batch: int) -> list[Duty]:
    """Return the leader's duties, in the order they run each tick (rescue first)."""
    from jobs.duties import archive, cron, governor, partitions, presence, prune, rate_window, rescue, scheduled, wake

    return [rescue.duty(batch=batch), scheduled.duty(batch=batch), cron.duty(), governor.duty(), wake.duty(),
            presence.duty(), partitions.duty(), archive.duty(), rate_window.duty(), *prune.duties()]
