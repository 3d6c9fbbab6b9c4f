"""What happened: the append-only timeline (range-partitioned by month) and stored artifacts."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone


class Level(models.TextChoices):
    """Severity of an event."""

    DEBUG = "debug", "Debug"
    INFO = "info", "Info"
    WARN = "warn", "Warning"
    ERROR = "error", "Error"


class EventType(models.TextChoices):
    """Common event types; other strings are allowed (``type`` is free text)."""

    STATUS = "status", "Status change"
    PROGRESS = "progress", "Progress"
    LOG = "log", "Log line"
    ARTIFACT = "artifact", "Artifact"
    HEARTBEAT = "heartbeat", "Heartbeat"
    RETRY = "retry", "Retry scheduled"
    FENCED = "fenced", "Late report rejected"
    APP = "app_event", "Application event"
    DISK = "disk", "Disk watch"
    GOVERNOR = "governor", "Governor condition"
    NODE = "node", "Node"
    POLICY = "policy", "A step's failure policy applied"


class Event(models.Model):
    """A timeline row. Append-only; the table is partitioned by month on ``ts``.

    The physical table is created by migration SQL (Django cannot declare partitioning): its
    primary key is ``(id, ts)`` as PostgreSQL requires, and a DEFAULT partition catches rows for
    months that have no partition yet, so no event is ever lost. ``job``/``task`` carry no
    foreign-key constraint: the timeline is an audit log that outlives pruned jobs.
    """

    id = models.BigAutoField(primary_key=True)
    ts = models.DateTimeField(default=timezone.now)
    job = models.ForeignKey("jobs.Job", on_delete=models.DO_NOTHING, null=True, blank=True, db_constraint=False,
                            related_name="events")
    task = models.ForeignKey("jobs.Task", on_delete=models.DO_NOTHING, null=True, blank=True, db_constraint=False,
                             related_name="events")
    attempt = models.IntegerField(null=True, blank=True)
    source = models.CharField(max_length=200, default="", blank=True)
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    type = models.CharField(max_length=50, default=EventType.STATUS)
    message = models.TextField(default="", blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "accs_event"
        ordering = ["-ts", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(level__in=[c.value for c in Level]), name="event_level_valid"),
        ]
        indexes = [
            models.Index(fields=["job", "-ts"], name="event_job_ts_idx"),
            models.Index(fields=["task", "-ts"], name="event_task_ts_idx"),
        ]

    def __str__(self) -> str:
        return f"[{self.level}] {self.type}: {self.message[:60]}"


class ArtifactKind(models.TextChoices):
    """What an artifact is for."""

    INPUT = "input", "Input"
    OUTPUT = "output", "Output"
    LOG = "log", "Log"


class Artifact(models.Model):
    """A file in object storage (S3/MinIO), recorded with its size, type and checksum."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="artifacts")
    task = models.ForeignKey("jobs.Task", on_delete=models.CASCADE, null=True, blank=True, related_name="artifacts")
    attempt = models.IntegerField(null=True, blank=True)
    kind = models.CharField(max_length=8, choices=ArtifactKind.choices)
    bucket = models.CharField(max_length=200)
    key = models.CharField(max_length=1000)
    size_bytes = models.BigIntegerField()
    content_type = models.CharField(max_length=200, default="application/octet-stream")
    checksum = models.CharField(max_length=100, help_text="sha256:<hex>")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "accs_artifact"
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=[c.value for c in ArtifactKind]), name="artifact_kind_valid"),
            models.UniqueConstraint(fields=["bucket", "key"], name="artifact_bucket_key_unique"),
        ]
        indexes = [
            models.Index(fields=["job"], name="artifact_job_idx"),
            models.Index(fields=["task"], name="artifact_task_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind}: {self.key}"


class ObjectDeletion(models.Model):
    """An object of storage to delete, written by the transaction that deleted the rows naming it.

    The object is deleted only after that transaction committed (:mod:`events.artifacts`), so a
    rolled-back prune deletes nothing; a crash between the commit and the deletion leaves this row,
    and the next pass deletes the object (an absent object is no error) and then the row.
    """

    bucket = models.CharField(max_length=200)
    key = models.CharField(max_length=1000)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "accs_object_deletion"
        constraints = [models.UniqueConstraint(fields=["bucket", "key"], name="object_deletion_bucket_key_unique")]

    def __str__(self) -> str:
        return f"delete s3://{self.bucket}/{self.key}"


class MetricTotals(models.Model):
    """The Prometheus counters and histograms folded from the timeline, shared by every web process.

    One row. A scrape folds the events after ``watermark`` into ``totals`` and moves the watermark
    (``ops.metrics``), so no process ever recounts the history: a new web process reads the totals
    as they stand, and several processes behind one scrape target report the same figures.
    """

    id = models.SmallIntegerField(primary_key=True, default=1)
    watermark = models.BigIntegerField(default=0)
    totals = models.JSONField(default=dict)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "accs_metric_totals"
        constraints = [models.CheckConstraint(condition=Q(id=1), name="metric_totals_one_row")]

    def __str__(self) -> str:
        return f"metric totals up to event {self.watermark}"
