"""Mark nodes lost whose agents stopped heartbeating without signing off (killed, machine gone).

Reaches into ``nodes`` as the wake duty does: the fleet owns presence, the builder's leader owns
the clock that notices silence.
"""

from __future__ import annotations

from accs_site.conf import accs
from jobs.duties import Duty


def mark_lost(limit: int) -> int:
    from nodes.api import mark_lost as mark

    return len(mark(after_seconds=accs.node_lost_after_sec, limit=limit))


def duty() -> Duty:
    return Duty("mark_lost_nodes", every=15.0, limit=1000, run=mark_lost)
