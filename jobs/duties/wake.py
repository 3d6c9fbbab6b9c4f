"""Wake sleeping nodes whose labels are needed by work due soon.

The one duty that reaches into ``nodes``: the fleet owns how a machine is woken, the builder
owns when (it sees the due work).
"""

from __future__ import annotations

from jobs.duties import Duty


def wake(limit: int) -> int:
    from nodes.wake import wake_nodes

    return len(wake_nodes())  # bounded by the number of nodes, not by ``limit``


def duty() -> Duty:
    return Duty("wake_nodes", every=15.0, limit=1000, run=wake)
