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


#: Duties other apps contribute, by the name they registered under: each a callable returning its duties.
_registered: dict[str, Callable[[], list[Duty]]] = {}


def register_duties(name: str, duties: Callable[[], list[Duty]]) -> None:
    """Add an app's duties to every builder's list (registering the same name again replaces it)."""
    _registered[name] = duties


def registered_duties() -> list[Duty]:
    """Return the duties the apps registered, in the order they registered them."""
    return [duty for duties in _registered.values() for duty in duties()]


def all_duties(*, batch: int) -> list[Duty]:
    """Return the leader's duties, in the order they run each tick: rescue first, the apps' own last."""
    # The duty modules import Duty from this package, so they are imported once it is complete.
    from jobs.duties import archive, cron, governor, partitions, prune, rate_window, rescue, scheduled

    return [rescue.duty(batch=batch), scheduled.duty(batch=batch), cron.duty(), governor.duty(), partitions.duty(),
            archive.duty(), rate_window.duty(), *prune.duties(), *registered_duties()]
