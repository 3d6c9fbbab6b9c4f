"""What a builder duty is, and the registry other apps add their duties to."""

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
