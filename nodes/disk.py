"""Disk watch: agents sample disk use every 60 s; emergency pauses claiming.

Levels follow the share of space in use as ``df`` reports it (used / (used + available)):
warning ≥ 85 %, critical ≥ 90 %, emergency ≥ 95 %. A sample is stored per call and only the
last :data:`KEEP_SAMPLES` per node are kept. An event is written when a node's level changes (not on
every sample), and ``Node.disk_level`` holds the current level, so :func:`claiming_paused` is one
primary-key read.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from events.timeline import EventRow, write_events
from nodes.models import DiskLevel, DiskSample, Node

KEEP_SAMPLES = 1000
THRESHOLDS: tuple[tuple[float, DiskLevel], ...] = (
    (95.0, DiskLevel.EMERGENCY), (90.0, DiskLevel.CRITICAL), (85.0, DiskLevel.WARNING),
)
# Seed 001: warning is a log line, critical is logged as a warning, emergency as an error.
EVENT_LEVEL = {DiskLevel.OK: "info", DiskLevel.WARNING: "warn", DiskLevel.CRITICAL: "warn",
               DiskLevel.EMERGENCY: "error"}
ORDER = [DiskLevel.OK, DiskLevel.WARNING, DiskLevel.CRITICAL, DiskLevel.EMERGENCY]


def level_for(used_pct: float) -> DiskLevel:
    """Return the disk level for a percentage in use."""
    for threshold, level in THRESHOLDS:
        if used_pct >= threshold:
            return level
    return DiskLevel.OK


def sample_disk(node_name: str, path: str, *, usage: Sequence[int] | None = None,
                now: datetime | None = None) -> DiskSample:
    """Measure ``path`` (or take ``usage`` = (total, used, free) bytes), store a sample, track the level.

    On a level change ``Node.disk_level`` is updated and a ``disk`` event written, in the same
    transaction. Samples beyond the newest :data:`KEEP_SAMPLES` of the node are deleted. Raises
    LookupError when the node is not registered.
    """
    now = now or timezone.now()
    total, used, free = (usage if usage is not None else shutil.disk_usage(path))[:3]
    # df's definition: space reserved for root counts neither as used nor as available.
    used_pct = round(100.0 * used / (used + free), 3) if used + free > 0 else 0.0
    level = level_for(used_pct)
    with transaction.atomic(), connection.cursor() as cur:
        # The node row lock orders concurrent samplers of one node, so each change is reported once.
        cur.execute("SELECT disk_level FROM accs_node WHERE name = %s FOR UPDATE", [node_name])
        row = cur.fetchone()
        if row is None:
            raise LookupError(f"no node {node_name!r}; the agent registers its node before sampling")
        previous = row[0] or DiskLevel.OK
        sample = DiskSample.objects.create(node_id=node_name, ts=now, path=path, total_bytes=total, used_bytes=used,
                                           used_pct=used_pct, level=level)
        cur.execute(
            "DELETE FROM accs_disk_sample WHERE id IN (SELECT id FROM accs_disk_sample WHERE node_id = %s"
            " ORDER BY ts DESC, id DESC OFFSET %s)",
            [node_name, KEEP_SAMPLES],
        )
        if level != previous:
            cur.execute("UPDATE accs_node SET disk_level = %s WHERE name = %s", [level, node_name])
            worse = previous not in ORDER or ORDER.index(level) > ORDER.index(previous)
            note = "; claiming paused" if level == DiskLevel.EMERGENCY else (
                "; claiming resumes" if previous == DiskLevel.EMERGENCY else "")
            write_events([EventRow(
                type="disk", level=EVENT_LEVEL[level] if worse else "info", source=f"node:{node_name}",
                message=f"disk {used_pct:.1f}% on {node_name} ({path}): {previous} → {level}{note}",
                data={"node": node_name, "path": path, "used_pct": used_pct, "from": previous, "to": str(level),
                      "total_bytes": total, "used_bytes": used, "free_bytes": free},
            )], cursor=cur)
    return sample


def claiming_paused(node_name: str) -> bool:
    """Return True while the node's disk is at emergency level (agents claim nothing then)."""
    return Node.objects.filter(name=node_name, disk_level=DiskLevel.EMERGENCY).exists()


__all__ = ["KEEP_SAMPLES", "claiming_paused", "level_for", "sample_disk"]
