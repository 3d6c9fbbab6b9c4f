"""Who may do what: tenants, users' memberships in them, API tokens and their request counts.

The bottom of ACCS's apps: every tenant-owned row of the engine points here, and nothing here
imports the engine. The tables keep the names they had when these models lived in ``jobs``.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import F, Q
from django.utils.timezone import now

from accs_site.conf import accs

DEFAULT_TENANT_SLUG = "default"


def default_max_in_flight() -> int:
    """Return the in-flight cap a new tenant gets (``ACC_TENANT_MAX_IN_FLIGHT``)."""
    return accs.tenant_max_in_flight


class Tenant(models.Model):
    """An isolation boundary: jobs and triggers belong to exactly one tenant."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    slug = models.SlugField(max_length=100, unique=True)
    name = models.CharField(max_length=200)
    timezone = models.CharField(max_length=64, default="UTC", help_text="IANA name, default for schedules.")
    max_in_flight = models.PositiveIntegerField(
        default=default_max_in_flight,
        help_text="Running jobs at once; 0 = unlimited (new tenants: ACC_TENANT_MAX_IN_FLIGHT).")
    # A priority band: every job of the tenant is clamped into it when it starts, so a tenant cannot
    # claim ahead of the others by asking for a higher priority than the site gave it.
    min_priority = models.IntegerField(default=-1000, db_default=-1000,
                                       help_text="Lowest priority a job of this tenant gets.")
    max_priority = models.IntegerField(default=1000, db_default=1000,
                                       help_text="Highest priority a job of this tenant gets.")
    # Written by the claim (best effort, never waited for): tenants at equal priority take turns,
    # the one served least recently first.
    served_at = models.DateTimeField(null=True, blank=True, editable=False,
                                     help_text="When an agent last claimed a task of this tenant among others.")
    retention_days = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Days finished jobs are kept before they are pruned; 0 = for ever, empty = ACC_RETENTION_DAYS.",
    )
    retention_dead_days = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Days jobs that ended in error (dead letters) are kept; 0 = for ever, "
                  "empty = ACC_RETENTION_DEAD_DAYS.",
    )
    created_at = models.DateTimeField(default=now)

    class Meta:
        db_table = "accs_tenant"
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=Q(min_priority__lte=F("max_priority")), name="tenant_priority_band_valid"),
        ]

    def clamp_priority(self, priority: int) -> int:
        """Return ``priority`` moved into the tenant's band."""
        return max(self.min_priority, min(self.max_priority, priority))

    def __str__(self) -> str:
        return self.slug


class TenantRole(models.TextChoices):
    """What a member may do inside a tenant."""

    ADMIN = "admin", "Tenant admin (read and act)"
    VIEWER = "viewer", "Viewer (read only)"


class TenantMembership(models.Model):
    """A user's role in one tenant; superusers need none."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=TenantRole.choices, default=TenantRole.ADMIN)

    class Meta:
        db_table = "accs_tenant_membership"
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique"),
            models.CheckConstraint(condition=Q(role__in=TenantRole.values), name="membership_role_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class TokenScope(models.TextChoices):
    """What an API token may do (on top of what its user may do)."""

    READ = "read", "Read jobs, tasks, triggers and (superusers) definitions"
    RUN = "run", "Start, cancel, retry and redrive jobs; manage triggers; emit events"
    APPROVE = "approve", "Approve or reject jobs waiting for approval"
    DEFINITIONS = "definitions", "Create and change services and workflows (superusers only)"


# Every scope but definitions: a token that may define code must be asked for.
DEFAULT_TOKEN_SCOPES = ("read", "run", "approve")


def default_token_scopes() -> list[str]:
    """Return the scopes a token gets when none are asked for."""
    return list(DEFAULT_TOKEN_SCOPES)


class ApiToken(models.Model):
    """A bearer token for the HTTP API; only its SHA-256 digest is stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, help_text="First characters of the token, to recognise it.")
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="The API refuses the token from then on.")
    # The database default serves the previous release's code, which inserts tokens without scopes
    # (tenants 0002); this release's code passes them (the Python default).
    scopes = ArrayField(models.CharField(max_length=20, choices=TokenScope.choices), default=default_token_scopes,
                        db_default=DEFAULT_TOKEN_SCOPES,
                        help_text="What the token may do: read, run, approve, definitions.")

    class Meta:
        db_table = "accs_api_token"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class ApiThrottle(models.Model):
    """Requests made with one bearer token in the current window (:mod:`tenants.throttle`)."""

    digest = models.CharField(max_length=64, primary_key=True, help_text="SHA-256 of the token, as ApiToken.digest.")
    window_start = models.DateTimeField()
    hits = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "accs_api_throttle"

    def __str__(self) -> str:
        return f"{self.hits} requests since {self.window_start}"
