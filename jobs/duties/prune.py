"""Retention: prune finished jobs past their tenant's retention, old event receipts, and orphan artifact objects.

Four duties of one concern. The objects of pruned artifacts are deleted after the prune's
transaction commits; ``delete_pruned_objects`` finishes those a crash or a storage failure left
in the to-do table (:func:`events.artifacts.delete_scheduled_objects`). Pruning runs often in
small batches, so a steady stream of finished jobs leaves as steadily as it arrives. The sweep
lists one page of artifact keys per pass and deletes the objects no row records (uploads whose
database write failed); it remembers where it stopped, so a large bucket is covered over several
passes. The place is kept by this builder only: a new leader starts over, which costs a repeated
listing, never a wrong deletion.
"""

from __future__ import annotations

from accs_site.conf import accs
from events.artifacts import delete_scheduled_objects, sweep_orphan_objects
from jobs.duties.base import Duty
from jobs.receipts import prune_receipts as prune_old_receipts
from jobs.retention import prune_finished_jobs

SWEEP_PAGE = 1000


def prune(limit: int) -> int:
    return prune_finished_jobs(limit=limit).jobs


def delete_pruned_objects(limit: int) -> int:
    return delete_scheduled_objects(limit=limit)


def prune_receipts(limit: int) -> int:
    return prune_old_receipts(limit=limit, hours=accs.event_receipt_retention_hours)


class OrphanSweep:
    """One page of the orphan sweep per call, continuing where the previous call stopped."""

    def __init__(self) -> None:
        self.marker: str | None = None

    def __call__(self, limit: int) -> int:
        result = sweep_orphan_objects(limit=limit, grace_seconds=accs.orphan_grace_sec, start_after=self.marker)
        self.marker = result.next_marker
        return len(result.deleted)


def duties() -> list[Duty]:
    # Up to ten batches every few seconds keeps pace with millions of jobs an hour; when nothing
    # is due a pass is one index probe per tenant.
    return [Duty("prune_finished_jobs", every=5.0, limit=accs.retention_batch, run=prune, max_batches=10),
            Duty("delete_pruned_objects", every=30.0, limit=1000, run=delete_pruned_objects, max_batches=10),
            Duty("prune_event_receipts", every=60.0, limit=5000, run=prune_receipts, max_batches=10),
            Duty("sweep_orphan_objects", every=600.0, limit=SWEEP_PAGE, run=OrphanSweep())]
