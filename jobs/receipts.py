"""Receipts of events received over HTTP, so a repeated delivery (same event id) fires nothing twice.

The model lives apart from :mod:`jobs.models` because it belongs to the HTTP front door only;
:class:`jobs.apps.JobsConfig` imports this module so Django registers it with the ``jobs`` app.
"""

from __future__ import annotations

from django.db import models
from django.utils.timezone import now


class EventReceipt(models.Model):
    """One event accepted by ``POST /api/v1/events/{name}`` under a caller-chosen event id."""

    tenant = models.ForeignKey("jobs.Tenant", on_delete=models.CASCADE, related_name="+")
    event_id = models.CharField(max_length=200)
    name = models.CharField(max_length=200)
    body_digest = models.CharField(max_length=64, help_text="SHA-256 of the event's name and context.")
    result = models.JSONField(default=dict, help_text="What the first delivery did: jobs, deduplicated, errors.")
    created_at = models.DateTimeField(default=now)

    class Meta:
        app_label = "jobs"
        db_table = "accs_event_receipt"
        constraints = [models.UniqueConstraint(fields=["tenant", "event_id"], name="event_receipt_unique_id")]

    def __str__(self) -> str:
        return f"{self.name} #{self.event_id}"
