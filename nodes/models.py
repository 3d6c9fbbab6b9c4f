"""Where work runs: nodes (machines running an agent), hosts (targets tasks act on), host blocks,
disk samples."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.utils import timezone

from workflows.validation import wake_problems


def _choices_check(field: str, choices: type[models.TextChoices], name: str) -> models.CheckConstraint:
    return models.CheckConstraint(condition=Q(**{f"{field}__in": [c.value for c in choices]}), name=name)


class AwakeState(models.TextChoices):
    """Whether a node's machine is believed to be up."""

    UNKNOWN = "unknown", "Unknown"
    AWAKE = "awake", "Awake"
    SLEEP = "sleep", "Asleep"


class WakeMethod(models.TextChoices):
    """How the builder wakes a sleeping node."""

    NONE = "none", "Cannot be woken"
    WOL = "wol", "Wake-on-LAN magic packet"
    PROVIDER = "provider", "Provider HTTP API"
    SCRIPT = "script", "Shell script"


class Presence(models.TextChoices):
    """Whether an agent is running on a node, as its heartbeats tell."""

    ONLINE = "online", "Online (an agent heartbeats)"
    OFFLINE = "offline", "Offline (its agent stopped cleanly)"
    LOST = "lost", "Lost (no heartbeat for too long)"


class NodeState(models.TextChoices):
    """Whether a node's agents may claim new work."""

    ACTIVE = "active", "Active"
    DRAINING = "draining", "Draining (claims nothing new)"


class Node(models.Model):
    """A machine running one or more agents."""

    name = models.CharField(max_length=200, primary_key=True)
    labels = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.ACTIVE)
    awake_state = models.CharField(max_length=16, choices=AwakeState.choices, default=AwakeState.UNKNOWN)
    presence = models.CharField(max_length=16, choices=Presence.choices, default=Presence.ONLINE)
    wake_method = models.CharField(max_length=16, choices=WakeMethod.choices, default=WakeMethod.NONE)
    mac = models.CharField(max_length=17, blank=True, default="")
    wake_address = models.CharField(
        max_length=100, blank=True, default="", help_text="host:port the magic packet is sent to (UDP)."
    )
    provider_ref = models.CharField(max_length=500, blank=True, default="", help_text="Provider API URL.")
    script = models.CharField(max_length=500, blank=True, default="")
    max_concurrency = models.JSONField(default=dict, blank=True, help_text='Per service, e.g. {"renderer": 2}.')
    slot_cap = models.PositiveIntegerField(default=20)
    cpu_budget = models.PositiveIntegerField(default=8)
    version = models.CharField(max_length=50, blank=True, default="")
    agent_id = models.CharField(max_length=300, blank=True, default="",
                                help_text="hostname:pid:boot-id of the last agent.")
    services = models.JSONField(default=list, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_wake_at = models.DateTimeField(null=True, blank=True)
    disk_level = models.CharField(max_length=16, blank=True, default="ok")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "accs_node"
        ordering = ["name"]
        constraints = [
            _choices_check("state", NodeState, "node_state_valid"),
            _choices_check("awake_state", AwakeState, "node_awake_state_valid"),
            _choices_check("presence", Presence, "node_presence_valid"),
            _choices_check("wake_method", WakeMethod, "node_wake_method_valid"),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse a wake script or provider URL this site's allow-lists do not name."""
        problems = wake_problems(method=self.wake_method, script=self.script, provider_ref=self.provider_ref)
        if problems:
            raise ValidationError({p.where: p.message for p in problems})


class NodeDeploy(models.Model):
    """A node's agent started on another release than the node last reported: one row per change,
    written by the agent's registration in the same transaction as the node row (its lock orders two
    agents of one node). The node row keeps only the current release; these rows date the deploys."""

    node_name = models.CharField(max_length=200, help_text="The node (kept if the node row is retired).")
    version = models.CharField(max_length=50)
    previous_version = models.CharField(max_length=50, blank=True, default="",
                                        help_text="The release the node reported before (\"\" from 0.1.0 or older).")
    agent_id = models.CharField(max_length=300, blank=True, default="")
    started_at = models.DateTimeField()

    class Meta:
        db_table = "accs_node_deploy"
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["-started_at"], name="node_deploy_started_idx")]

    def __str__(self) -> str:
        return f"{self.node_name} {self.previous_version or '?'} → {self.version}"


class HostStatus(models.TextChoices):
    """Whether a host may receive tasks."""

    OK = "ok", "OK"
    ERROR = "error", "Quarantined after a final failure"


class Host(models.Model):
    """A target a task acts on (a device, a server); reached through one node."""

    name = models.CharField(max_length=200, unique=True)
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="hosts")
    labels = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=HostStatus.choices, default=HostStatus.OK)
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantine_reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "accs_host"
        ordering = ["name"]
        constraints = [
            _choices_check("status", HostStatus, "host_status_valid"),
            models.CheckConstraint(
                condition=Q(status="ok", quarantined_at__isnull=True) | Q(status="error", quarantined_at__isnull=False),
                name="host_quarantined_iff_quarantined_at",
            ),
        ]
        indexes = [models.Index(fields=["node", "status"], name="host_node_status_idx")]

    def __str__(self) -> str:
        return self.name


class HostBlock(models.Model):
    """Forbids one service on one host: such tasks become ``blocked`` and never run."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="blocks")
    service = models.ForeignKey("workflows.Service", on_delete=models.CASCADE, related_name="host_blocks")
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "accs_host_block"
        constraints = [models.UniqueConstraint(fields=["host", "service"], name="host_block_unique")]

    def __str__(self) -> str:
        return f"{self.service} blocked on {self.host}"


class DiskLevel(models.TextChoices):
    """Disk use levels: the share of space in use at which agents warn and stop claiming."""

    OK = "ok", "OK (< 85 %)"
    WARNING = "warning", "Warning (≥ 85 %)"
    CRITICAL = "critical", "Critical (≥ 90 %)"
    EMERGENCY = "emergency", "Emergency (≥ 95 %, claiming paused)"


class DiskSample(models.Model):
    """One disk-use measurement by an agent; the last 1,000 per node are kept."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="disk_samples")
    ts = models.DateTimeField(default=timezone.now)
    path = models.CharField(max_length=500)
    total_bytes = models.BigIntegerField()
    used_bytes = models.BigIntegerField()
    used_pct = models.FloatField()
    level = models.CharField(max_length=16, choices=DiskLevel.choices, default=DiskLevel.OK)

    class Meta:
        db_table = "accs_disk_sample"
        ordering = ["-ts"]
        constraints = [_choices_check("level", DiskLevel, "disk_sample_level_valid")]
        indexes = [models.Index(fields=["node", "-ts"], name="disk_sample_node_ts_idx")]

    def __str__(self) -> str:
        return f"{self.node_id} {self.used_pct:.1f}% @ {self.ts:%Y-%m-%d %H:%M}"
