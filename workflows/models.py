"""What can run: allow-listed services, versioned workflows (DAGs of steps), governor conditions."""

from __future__ import annotations

import uuid

from django.contrib.postgres.fields import ArrayField
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from workflows.validation import StepFailurePolicy, validate_service, validate_workflow

__all__ = ["Executor", "GovernorCondition", "Service", "StepFailurePolicy", "Workflow", "workflows_naming_service"]


class Executor(models.TextChoices):
    """How an agent runs a service."""

    COMMAND = "command", "CLI command (argv, no shell)"
    PYTHON = "python", "Python callable"
    HTTP = "http", "Local HTTP service"
    SIMULATE = "simulate", "Simulated unstable network"


class Service(models.Model):
    """A unit of allow-listed work: what an agent may run, and the limits around it."""

    key = models.SlugField(max_length=100, unique=True, help_text="Stable name used by workflows and agents.")
    description = models.TextField(blank=True, default="")
    executor = models.CharField(max_length=16, choices=Executor.choices, default=Executor.COMMAND)
    executor_config = models.JSONField(
        default=dict,
        blank=True,
        help_text='command: {"argv": ["tool", "--x", "{x}"]}; python: {"callable": "pkg.mod:fn"}; '
        'http: {"url": "http://127.0.0.1:8080/run", "start_command": [...], "idle_stop_seconds": 300}; '
        'simulate: {"seed": 1, "error_rate": 0.2, "timeout_rate": 0.05, "min_delay_ms": 5, "max_delay_ms": 50}',
    )
    params_schema = models.JSONField(default=dict, blank=True, help_text="JSON Schema for the params.")
    timeout_seconds = models.PositiveIntegerField(default=600, validators=[MinValueValidator(1)])
    max_attempts = models.PositiveSmallIntegerField(default=3, validators=[MinValueValidator(1)])
    backoff_base_seconds = models.FloatField(
        null=True, blank=True, help_text="Empty: ACC_BACKOFF_BASE_SEC (15 s by default)."
    )
    backoff_cap_seconds = models.FloatField(default=3600.0)
    lease_seconds = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(3)],
        help_text="How long an agent holds a task of this service between renewals (it renews every third of it);"
        " long work that must survive a short database outage needs a lease longer than the outage."
        " Empty: ACC_HEARTBEAT_TTL_SEC (120 s by default) or the agent's --lease-seconds.",
    )
    cpu_weight = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(5)]
    )
    max_concurrent = models.PositiveIntegerField(default=0, help_text="Global cap across nodes; 0 = unlimited.")
    base_priority = models.IntegerField(default=0, help_text="Higher number = more important.")
    requires_approval = models.BooleanField(default=False)
    exclusive_per_host = models.BooleanField(default=False, help_text="At most one running task per host.")
    quarantine_host_on_final_failure = models.BooleanField(default=False)
    block_during = ArrayField(
        models.CharField(max_length=100), default=list, blank=True,
        help_text="Governor conditions during which this service is not claimed.",
    )
    priority_adjust_during = models.JSONField(
        default=dict, blank=True, help_text='Priority change while a condition holds, e.g. {"live_session": -3}.'
    )
    required_labels = models.JSONField(
        default=dict, blank=True, help_text='Node labels this service needs, e.g. {"gpu": "true"}.'
    )
    # Flow control, enforced by the claim across every agent (jobs.claim).
    rate_limit = models.PositiveIntegerField(
        default=0, help_text="Task starts per period across the fleet; 0 = unlimited."
    )
    rate_period_seconds = models.PositiveIntegerField(
        default=60, validators=[MinValueValidator(1)],
        help_text="The rate limits' period: at most that many starts in any window this long.",
    )
    rate_key = models.CharField(
        max_length=200, blank=True, default="",
        help_text="Params path (dotted, e.g. customer_id or customer.id) whose value has its own rate limit.",
    )
    rate_key_limit = models.PositiveIntegerField(
        default=0, help_text="Task starts per period for each value of rate_key; 0 = none."
    )
    concurrency_key = models.CharField(
        max_length=200, blank=True, default="",
        help_text="Params path (dotted) whose value has its own concurrency cap.",
    )
    concurrency_key_limit = models.PositiveIntegerField(
        default=0, help_text="Tasks held (starting or running) at once for each value of concurrency_key; 0 = none."
    )
    is_active = models.BooleanField(default=True)
    defined_in = models.CharField(
        max_length=300, blank=True, default="", db_default="", editable=False,
        help_text="module:line of the code that defines it (manage.py accs_sync); empty when made in the admin.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "accs_service"
        ordering = ["key"]
        constraints = [
            models.CheckConstraint(condition=Q(cpu_weight__gte=1, cpu_weight__lte=5), name="service_cpu_weight_1_5"),
            models.CheckConstraint(condition=Q(timeout_seconds__gte=1), name="service_timeout_positive"),
            models.CheckConstraint(condition=Q(max_attempts__gte=1), name="service_max_attempts_positive"),
            models.CheckConstraint(condition=Q(lease_seconds__isnull=True) | Q(lease_seconds__gte=3),
                                   name="service_lease_at_least_3"),
            models.CheckConstraint(condition=Q(rate_period_seconds__gte=1), name="service_rate_period_positive"),
            models.CheckConstraint(condition=Q(rate_key_limit=0) | ~Q(rate_key=""), name="service_rate_key_named"),
            models.CheckConstraint(
                condition=Q(concurrency_key_limit=0) | ~Q(concurrency_key=""), name="service_concurrency_key_named"
            ),
            models.CheckConstraint(
                condition=Q(executor__in=[c.value for c in Executor]), name="service_executor_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def clean(self) -> None:
        validate_service(self)


class Workflow(models.Model):
    """A versioned DAG template; each step is run by a service."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100)
    version = models.PositiveIntegerField(default=1)
    description = models.TextField(blank=True, default="")
    is_active = models.BooleanField(default=True)
    steps = models.JSONField(
        default=list,
        help_text="[{key, service, depends_on, default_params, fan_out?, on_failure?, always?}]; "
        'on_failure: "fail_job" (default) or "continue"; always: true runs the step once '
        "its dependencies are final, whatever their outcome (cleanup, notifications)",
    )
    max_active_jobs = models.PositiveIntegerField(
        default=0, help_text="Jobs of this workflow running at once; 0 = unlimited, 1 = strictly one, oldest first."
    )
    defined_in = models.CharField(
        max_length=300, blank=True, default="", db_default="", editable=False,
        help_text="module:line of the code that defines it (manage.py accs_sync); empty when made in the admin.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "accs_workflow"
        ordering = ["name", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["name", "version"], name="workflow_name_version_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def clean(self) -> None:
        validate_workflow(self)

    def step_services(self) -> dict[str, Service]:
        """Return the stored services the steps name, by key (an unknown key is simply absent)."""
        wanted = {s.get("service") for s in self.steps or [] if isinstance(s, dict)}
        return {s.key: s for s in Service.objects.filter(key__in=[w for w in wanted if isinstance(w, str)])}


class GovernorCondition(models.Model):
    """A named condition (e.g. ``live_session``) that defers or re-prioritises services while it holds."""

    name = models.SlugField(max_length=100, unique=True)
    reason = models.TextField(blank=True, default="")
    raised_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: holds until cleared.")
    cleared_at = models.DateTimeField(null=True, blank=True)
    raised_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "accs_governor_condition"
        ordering = ["name"]
        indexes = [models.Index(fields=["expires_at"], name="governor_expires_idx")]

    def __str__(self) -> str:
        return self.name

    def holds(self, now=None) -> bool:
        now = now or timezone.now()
        return (
            self.raised_at is not None
            and (self.cleared_at is None or self.cleared_at < self.raised_at)
            and (self.expires_at is None or self.expires_at > now)
        )


def workflows_naming_service(key: str) -> list[str]:
    """Return the workflows whose steps name the service ``key`` (a rename would break them)."""
    return [f"workflow {w}" for w in Workflow.objects.filter(steps__contains=[{"service": key}])]
