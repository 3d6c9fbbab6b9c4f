"""The fleet's duties for the builder's leader: mark silent nodes lost, wake sleeping nodes work needs.

The fleet owns presence and how a machine is woken; the builder's leader owns the clock that
notices silence and sees the work coming due. So the duties live here and :class:`nodes.apps.NodesConfig`
registers them with the builder (:func:`jobs.duties.register_duties`); the builder imports nothing from ``nodes``.
"""

from __future__ import annotations

from accs_site.conf import accs
from jobs.duties.base import Duty
from nodes.api import mark_lost
from nodes.wake import wake_nodes


def mark_lost_nodes(limit: int) -> int:
    """Mark online nodes lost whose agents stopped heartbeating without signing off (killed, machine gone)."""
    return len(mark_lost(after_seconds=accs.node_lost_after_sec, limit=limit))


def wake(limit: int) -> int:
    """Wake sleeping nodes whose labels are needed by work due soon."""
    return len(wake_nodes())  # bounded by the number of nodes, not by ``limit``


def duties() -> list[Duty]:
    """Return the fleet's duties, in the order they run each tick."""
    return [Duty("wake_nodes", every=15.0, limit=1000, run=wake),
            Duty("mark_lost_nodes", every=15.0, limit=1000, run=mark_lost_nodes)]
