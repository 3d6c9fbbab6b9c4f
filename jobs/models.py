"""What is running and why: jobs, tasks, attempts, triggers (tenants and API tokens: :mod:`tenants.models`).

Every status below is declared once as ``TextChoices`` and held by a CHECK constraint. Only
:mod:`jobs.transitions` writes ``status`` after a row is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex, OpClass
from django.db import models
from django.db.models import F, Func, Q, Value
from django.db.models.functions import Upper
from django.utils.timezone import now

from events._moved import forward_names
from jobs.ids import uuid7
from workflows.models import StepFailurePolicy

JOB_ORDER_SEQUENCE = "accs_job_order_seq"

# Tenants, memberships and API tokens moved to the tenants app in 0.2.0; a site that imports them
# from here keeps working for one release, warned.
MOVED_TO_TENANTS = frozenset({
    "DEFAULT_TENANT_SLUG", "ApiThrottle", "ApiToken", "Tenant", "TenantMembership", "TenantRole", "TokenScope",
    "default_max_in_flight", "default_token_scopes",
})
if not TYPE_CHECKING:
    # Hidden from type checkers, which would otherwise accept any name imported from this module.
    __getattr__ = forward_names("jobs.models", "tenants.models", MOVED_TO_TENANTS)


def _choices_check(field: str, choices: type[models.TextChoices], name: str) -> models.CheckConstraint:
    return models.CheckConstraint(condition=Q(**{f"{field}__in": [c.value for c in choices]}), name=name)


class JobStatus(models.TextChoices):
    """Lifecycle of a job."""

    QUEUED = "queued", "Queued (its tasks are not created yet)"
    WAITING = "waiting", "Waiting (tasks created, none starting or running)"
    RUNNING = "running", "Running (a task is starting or running)"
    DONE = "done", "Done"
    PARTIAL = "partial", "Partly done (steps whose failure may not fail the job failed, or some hosts were blocked)"
    ERROR = "error", "Error (a task failed for good)"
    CANCELED = "canceled", "Canceled"


JOB_FINAL = (JobStatus.DONE, JobStatus.PARTIAL, JobStatus.ERROR, JobStatus.CANCELED)
# Admitted: its tasks exist and count against the tenant's and the workflow's caps.
JOB_ADMITTED = (JobStatus.WAITING, JobStatus.RUNNING)
JOB_ACTIVE = (JobStatus.QUEUED, *JOB_ADMITTED)
# Final states that are not success: what an operator may retry.
JOB_FAILED = (JobStatus.ERROR, JobStatus.PARTIAL, JobStatus.CANCELED)
# Finished jobs pruned after the tenant's retention; jobs that ended in error (dead letters) have
# a retention of their own.
JOB_PRUNABLE = (JobStatus.DONE, JobStatus.PARTIAL, JobStatus.CANCELED)


def error_search_index(table: str) -> GinIndex:
    """A trigram index on the upper-cased error text of the rows that have one (pg_trgm).

    It serves Django's ``error_message__icontains`` (``UPPER(error_message) LIKE UPPER('%…%')``)
    for terms of three characters or more; rows without an error stay out of it.
    """
    return GinIndex(OpClass(Upper("error_message"), name="gin_trgm_ops"), condition=~Q(error_message=""),
                    name=f"{table}_error_trgm_idx")


#: Bytes at the end of an id that the short-id indexes hold: the short form shown
#: (jobs.ids.SHORT_ID_DIGITS hex digits) is five bytes.
SHORT_ID_BYTES = 5


class IdEnd(Func):
    """The last ``size`` bytes of a uuid column (where a short id is), as ``bytea``.

    With ``size`` = :data:`SHORT_ID_BYTES` it is the expression of ``job_short_id_idx`` and
    ``task_short_id_idx``; a search must use this very expression for the planner to read them.
    """

    output_field = models.BinaryField()

    def __init__(self, field: str, *, size: int = SHORT_ID_BYTES) -> None:
        super().__init__(F(field), template=f"substring(uuid_send(%(expressions)s) FROM {17 - size})")


def search_indexes(table: str, *exact: str) -> list[models.Index]:
    """The error text index plus one partial btree per exactly-matched reference (set rows only)."""
    partial = {"correlation_id": ~Q(correlation_id="")}
    return [error_search_index(table), *(
        models.Index(fields=[name], condition=partial.get(name, Q(**{f"{name}__isnull": False})),
                     name=f"{table}_{name}_idx") for name in exact)]


class JobSource(models.TextChoices):
    """Who started a job."""

    MANUAL = "manual", "Manual"
    EVENT = "event", "Event trigger"
    SCHEDULE = "schedule", "Schedule"
    WEBHOOK = "webhook", "Webhook"
    SYSTEM = "system", "System"


class ApprovalState(models.TextChoices):
    """Whether a job may run."""

    NOT_REQUIRED = "not_required", "Not required"
    PENDING = "pending", "Waiting for approval"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"


class Job(models.Model):
    """An instance of a workflow (or of one service) to run."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    # Covered by job_tenant_status_created_idx; a separate FK index would only slow inserts.
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="jobs", db_index=False)
    # Indexed by job_workflow_idx / job_service_idx, partial on the column being set: a job has one
    # of the two, so each job row is one entry in one of them rather than one in each.
    workflow = models.ForeignKey("workflows.Workflow", on_delete=models.PROTECT, null=True, blank=True,
                                 related_name="jobs", db_index=False)
    service = models.ForeignKey(
        "workflows.Service", on_delete=models.PROTECT, null=True, blank=True, related_name="jobs",
        help_text="Set for a one-task job that targets a service directly.", db_index=False,
    )
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    progress = models.FloatField(default=0.0)
    current_task_key = models.CharField(max_length=100, blank=True, default="")
    priority = models.IntegerField(default=0)
    order_seq = models.BigIntegerField(
        db_default=Func(Value(JOB_ORDER_SEQUENCE), function="nextval", output_field=models.BigIntegerField()),
        editable=False,
        help_text="Global order from a PostgreSQL sequence.",
    )
    options = models.JSONField(default=dict, blank=True, help_text="Job options (hosts, label selector...).")
    step_params = models.JSONField(default=dict, blank=True, help_text="Per-step param overrides {step: {...}}.")
    scheduled_at = models.DateTimeField(default=now)
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    source = models.CharField(max_length=16, choices=JobSource.choices, default=JobSource.MANUAL)
    source_ref = models.CharField(max_length=200, blank=True, default="")
    external_id = models.CharField(max_length=200, null=True, blank=True)
    dedupe_key = models.CharField(max_length=200, null=True, blank=True)
    correlation_id = models.CharField(max_length=200, blank=True, default="")
    approval_state = models.CharField(max_length=16, choices=ApprovalState.choices, default=ApprovalState.NOT_REQUIRED)
    approved_by = models.CharField(max_length=200, blank=True, default="")
    approved_at = models.DateTimeField(null=True, blank=True)
    # Who caused the job: the caller of the API or admin, the sender of the event that fired a
    # trigger; NULL for a schedule's job (``source`` says "schedule") and for code without a user.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", db_index=False
    )
    # Users who may not approve the job besides ``created_by``: for a trigger's job, the trigger's
    # creator and its last editor (they configured what runs). NULL for jobs started by older code.
    approval_barred = ArrayField(models.IntegerField(), null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=now)
    # Not a column: jobs.enqueue.start sets it on the job it returns (True for a new job, False when an
    # external_id repeat returned the existing one); a job loaded any other way does not have it.
    was_created: bool

    class Meta:
        db_table = "accs_job"
        ordering = ["-created_at"]
        constraints = [
            _choices_check("status", JobStatus, "job_status_valid"),
            _choices_check("source", JobSource, "job_source_valid"),
            _choices_check("approval_state", ApprovalState, "job_approval_state_valid"),
            models.CheckConstraint(
                condition=(Q(workflow__isnull=False, service__isnull=True)
                           | Q(workflow__isnull=True, service__isnull=False)),
                name="job_targets_workflow_xor_service",
            ),
            models.CheckConstraint(
                condition=(Q(status__in=JOB_FINAL, finished_at__isnull=False)
                           | Q(~Q(status__in=JOB_FINAL), finished_at__isnull=True)),
                name="job_finished_iff_finished_at",
            ),
            models.CheckConstraint(condition=Q(progress__gte=0, progress__lte=1), name="job_progress_0_1"),
            models.UniqueConstraint(
                fields=["tenant", "external_id"], condition=Q(external_id__isnull=False),
                name="job_external_id_per_tenant"
            ),
            models.UniqueConstraint(
                fields=["tenant", "dedupe_key"],
                condition=Q(dedupe_key__isnull=False, status__in=JOB_ACTIVE),
                name="job_active_dedupe_key_per_tenant",
            ),
        ]
        # Every index here names the query that reads it in jobs.indexes (READERS), and a test
        # fails on an index nobody reads; the hot ones are partial on the statuses their readers ask
        # for, so finished jobs leave them.
        indexes = [
            # The builder's due-job scans (both, capped ones sorting the due rows by order_seq):
            # queued jobs by due time, in global order.
            models.Index(fields=["scheduled_at", "order_seq"], condition=Q(status="queued"), name="job_due_idx"),
            models.Index(fields=["tenant", "status", "-created_at"], name="job_tenant_status_created_idx"),
            models.Index(fields=["workflow", "status"], condition=Q(status__in=JOB_ADMITTED),
                         name="job_workflow_admitted_idx"),
            # The admin's job list, newest first over every tenant.
            models.Index(fields=["-created_at"], name="job_created_idx"),
            # The admin's search by workflow name or service key, a service's or workflow's delete
            # (PROTECT looks for its jobs) and the wake scan's queued jobs of a service.
            models.Index(fields=["workflow"], condition=Q(workflow__isnull=False), name="job_workflow_idx"),
            models.Index(fields=["service"], condition=Q(service__isnull=False), name="job_service_idx"),
            # Bulk redrive (jobs.redrive): failed jobs in id order, few among many finished ones.
            models.Index(fields=["id"], condition=Q(status__in=JOB_FAILED), name="job_failed_idx"),
            # Retention (jobs.retention): each tenant's finished jobs from the oldest end, dead
            # letters apart because they are kept longer; rows enter only when a job finishes.
            models.Index(fields=["tenant", "finished_at"], condition=Q(status__in=JOB_PRUNABLE),
                         name="job_prune_idx"),
            models.Index(fields=["tenant", "finished_at"], condition=Q(status=JobStatus.ERROR),
                         name="job_prune_dead_idx"),
            # The admin's job search (JobAdmin.get_search_results): every arm of its OR has an index,
            # so a text term is a bitmap OR of index scans, never a read of every job.
            *search_indexes("job", "external_id", "dedupe_key", "correlation_id"),
            # The admin's search by short id (jobs.admin.ids_ending): ids by their last bytes.
            models.Index(IdEnd("id"), name="job_short_id_idx"),
        ]

    def __str__(self) -> str:
        return f"job {self.id}"

    @property
    def target_name(self) -> str:
        return str(self.workflow) if self.workflow_id else f"service {self.service}"


class TaskStatus(models.TextChoices):
    """Lifecycle of a task."""

    WAITING = "waiting", "Waiting for dependencies"
    QUEUED = "queued", "Queued (claimable)"
    SCHEDULED = "scheduled", "Scheduled (a retry waiting out its backoff)"
    STARTING = "starting", "Claimed, starting"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    ERROR = "error", "Error (final; dead letter)"
    SKIPPED = "skipped", "Skipped"
    CANCELED = "canceled", "Canceled"
    BLOCKED = "blocked", "Blocked for this host"


TASK_FINAL = (TaskStatus.DONE, TaskStatus.ERROR, TaskStatus.SKIPPED, TaskStatus.CANCELED, TaskStatus.BLOCKED)
TASK_HELD = (TaskStatus.STARTING, TaskStatus.RUNNING)
TASK_UNSTARTED = (TaskStatus.WAITING, TaskStatus.QUEUED, TaskStatus.SCHEDULED)
# Not final yet: what task_job_open_idx holds.
TASK_OPEN = (*TASK_UNSTARTED, *TASK_HELD)


class Task(models.Model):
    """A claimable unit: one step of a job (one per host for a fan-out step)."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="tasks", db_index=False)
    # Task FKs carry no index of their own: the engine reads tasks through the partial indexes in
    # Meta, and every extra index is paid on each claim and report.
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+", db_index=False,
                               help_text="Copied from the job.")
    task_key = models.CharField(max_length=200)
    step_key = models.CharField(max_length=100, help_text="The workflow step; equals task_key unless fanned out.")
    service = models.ForeignKey("workflows.Service", on_delete=models.PROTECT, related_name="tasks", db_index=False)
    host = models.ForeignKey("nodes.Host", on_delete=models.PROTECT, null=True, blank=True, related_name="tasks",
                             db_index=False)
    exclusive = models.BooleanField(default=False, help_text="Copied from the service: one running task per host.")
    status = models.CharField(max_length=16, choices=TaskStatus.choices, default=TaskStatus.QUEUED)
    depends_on = ArrayField(models.CharField(max_length=100), default=list, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    next_attempt_at = models.DateTimeField(default=now)
    priority = models.IntegerField(default=0)
    order_seq = models.BigIntegerField(help_text="Copied from the job: the global claim order.")
    timeout_seconds = models.PositiveIntegerField(default=600)
    progress = models.FloatField(null=True, blank=True)
    params = models.JSONField(default=dict, blank=True)
    results = models.JSONField(null=True, blank=True)
    assigned_node = models.CharField(max_length=200, blank=True, default="")
    claimed_by = models.CharField(max_length=300, blank=True, default="", help_text="Agent identity host:pid:boot.")
    node = models.CharField(max_length=200, blank=True, default="", help_text="Node that holds or last held the task.")
    claimed_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=now)
    updated_at = models.DateTimeField(default=now)
    # Kept by the database (jobs.limit_keys), never written by the code: the task's key under its
    # service's per-key limit while it is queued, for the keyed claim's index.
    limit_key = models.TextField(null=True, blank=True, editable=False, db_collation="C",
                                 help_text="The key under the service's per-key limit (kept by a trigger).")

    class Meta:
        db_table = "accs_task"
        ordering = ["order_seq", "created_at"]
        constraints = [
            _choices_check("status", TaskStatus, "task_status_valid"),
            models.UniqueConstraint(fields=["job", "task_key"], name="task_job_key_unique"),
            models.CheckConstraint(
                condition=(Q(status__in=TASK_FINAL, finished_at__isnull=False)
                           | Q(~Q(status__in=TASK_FINAL), finished_at__isnull=True)),
                name="task_finished_iff_finished_at",
            ),
            models.CheckConstraint(
                condition=~Q(status__in=TASK_HELD) | (Q(lease_expires_at__isnull=False) & ~Q(claimed_by="")),
                name="task_held_has_lease",
            ),
            models.CheckConstraint(condition=Q(attempt__lte=F("max_attempts")), name="task_attempt_le_max"),
            # Seed 004: at most one starting/running task per host for exclusive services.
            models.UniqueConstraint(
                fields=["host"],
                condition=Q(exclusive=True, status__in=TASK_HELD, host__isnull=False),
                name="task_one_held_per_exclusive_host",
            ),
        ]
        indexes = [
            # The claim path (jobs.claim): queued tasks of a service, per tenant (so tenants take
            # turns), in the global order. Tasks bound to a host have their own index, so a node
            # never scans past other nodes' host-bound work; tasks waiting out a backoff are
            # "scheduled", in neither.
            models.Index(
                "service", "tenant", F("priority").desc(), "order_seq", "created_at", "id",
                condition=Q(status="queued", host__isnull=True), name="task_claim_idx",
            ),
            models.Index(
                "host", "service", F("priority").desc(), "order_seq", "created_at", "id",
                condition=Q(status="queued", host__isnull=False), name="task_claim_host_idx",
            ),
            # The keyed claim (jobs.claim): the same queue by key, so a key at its limit is passed
            # over in one step, however many tasks it has queued.
            models.Index(
                "service", "tenant", "limit_key", F("priority").desc(), "order_seq", "created_at", "id",
                condition=Q(status="queued", host__isnull=True, limit_key__isnull=False), name="task_limit_key_idx",
            ),
            # Promotion of retries whose backoff is over (scheduled → queued).
            models.Index(fields=["service", "next_attempt_at"], condition=Q(status="scheduled"),
                         name="task_scheduled_idx"),
            # A node's held tasks (its slot and CPU room).
            models.Index(fields=["node"], condition=Q(status__in=TASK_HELD), name="task_held_node_idx"),
            # Lease rescue (builder): held tasks by lease expiry.
            models.Index(fields=["lease_expires_at"], condition=Q(status__in=TASK_HELD), name="task_lease_idx"),
            # Limits: held tasks per service / host.
            models.Index(fields=["service", "node"], condition=Q(status__in=TASK_HELD), name="task_held_service_idx"),
            # A job's tasks that are not final (settling a job, promotion of its waiting tasks, the
            # job page's held count). Finished tasks leave it, so it holds the backlog, not the
            # history; a job's tasks of any status are read through task_job_key_unique (job first).
            models.Index(fields=["job", "status"], condition=Q(status__in=TASK_OPEN), name="task_job_open_idx"),
            # Bulk redrive (jobs.redrive): dead letters in id order, few among many finished tasks.
            models.Index(fields=["id"], condition=Q(status=TaskStatus.ERROR), name="task_dead_letter_idx"),
            # The admin's job search by a task's last error (JobAdmin.get_search_results).
            error_search_index("task"),
            # The dashboard's and the metrics' dead-letter count per tenant and service
            # (ops.overview.DEAD_LETTER_SQL): an index-only scan, not a heap read of every dead letter.
            models.Index(fields=["tenant", "service"], condition=Q(status=TaskStatus.ERROR),
                         name="task_dead_letter_count_idx"),
            # The admin's task search by short id (jobs.admin.ids_ending): ids by their last bytes.
            models.Index(IdEnd("id"), name="task_short_id_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_key} ({self.status})"


class Start(models.Model):
    """A job started on the narrow path and not yet widened (:mod:`jobs.narrow`).

    One row, written by one statement, for a one-task service job that needs nothing decided before
    it runs (no idempotency key, approval, schedule, cap or options). The row holds what its job,
    task, step and creation event are made of. It lives until a claim takes it or the builder ages
    it out: either deletes it and writes those rows in the same transaction, with the ids and the
    place in the global order the start was given here. Reads by id widen it first.
    """

    id = models.UUIDField(primary_key=True, editable=False, help_text="The job's id.")
    task_id = models.UUIDField(editable=False, help_text="The id its one task gets.")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+", db_index=False)
    service = models.ForeignKey("workflows.Service", on_delete=models.PROTECT, related_name="+", db_index=False)
    priority = models.IntegerField(help_text="The task's: the job's priority plus the service's base priority.")
    job_priority = models.IntegerField()
    order_seq = models.BigIntegerField(
        db_default=Func(Value(JOB_ORDER_SEQUENCE), function="nextval", output_field=models.BigIntegerField()),
        editable=False, help_text="The job's place in the global order, taken when it started.")
    params = models.JSONField(default=dict)
    source = models.CharField(max_length=20)
    source_ref = models.CharField(max_length=200, blank=True, default="")
    correlation_id = models.CharField(max_length=200, blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+", db_index=False)
    created_at = models.DateTimeField(db_default=Func(function="now"), editable=False)

    class Meta:
        db_table = "accs_start"
        indexes = [
            # The claim's widening: each service's and tenant's starts in the global order.
            models.Index("service", "tenant", F("priority").desc(), "order_seq", "id", name="start_claim_idx"),
        ]

    def __str__(self) -> str:
        return f"start {self.id}"


class JobStep(models.Model):
    """How many tasks of one step of a job ended in each final state.

    A trigger on ``accs_task`` keeps the counts exact on every status change, so deciding
    whether a step is complete (its dependents become queued) or can no longer succeed (its
    dependents are skipped), and whether the job is finished, reads one small row per step
    instead of every task of the job: a report costs the same in a job of 1 or 1,000 tasks.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="step_counts", db_index=False)
    step_key = models.CharField(max_length=100)
    position = models.PositiveIntegerField(help_text="The step's place in the workflow.")
    total = models.PositiveIntegerField()
    done = models.IntegerField(default=0)
    error = models.IntegerField(default=0)
    skipped = models.IntegerField(default=0)
    canceled = models.IntegerField(default=0)
    blocked = models.IntegerField(default=0)
    released = models.BooleanField(default=False,
                                   help_text="Its dependents were looked at once its tasks were all final.")
    poisoned = models.BooleanField(default=False, help_text="Its dependents were skipped once it could not succeed.")
    on_failure = models.CharField(
        max_length=16, choices=StepFailurePolicy.choices, db_default=StepFailurePolicy.FAIL_JOB,
        help_text="Copied from the workflow step: what its failing for good does to the job.",
    )
    always = models.BooleanField(
        db_default=False,
        help_text="Copied from the workflow step: it runs once its dependencies are final, whatever their outcome.",
    )
    max_items = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="For a step fanning out over a parent's list: the most tasks it may make (ACC_MAX_FAN_OUT_ITEMS"
                  " when the job was made).",
    )
    output = models.JSONField(
        null=True, blank=True,
        help_text="The step's output gathered once its tasks were all final (a fanned-out step's as a list), read"
                  " by its dependents; cleared when a task of it leaves or enters a final state again.",
    )

    class Meta:
        db_table = "accs_job_step"
        constraints = [
            models.UniqueConstraint(fields=["job", "step_key"], name="job_step_unique"),
            _choices_check("on_failure", StepFailurePolicy, "job_step_on_failure_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.step_key} of {self.job_id}"


class AttemptStatus(models.TextChoices):
    """Outcome of one try of a task."""

    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    TIMEOUT = "timeout", "Timed out"
    CANCELED = "canceled", "Canceled"
    BLOCKED = "blocked", "Blocked"
    INTERRUPTED = "interrupted", "Interrupted (agent shutdown or database outage; retried)"


class Attempt(models.Model):
    """One try of a task: who ran it, how it ended, the tails of its output (secrets redacted)."""

    # The unique (task, attempt_no) index serves lookups by task; no second index on task alone.
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    attempt_no = models.PositiveIntegerField()
    node = models.CharField(max_length=200, blank=True, default="")
    agent_id = models.CharField(max_length=300, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=AttemptStatus.choices, default=AttemptStatus.RUNNING)
    started_at = models.DateTimeField(default=now)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    stdout_tail = models.TextField(blank=True, default="")
    stderr_tail = models.TextField(blank=True, default="")
    error_text = models.TextField(blank=True, default="")
    # The task's service and tenant, copied when the attempt is written (the database's trigger
    # accs_attempt_copy_task_refs fills them for every writer, the previous release's too), so the
    # rates and the attempts list by service read attempts alone. NULL only on attempts written before
    # the copy existed, until ``manage.py accs_attempt_refs`` fills them (jobs.attempt_refs).
    service = models.ForeignKey("workflows.Service", on_delete=models.DO_NOTHING, null=True, blank=True,
                                related_name="+", db_index=False, db_constraint=False, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.DO_NOTHING, null=True, blank=True,
                               related_name="+", db_index=False, db_constraint=False, editable=False)
    # When the task became claimable for this attempt (its ``next_attempt_at``, which the claim leaves
    # as it was), copied by the same trigger: the charts' queue wait is ``started_at`` minus it, read
    # from the attempt alone. NULL on attempts written before the copy until ``accs_attempt_refs`` fills
    # them, and for good on those older attempts that were not their task's last (the task no longer
    # holds their time).
    claimable_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        db_table = "accs_attempt"
        ordering = ["task", "attempt_no"]
        indexes = [
            # The operators' rates over a time range and the attempts list by range (ops.rates).
            models.Index(fields=["started_at"], name="attempt_started_idx"),
            # The attempts list filtered by node, newest first.
            models.Index(fields=["node", "id"], name="attempt_node_idx"),
            # The attempts list filtered by service, newest first.
            models.Index(fields=["service", "id"], name="attempt_service_idx"),
            # The attempts whose service and tenant are not copied yet (jobs.attempt_refs): empty once filled.
            models.Index(fields=["id"], condition=Q(service__isnull=True), name="attempt_refs_missing_idx"),
        ]
        constraints = [
            _choices_check("status", AttemptStatus, "attempt_status_valid"),
            models.UniqueConstraint(fields=["task", "attempt_no"], name="attempt_task_no_unique"),
            models.CheckConstraint(
                condition=(Q(status="running", finished_at__isnull=True)
                           | Q(~Q(status="running"), finished_at__isnull=False)),
                name="attempt_finished_iff_finished_at",
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.attempt_no} of {self.task_id}"


class TriggerType(models.TextChoices):
    """What fires a trigger."""

    EVENT = "event", "Application event"
    SCHEDULE = "schedule", "Cron schedule"


class MissedRunPolicy(models.TextChoices):
    """What a schedule does with due times that passed while no builder ran."""

    SKIP = "skip", "Skip missed runs, fire at the next due time"
    RUN_ONCE = "run_once", "Fire once for all missed runs"


class Trigger(models.Model):
    """Starts jobs on an application event or a cron schedule, within one tenant."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="triggers")
    label = models.CharField(max_length=200)
    is_enabled = models.BooleanField(default=True)
    trigger_type = models.CharField(max_length=16, choices=TriggerType.choices)
    event_name = models.CharField(max_length=200, null=True, blank=True)
    cron_expr = models.CharField(max_length=200, null=True, blank=True)
    timezone = models.CharField(max_length=64, null=True, blank=True)
    missed_run_policy = models.CharField(max_length=16, choices=MissedRunPolicy.choices,
                                         default=MissedRunPolicy.RUN_ONCE)
    workflow = models.ForeignKey("workflows.Workflow", on_delete=models.PROTECT, null=True, blank=True,
                                 related_name="+")
    service = models.ForeignKey("workflows.Service", on_delete=models.PROTECT, null=True, blank=True, related_name="+")
    payload_template = models.JSONField(default=dict, blank=True)
    priority = models.IntegerField(default=0)
    dedupe_window_seconds = models.PositiveIntegerField(default=300)
    next_run_at = models.DateTimeField(null=True, blank=True, help_text="Next due time (schedule triggers).")
    last_fired_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")
    # The last user who changed the trigger (API or admin): with the creator, barred from approving its jobs.
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+", db_index=False)
    created_at = models.DateTimeField(default=now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "accs_trigger"
        ordering = ["tenant", "label"]
        constraints = [
            _choices_check("trigger_type", TriggerType, "trigger_type_valid"),
            _choices_check("missed_run_policy", MissedRunPolicy, "trigger_missed_run_policy_valid"),
            models.CheckConstraint(
                condition=(
                    Q(trigger_type="event", event_name__isnull=False, cron_expr__isnull=True)
                    | Q(trigger_type="schedule", cron_expr__isnull=False, timezone__isnull=False,
                        event_name__isnull=True)
                ),
                name="trigger_event_or_schedule_fields",
            ),
            models.CheckConstraint(
                condition=(Q(workflow__isnull=False, service__isnull=True)
                           | Q(workflow__isnull=True, service__isnull=False)),
                name="trigger_targets_workflow_xor_service",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "is_enabled"], name="trigger_tenant_enabled_idx"),
            models.Index(fields=["event_name"], condition=Q(trigger_type="event", is_enabled=True),
                         name="trigger_event_idx"),
            models.Index(fields=["next_run_at"], condition=Q(trigger_type="schedule", is_enabled=True),
                         name="trigger_due_idx"),
        ]

    def __str__(self) -> str:
        return self.label


class RateStart(models.Model):
    """One task start of a rate-limited service, kept while it counts against a limit.

    The claim writes a row per start of a service that has a rate limit (with the value of its
    ``rate_key`` when it has one) and counts the rows of the last period under the service's
    claim lock, so no window of that length ever holds more starts than the limit, whichever
    agents claimed them. Rows older than the period count for nothing; a builder duty deletes them.
    """

    id = models.BigAutoField(primary_key=True)
    service = models.ForeignKey("workflows.Service", on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.TextField(null=True, blank=True, help_text="The value of the service's rate_key; empty: none.")
    at = models.DateTimeField(help_text="When the claim started the task (PostgreSQL's clock).")

    class Meta:
        db_table = "accs_rate_start"
        indexes = [
            models.Index(fields=["service", "at"], name="rate_start_service_at_idx"),
            models.Index(fields=["service", "key", "at"], condition=Q(key__isnull=False), name="rate_start_key_at_idx"),
        ]

    def __str__(self) -> str:
        return f"start of service {self.service_id} at {self.at}"


class LimitKeyHead(models.Model):
    """Where a key of a keyed service's queue begins, per tenant: the keyed claim's list of keys.

    Kept by the database (jobs.limit_keys). For every key with a queued task bound to no host there
    is a row whose position in the claim order (priority, order_seq, created_at, task id) is at or
    before the key's first queued task; rows may lag behind (a key whose first tasks were claimed
    or canceled), and the claim brings the rows it reads up to date. The claim reads the rows in
    order and passes over the keys at their limit one row each, never their queued tasks.
    """

    id = models.BigAutoField(primary_key=True)
    service_id = models.BigIntegerField()
    tenant_id = models.UUIDField()
    key = models.TextField(db_collation="C")
    priority = models.IntegerField()
    order_seq = models.BigIntegerField()
    created_at = models.DateTimeField()
    task_id = models.UUIDField(help_text="The task this position was taken from (the order's last tie-break).")
    emptied = models.BooleanField(default=False, help_text="Set by a claim that found the key's queue empty; "
                                                           "settled before that claim commits.")
    cap_full = models.BooleanField(db_default=False, help_text="The key's held tasks fill its cap (kept by the "
                                                               "held counts' trigger): the claim passes it over.")
    rate_until = models.DateTimeField(null=True, blank=True, help_text="The key's starts fill its rate window "
                                                                       "until then: the claim passes it over.")

    class Meta:
        db_table = "accs_limit_key_head"
        indexes = [
            # The claim: each tenant's keys with room in the claim order, the key read from the index
            # (a key at its cap or rate is not in it, so no claim visits it).
            models.Index("service_id", "tenant_id", F("priority").desc(), "order_seq", "created_at", "task_id",
                         condition=Q(cap_full=False, rate_until__isnull=True), name="limit_key_head_order_idx"),
            # A key's rows: does one already cover a task being queued; bringing a key up to date; a
            # key's rows following its held count or its starts (by service and key, any tenant).
            models.Index(fields=["service_id", "key", "tenant_id"], name="limit_key_head_key_idx"),
            # The rate blocks a claim clears when they have run out.
            models.Index(fields=["service_id", "rate_until"], condition=Q(rate_until__isnull=False),
                         name="limit_key_head_rate_until_idx"),
            # The rows a claim found empty, settled in the claim's transaction (so almost always none).
            models.Index(fields=["service_id"], condition=Q(emptied=True), name="limit_key_head_emptied_idx"),
        ]

    def __str__(self) -> str:
        return f"key {self.key!r} of service {self.service_id} from task {self.task_id}"


class LimitKeyHeld(models.Model):
    """How many tasks of a key of a keyed service are held (starting or running): the per-key cap's count.

    Kept by the database (jobs.limit_keys), in the transaction that moves a task into or out of held
    work, so the keyed claim reads one row per key instead of counting the held tasks' params.
    """

    id = models.BigAutoField(primary_key=True)
    service_id = models.BigIntegerField()
    key = models.TextField(db_collation="C")
    held = models.IntegerField()

    class Meta:
        db_table = "accs_limit_key_held"
        constraints = [models.UniqueConstraint(fields=["service_id", "key"], name="limit_key_held_key_uniq")]


class LeaderLease(models.Model):
    """The builder leader's lease: one row, taken and renewed in short transactions (jobs/leader.py).

    Whoever holds an unexpired lease is the leader; expiry is PostgreSQL's clock. Every gain
    draws a new fencing number from a sequence, and every leader-only write checks it in its own
    transaction, so a deposed leader's late write does nothing. Nothing lives on a session: the
    lease works through a transaction-mode pooler and survives the leader's reconnects.
    """

    name = models.TextField(primary_key=True, help_text="What is led (one row: 'builder').")
    holder = models.TextField(help_text="The holding builder: host, process id and a random suffix.")
    fence = models.BigIntegerField(help_text="The fencing number of the current term (strictly increasing).")
    acquired_at = models.DateTimeField(help_text="When this term began (PostgreSQL's clock).")
    expires_at = models.DateTimeField(help_text="When the lease ends unless renewed (PostgreSQL's clock).")

    class Meta:
        db_table = "accs_leader"

    def __str__(self) -> str:
        return f"{self.name} led by {self.holder} (fence {self.fence})"


class LeaderTerm(models.Model):
    """One leadership term: its window and the span of the leader-only writes made under its fence.

    Kept for operators (who led when) and as the proof that terms never overlap: the writes of
    one fence all end before the next fence's term begins.
    """

    fence = models.BigIntegerField(primary_key=True)
    holder = models.TextField()
    acquired_at = models.DateTimeField(help_text="When the term began (PostgreSQL's clock, after the takeover).")
    expires_at = models.DateTimeField(help_text="The lease's end as last renewed.")
    first_write_at = models.DateTimeField(null=True, blank=True, help_text="First duty transaction that wrote.")
    last_write_at = models.DateTimeField(null=True, blank=True, help_text="Last duty transaction that wrote.")
    writes = models.BigIntegerField(default=0, help_text="Units of work the duties of this term did.")

    class Meta:
        db_table = "accs_leader_term"
        # The system timeline reads the terms that began in a window (ops.system_timeline).
        indexes = [models.Index(fields=["acquired_at"], name="leader_term_acquired_idx")]

    def __str__(self) -> str:
        return f"term {self.fence} of {self.holder}"


class ClusterPulse(models.Model):
    """The last time a builder reached PostgreSQL (its clock): one row, stamped every builder tick.

    The engine's own signal of an outage (:mod:`jobs.pulse`): a stamp that finds the previous one
    too old, or PostgreSQL restarted since it, records an :class:`Outage`.
    """

    name = models.TextField(primary_key=True)
    seen_at = models.DateTimeField(help_text="The last stamp (PostgreSQL's clock).")

    class Meta:
        db_table = "accs_cluster_pulse"

    def __str__(self) -> str:
        return f"{self.name}: seen {self.seen_at:%Y-%m-%d %H:%M:%S}"


class OutageCause(models.TextChoices):
    """How the pulse told an outage."""

    GAP = "gap", "No builder reached PostgreSQL for longer than the pulse's gap"
    RESTART = "restart", "PostgreSQL restarted (a stop and start, or a crash restart) since the last stamp"


class Outage(models.Model):
    """A span during which the engine could not reach PostgreSQL, as the pulse saw it.

    Leases that ended within it were stopped by the outage, not by their tasks (:mod:`jobs.rescue`).
    """

    began_at = models.DateTimeField(help_text="The last stamp before the outage.")
    ended_at = models.DateTimeField(help_text="The first stamp after it.")
    cause = models.CharField(max_length=16, choices=OutageCause.choices)

    class Meta:
        db_table = "accs_outage"
        constraints = [
            models.CheckConstraint(condition=Q(cause__in=[c.value for c in OutageCause]), name="outage_cause_valid"),
            models.CheckConstraint(condition=Q(ended_at__gte=models.F("began_at")), name="outage_ends_after_it_began"),
        ]
        indexes = [models.Index(fields=["ended_at"], name="outage_ended_idx")]

    def __str__(self) -> str:
        return f"outage {self.began_at:%Y-%m-%d %H:%M:%S} – {self.ended_at:%H:%M:%S} ({self.cause})"


class RetentionMark(models.Model):
    """What retention last pruned, and how much since the row began: one row per kind of pruning.

    Written by each batch that deleted something (:func:`jobs.retention.prune_finished_jobs`), in
    the batch's transaction; the dashboard reads it instead of searching the timeline for events.
    """

    name = models.TextField(primary_key=True, help_text="What is pruned ('finished_jobs').")
    last_pruned_at = models.DateTimeField(help_text="When the last batch that deleted something committed "
                                                    "(PostgreSQL's clock).")
    jobs = models.BigIntegerField(help_text="Jobs the last batch deleted.")
    tasks = models.BigIntegerField(help_text="Tasks the last batch deleted.")
    artifacts = models.BigIntegerField(help_text="Artifact rows the last batch deleted.")
    export_key = models.TextField(blank=True, default="", help_text="Where the last batch was exported, if it was.")
    total_jobs = models.BigIntegerField(help_text="Jobs deleted since ``since``.")
    total_tasks = models.BigIntegerField(help_text="Tasks deleted since ``since``.")
    since = models.DateTimeField(help_text="The first batch this row counts.")

    class Meta:
        db_table = "accs_retention_mark"

    def __str__(self) -> str:
        return f"{self.name}: last pruned {self.last_pruned_at:%Y-%m-%d %H:%M} ({self.jobs} jobs)"


class AttemptRollup(models.Model):
    """Attempts per 20 minutes of their start, service and tenant (:mod:`jobs.attempt_rollup`): the dashboard's
    charts. Written only by the builder's fold; ``wait_0`` … ``wait_19`` count the queue waits per bin of
    ``jobs.attempt_rollup.WAIT_BOUNDS``."""

    id = models.BigAutoField(primary_key=True)
    bucket = models.DateTimeField(help_text="The start of the 20 minutes (from the Unix epoch, UTC).")
    # Plain ids, no foreign keys: a rollup row outlives nothing it names, and a service's or tenant's delete
    # has nothing to check here.
    service_id = models.BigIntegerField(null=True)
    tenant_id = models.UUIDField(null=True)
    attempts = models.IntegerField(help_text="Attempts started in the bucket, finished when folded.")
    succeeded = models.IntegerField()
    failed = models.IntegerField(help_text="Failed or timed out.")

    class Meta:
        db_table = "accs_attempt_rollup"
        constraints = [
            # The fold's ON CONFLICT key, and the readers' range by bucket.
            models.UniqueConstraint(fields=["bucket", "service_id", "tenant_id"], nulls_distinct=False,
                                    name="attempt_rollup_key"),
        ]


for _bin in range(20):  # jobs.attempt_rollup.WAIT_BINS
    AttemptRollup.add_to_class(f"wait_{_bin}", models.IntegerField(default=0))


class AttemptNodeRollup(models.Model):
    """Attempts per hour of their start, node, service and tenant (:mod:`jobs.attempt_rollup`): the rates."""

    id = models.BigAutoField(primary_key=True)
    bucket = models.DateTimeField(help_text="The start of the hour (UTC).")
    node = models.CharField(max_length=200)
    service_id = models.BigIntegerField(null=True)
    tenant_id = models.UUIDField(null=True)
    attempts = models.IntegerField()
    succeeded = models.IntegerField()
    failed = models.IntegerField(help_text="Failed or timed out.")

    class Meta:
        db_table = "accs_attempt_node_rollup"
        constraints = [
            models.UniqueConstraint(fields=["bucket", "node", "service_id", "tenant_id"], nulls_distinct=False,
                                    name="attempt_node_rollup_key"),
        ]


class AttemptRollupMark(models.Model):
    """How far the fold has come (one row): attempts started before ``folded_until`` are in the rollups, but
    for ``pending``, those still running when they were folded (counted once they finish)."""

    name = models.TextField(primary_key=True)
    folded_until = models.DateTimeField(null=True)
    folded_at = models.DateTimeField(null=True, help_text="When the last fold committed (PostgreSQL's clock).")
    pending = ArrayField(models.BigIntegerField(), default=list)

    class Meta:
        db_table = "accs_attempt_rollup_mark"
