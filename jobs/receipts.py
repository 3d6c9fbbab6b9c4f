"""Receipts of events received over HTTP, so a repeated delivery (same event id) fires nothing twice.

A receipt is kept for ``ACC_EVENT_RECEIPT_RETENTION_HOURS`` (default a week): long enough for any
sender's retries, and a builder duty deletes older ones, so a caller who sends a new event id per
request cannot grow the table without bound.

The model lives apart from :mod:`jobs.models` because it belongs to the HTTP front door only;
:class:`jobs.apps.JobsConfig` imports this module so Django registers it with the ``jobs`` app.
"""

from __future__ import annotations

from django.db import connection, models
from django.utils.timezone import now


class EventReceipt(models.Model):
    """One event accepted by ``POST /api/v1/events/{name}`` under a caller-chosen event id."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    event_id = models.CharField(max_length=200)
    name = models.CharField(max_length=200)
    body_digest = models.CharField(max_length=64, help_text="SHA-256 of the event's name and context.")
    result = models.JSONField(default=dict, help_text="What the first delivery did: jobs, deduplicated, errors.")
    created_at = models.DateTimeField(default=now)

    class Meta:
        app_label = "jobs"
        db_table = "accs_event_receipt"
        constraints = [models.UniqueConstraint(fields=["tenant", "event_id"], name="event_receipt_unique_id")]
        # Pruning from the oldest end.
        indexes = [models.Index(fields=["created_at"], name="event_receipt_created_idx")]

    def __str__(self) -> str:
        return f"{self.name} #{self.event_id}"


PRUNE_RECEIPTS_SQL = """
-- Receipts older than the retention: a bounded batch from the oldest end (event_receipt_created_idx),
-- so a long pause never turns into one huge delete.
DELETE FROM accs_event_receipt WHERE id = ANY(ARRAY(
    SELECT r.id FROM accs_event_receipt r
     WHERE r.created_at < now() - make_interval(hours => %(hours)s)
     ORDER BY r.created_at
     LIMIT %(limit)s))
"""


def prune_receipts(*, limit: int, hours: int) -> int:
    """Delete up to ``limit`` receipts older than ``hours``; return how many."""
    with connection.cursor() as cur:
        cur.execute(PRUNE_RECEIPTS_SQL, {"limit": limit, "hours": hours})
        return cur.rowcount
