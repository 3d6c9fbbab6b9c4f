"""HTTP endpoints for jobs and triggers under /api/v1/jobs, token-authenticated and tenant-scoped.

Every endpoint is tenant-scoped through :mod:`tenants.scoping`: a tenant admin sees and acts only in
their tenants (a job of another tenant is "not found"), a viewer only reads, a superuser sees all.
State changes go through :mod:`jobs.api` / :mod:`jobs.transitions`; a transition that no longer
applies answers 409 with its reason.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from django.core.exceptions import PermissionDenied
from django.db.models import Min
from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Query, Router, Schema, Status
from pydantic import AwareDatetime, field_validator

from accs_site.counting import estimated_count
from accs_site.http import INT32, In, require_scope, responses, username, utc
from accs_site.redaction import keep_secrets, redact_params
from jobs import api, redrive, triggers
from jobs.idempotency import differences
from jobs.models import (
    JOB_ACTIVE,
    TASK_HELD,
    ApprovalState,
    Attempt,
    Job,
    JobSource,
    JobStatus,
    MissedRunPolicy,
    Task,
    Trigger,
    TriggerType,
)
from jobs.narrow import widen
from tenants.models import Tenant
from tenants.scoping import can_act, scope, tenant_ids_for
from workflows.validation import DefinitionError, Problem

router = Router(tags=["jobs"])

MAX_OFFSET = 1_000_000


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

class JobIn(In):
    """A job to start: exactly one of ``workflow`` (by name; latest active version unless
    ``version``) or ``service``. ``external_id`` makes the request idempotent per tenant."""

    workflow: str | None = Field(None, min_length=1, max_length=100)
    version: int | None = Field(None, ge=1, le=INT32)
    service: str | None = Field(None, min_length=1, max_length=100)
    params: dict[str, Any] | None = Field(None, description="Params of a service job.")
    step_params: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-step param overrides of a workflow job.")
    options: dict[str, Any] = Field(default_factory=dict, description="hosts / host_selector for fan-out steps.")
    priority: int = Field(0, ge=-INT32, le=INT32, description="Higher is more important.")
    scheduled_at: AwareDatetime | None = None
    tenant: str | None = Field(None, min_length=1, max_length=100, description="Tenant slug or id.")
    external_id: str | None = Field(None, min_length=1, max_length=200)
    dedupe_key: str | None = Field(None, min_length=1, max_length=200)
    correlation_id: str = Field("", max_length=200)

    @field_validator("scheduled_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return utc(value, field="scheduled_at")


class JobOut(Schema):
    id: UUID
    tenant: str
    tenant_id: UUID
    workflow: str | None
    workflow_version: int | None
    service: str | None
    status: JobStatus
    progress: float
    current_task_key: str
    priority: int
    order_seq: int
    options: dict[str, Any]
    step_params: dict[str, Any]
    scheduled_at: datetime
    error_code: str
    error_message: str
    source: JobSource
    source_ref: str
    external_id: str | None
    dedupe_key: str | None
    correlation_id: str
    approval_state: ApprovalState
    approved_by: str
    approved_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime


class TaskOut(Schema):
    id: UUID
    task_key: str
    step_key: str
    service: str
    host: str | None
    status: str
    depends_on: list[str]
    attempt: int
    max_attempts: int
    next_attempt_at: datetime
    priority: int
    progress: float | None
    params: dict[str, Any]
    results: Any = None
    node: str
    started_at: datetime | None
    finished_at: datetime | None
    error_code: str
    error_message: str


class JobDetailOut(JobOut):
    tasks: list[TaskOut]


class JobPage(Schema):
    items: list[JobOut]
    limit: int
    offset: int
    has_more: bool = Field(description="More rows after this page (no exact total on purpose).")


class AttemptOut(Schema):
    task_id: UUID
    task_key: str
    attempt_no: int
    status: str
    node: str
    agent_id: str
    pid: int | None
    exit_code: int | None
    started_at: datetime
    finished_at: datetime | None
    stdout_tail: str
    stderr_tail: str
    error_text: str


class ActionOut(Schema):
    changed: bool
    message: str
    job: JobOut


class RejectIn(In):
    reason: str = Field("", max_length=2000)


class SummaryOut(Schema):
    counts: dict[str, int] = Field(description="Jobs by status. Unfinished statuses are exact; a finished status"
                                   " with more than 10,000 jobs is PostgreSQL's estimate (listed in `estimated`).")
    estimated: list[str] = Field(description="The statuses in `counts` given as an estimate, not an exact count.")
    running: int = Field(description="Running jobs.")
    running_tasks: int = Field(description="Tasks held by agents (starting or running).")
    pending_approval: int
    oldest_queued_age_seconds: float | None = Field(description="Age of the oldest due queued job.")
    generated_at: datetime


class JobFilter(In):
    status: JobStatus | None = None
    source: JobSource | None = None
    approval_state: ApprovalState | None = None
    service: str | None = Field(None, max_length=100)
    workflow: str | None = Field(None, max_length=100)
    tenant: str | None = Field(None, max_length=100, description="Tenant slug.")
    created_after: datetime | None = None
    created_before: datetime | None = None
    limit: int = Field(50, ge=1, le=500)
    offset: int = Field(0, ge=0, le=MAX_OFFSET)

    @field_validator("created_after", "created_before")
    @classmethod
    def _utc(cls, value: datetime | None, info) -> datetime | None:
        return utc(value, field=info.field_name)


class RedriveIn(In):
    """Which dead letters (``target: tasks``, tasks in final error) or failed jobs (``target: jobs``,
    jobs in error, plus ``include``: partial / canceled) to retry. Each field given narrows the match;
    ``since <= finished_at < until``. ``dry_run`` (the default) only counts."""

    target: Literal["tasks", "jobs"] = "tasks"
    service: str | None = Field(None, min_length=1, max_length=100, description="Service key.")
    tenant: str | None = Field(None, min_length=1, max_length=100, description="Tenant slug or id.")
    error_contains: str | None = Field(None, min_length=1, max_length=500,
                                       description="Case-insensitive part of the error message.")
    since: datetime | None = Field(None, description="Finished at or after (ISO 8601; naive means UTC).")
    until: datetime | None = Field(None, description="Finished before (ISO 8601; naive means UTC).")
    node: str | None = Field(None, min_length=1, max_length=200, description="Node that last held the task.")
    include: list[Literal["partial", "canceled"]] = Field(default_factory=list, description="Jobs only.")
    dry_run: bool = True
    batch: int = Field(500, ge=1, le=redrive.MAX_BATCH, description="Tasks or jobs per transaction.")
    limit: int | None = Field(None, ge=1, le=INT32, description="Redrive at most this many.")

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, value: datetime | None, info) -> datetime | None:
        return utc(value, field=info.field_name)


class RedriveOut(Schema):
    target: str
    dry_run: bool
    matched: int = Field(description="Matching now (dry run) or taken in by the redrive.")
    redriven: int
    skipped: int = Field(description="No longer applicable when their batch came (retried or changed since).")
    batches: int
    filter: dict[str, Any]


class TriggerIn(In):
    """A trigger. Event triggers name ``event_name``; schedule triggers give ``cron_expr`` and
    ``timezone`` (default: the tenant's). ``payload_template`` becomes the service's params (or, for a
    workflow, ``{step: params}``), rendered from ``{{event.*}}`` / ``{{schedule.*}}`` placeholders."""

    label: str = Field(min_length=1, max_length=200)
    trigger_type: TriggerType
    event_name: str | None = Field(None, min_length=1, max_length=200)
    cron_expr: str | None = Field(None, min_length=1, max_length=200)
    timezone: str | None = Field(None, min_length=1, max_length=64)
    missed_run_policy: MissedRunPolicy = MissedRunPolicy.RUN_ONCE
    workflow: str | None = Field(None, min_length=1, max_length=100, description="Workflow name.")
    service: str | None = Field(None, min_length=1, max_length=100, description="Service key.")
    payload_template: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(0, ge=-INT32, le=INT32)
    dedupe_window_seconds: int = Field(300, ge=0, le=INT32)
    is_enabled: bool = True
    tenant: str | None = Field(None, min_length=1, max_length=100, description="Tenant slug or id.")


class TriggerPatch(In):
    label: str | None = Field(None, min_length=1, max_length=200)
    event_name: str | None = Field(None, min_length=1, max_length=200)
    cron_expr: str | None = Field(None, min_length=1, max_length=200)
    timezone: str | None = Field(None, min_length=1, max_length=64)
    missed_run_policy: MissedRunPolicy | None = None
    workflow: str | None = Field(None, min_length=1, max_length=100)
    service: str | None = Field(None, min_length=1, max_length=100)
    payload_template: dict[str, Any] | None = None
    priority: int | None = Field(None, ge=-INT32, le=INT32)
    dedupe_window_seconds: int | None = Field(None, ge=0, le=INT32)
    is_enabled: bool | None = None


class TriggerOut(Schema):
    id: UUID
    tenant: str
    tenant_id: UUID
    label: str
    is_enabled: bool
    trigger_type: TriggerType
    event_name: str | None
    cron_expr: str | None
    timezone: str | None
    missed_run_policy: MissedRunPolicy
    workflow: str | None
    service: str | None
    payload_template: dict[str, Any]
    priority: int
    dedupe_window_seconds: int
    next_run_at: datetime | None
    last_fired_at: datetime | None
    last_error: str
    created_at: datetime
    updated_at: datetime


class TriggerFilter(In):
    tenant: str | None = Field(None, max_length=100)
    trigger_type: TriggerType | None = None
    is_enabled: bool | None = None
    limit: int = Field(100, ge=1, le=500)
    offset: int = Field(0, ge=0, le=MAX_OFFSET)


class TriggerPage(Schema):
    items: list[TriggerOut]
    limit: int
    offset: int
    has_more: bool


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

JOB_RELATED = ("tenant", "workflow", "service")


def _job_out(job: Job) -> dict[str, Any]:
    """Return a job as the API shows it; secret-named params are redacted (for every reader)."""
    return {
        "id": job.id, "tenant": job.tenant.slug, "tenant_id": job.tenant_id,
        "workflow": job.workflow.name if job.workflow else None,
        "workflow_version": job.workflow.version if job.workflow else None,
        "service": job.service.key if job.service else None,
        **{f: getattr(job, f) for f in (
            "status", "progress", "current_task_key", "priority", "order_seq", "options",
            "scheduled_at", "error_code", "error_message", "source", "source_ref", "external_id", "dedupe_key",
            "correlation_id", "approval_state", "approved_by", "approved_at", "created_at", "started_at",
            "finished_at", "updated_at")},
        "step_params": redact_params(job.step_params),
    }


def _task_out(task: Task) -> dict[str, Any]:
    """Return a task as the API shows it; secret-named params and output values are redacted."""
    return {
        "id": task.id, "task_key": task.task_key, "step_key": task.step_key, "service": task.service.key,
        "host": task.host.name if task.host else None,
        **{f: getattr(task, f) for f in (
            "status", "depends_on", "attempt", "max_attempts", "next_attempt_at", "priority", "progress",
            "node", "started_at", "finished_at", "error_code", "error_message")},
        "params": redact_params(task.params),
        # The step's output (what its dependents receive), redacted as params are.
        "results": redact_params(task.results),
    }


def _trigger_out(trigger: Trigger) -> dict[str, Any]:
    """Return a trigger as the API shows it; secret-named values of its payload template are redacted."""
    return {
        "id": trigger.id, "tenant": trigger.tenant.slug, "tenant_id": trigger.tenant_id,
        "workflow": trigger.workflow.name if trigger.workflow else None,
        "service": trigger.service.key if trigger.service else None,
        **{f: getattr(trigger, f) for f in (
            "label", "is_enabled", "trigger_type", "event_name", "cron_expr", "timezone", "missed_run_policy",
            "priority", "dedupe_window_seconds", "next_run_at", "last_fired_at", "last_error",
            "created_at", "updated_at")},
        "payload_template": redact_params(trigger.payload_template),
    }


def _visible_job(request: HttpRequest, job_id: UUID, *, write: bool = False) -> Job:
    """Return a job the caller may see (and, with ``write``, act on); another tenant's job is 404.

    A narrow start (jobs.narrow) becomes its job first, so a job just started reads as queued.
    """
    widen([job_id])
    job = scope(Job.objects.select_related(*JOB_RELATED), request.auth).filter(pk=job_id).first()
    if job is None:
        raise api.NotFound(f"no job {job_id}")
    if write and not can_act(request.auth, job.tenant_id):
        raise PermissionDenied("you may read this tenant's jobs but not act on them (viewer role)")
    return job


def _visible_trigger(request: HttpRequest, trigger_id: UUID, *, write: bool = False) -> Trigger:
    trigger = (scope(Trigger.objects.select_related("tenant", "workflow", "service"), request.auth)
               .filter(pk=trigger_id).first())
    if trigger is None:
        raise api.NotFound(f"no trigger {trigger_id}")
    if write and not can_act(request.auth, trigger.tenant_id):
        raise PermissionDenied("you may read this tenant's triggers but not change them (viewer role)")
    return trigger


def _tenant_to_act_in(request: HttpRequest, given: str | None) -> Tenant:
    """Return the tenant a create request acts in: the one given, or the caller's only tenant."""
    allowed = tenant_ids_for(request.auth, write=True)
    if given is not None:
        try:
            tenant = api.resolve_tenant(given)
        except api.NotFound:
            tenant = None
        # Same answer for "no such tenant" and "not yours": tenant names are not disclosed.
        if tenant is None or (allowed is not None and tenant.id not in allowed):
            raise PermissionDenied(f"you may not act in tenant {given!r}")
        return tenant
    if allowed is None:
        return api.resolve_tenant(None)
    if len(allowed) == 1:
        return Tenant.objects.get(pk=next(iter(allowed)))
    if not allowed:
        raise PermissionDenied("you are not an admin of any tenant")
    raise DefinitionError([Problem("tenant", "you act in several tenants; say which (slug or id)")])


def _tenant_filter(request: HttpRequest, qs, slug: str | None):
    """Scope ``qs`` to the caller's tenants, then to ``slug``; naming a tenant not readable is 403."""
    qs = scope(qs, request.auth)
    if not slug:
        return qs
    allowed = tenant_ids_for(request.auth)
    if allowed is not None and not Tenant.objects.filter(slug=slug, id__in=allowed).exists():
        # Same answer for "no such tenant" and "not yours": tenant names are not disclosed.
        raise PermissionDenied(f"you may not read tenant {slug!r}")
    return qs.filter(tenant__slug=slug)


def _page(items: list, limit: int) -> tuple[list, bool]:
    return items[:limit], len(items) > limit


def _action(request: HttpRequest, job: Job, result: api.ActionResult):
    if result.forbidden:
        return Status(403, {"detail": result.message, "job_id": job.id})
    if not result.changed:
        return Status(409, {"detail": result.message, "job_id": job.id})
    job = Job.objects.select_related(*JOB_RELATED).get(pk=job.pk)
    return {"changed": True, "message": result.message, "job": _job_out(job)}


# --------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------

@router.post("", response=responses({200: JobOut, 201: JobOut}), summary="Start a job (webhook enqueue)")
def create_job(request: HttpRequest, body: JobIn):
    """Start a job; 201 when created, 200 with the existing job when ``external_id`` was seen before
    in the tenant with the same body, 409 naming that job when the body differs, 409 naming the holder
    when ``dedupe_key`` is held by a queued or running job."""
    require_scope(request, "run")
    tenant = _tenant_to_act_in(request, body.tenant)
    spec = api.JobSpec(
        workflow=body.workflow, version=body.version, service=body.service, params=body.params,
        step_params=body.step_params, options=body.options, priority=body.priority, scheduled_at=body.scheduled_at,
        tenant=tenant, external_id=body.external_id, dedupe_key=body.dedupe_key, correlation_id=body.correlation_id,
        source=JobSource.WEBHOOK, source_ref=f"api:{username(request)}"[:200], created_by=request.auth,
    )
    try:
        started = api.start(spec)
    except api.NotFound as exc:
        # A body naming an unknown workflow/service is an invalid request, not a missing resource.
        raise DefinitionError([Problem("workflow" if body.workflow else "service", str(exc))]) from None
    # A new job is answered as the start wrote it (every start path returns the job as stored; a narrow
    # start, jobs.narrow, has no job row yet to read); a repeated external_id's job is read.
    job = started if started.was_created else Job.objects.select_related(*JOB_RELATED).get(pk=started.pk)
    if not started.was_created:
        differ = differences(job, spec)
        if differ:
            return Status(409, {"detail": f"external_id {body.external_id!r} already names job {job.id}, "
                                          f"started with a different {', '.join(differ)}; repeat the same body "
                                          "to get that job, or use a new external_id", "job_id": job.id})
    return Status(201 if started.was_created else 200, _job_out(job))


@router.get("", response=responses({200: JobPage}), summary="List jobs")
def list_jobs(request: HttpRequest, filters: Query[JobFilter]):
    """Newest first; ``has_more`` instead of an exact count, so big tables stay cheap."""
    require_scope(request, "read")
    qs = _tenant_filter(request, Job.objects.select_related(*JOB_RELATED), filters.tenant)
    for name in ("status", "source", "approval_state"):
        value = getattr(filters, name)
        if value is not None:
            qs = qs.filter(**{name: value})
    if filters.service:
        qs = qs.filter(service__key=filters.service)
    if filters.workflow:
        qs = qs.filter(workflow__name=filters.workflow)
    if filters.created_after:
        qs = qs.filter(created_at__gte=filters.created_after)
    if filters.created_before:
        qs = qs.filter(created_at__lt=filters.created_before)
    rows = list(qs.order_by("-created_at", "-id")[filters.offset:filters.offset + filters.limit + 1])
    items, more = _page(rows, filters.limit)
    return {"items": [_job_out(j) for j in items], "limit": filters.limit, "offset": filters.offset, "has_more": more}


class SummaryFilter(In):
    tenant: str | None = Field(None, max_length=100, description="Tenant slug.")


@router.get("/summary", response=responses({200: SummaryOut}), summary="Queue summary")
def summary(request: HttpRequest, filters: Query[SummaryFilter]):
    """Counts by status, running count, pending approvals and the age of the oldest due queued job."""
    require_scope(request, "read")
    tenant = filters.tenant
    now = timezone.now()
    jobs = _tenant_filter(request, Job.objects.all(), tenant)
    # Each status is counted one index descent per tenant (job_tenant_status_created_idx; a bare
    # status filter matches no index and reads the whole job table). Unfinished jobs are few and
    # counted exactly; finished ones are the history, counted up to a limit, then estimated.
    per_tenant = jobs.filter(tenant_id__in=Tenant.objects.values("id"))
    counts: dict[str, int] = {}
    estimated = []
    for status in JobStatus.values:
        rows = per_tenant.filter(status=status)
        if status in JOB_ACTIVE:
            counts[status] = rows.count()
            continue
        counts[status], guessed = estimated_count(rows)
        if guessed:
            estimated.append(status)
    oldest = (jobs.filter(status=JobStatus.QUEUED, scheduled_at__lte=now)
              .exclude(approval_state__in=[ApprovalState.PENDING, ApprovalState.REJECTED])
              .aggregate(t=Min("scheduled_at"))["t"])
    tasks = _tenant_filter(request, Task.objects.filter(status__in=TASK_HELD), tenant)
    return {
        "counts": counts, "estimated": estimated, "running": counts[JobStatus.RUNNING], "running_tasks": tasks.count(),
        "pending_approval": jobs.filter(status=JobStatus.QUEUED, approval_state=ApprovalState.PENDING).count(),
        "oldest_queued_age_seconds": round((now - oldest).total_seconds(), 3) if oldest else None,
        "generated_at": now,
    }


# --------------------------------------------------------------------------------------------
# Bulk redrive (declared before /{job_id})
# --------------------------------------------------------------------------------------------

@router.post("/redrive", response=responses({200: RedriveOut}), summary="Redrive dead letters or failed jobs in bulk")
def redrive_matching(request: HttpRequest, body: RedriveIn):
    """Count (``dry_run``, the default) or retry every dead-lettered task or failed job matching the
    filter, in the tenants you administer. An unknown service, a bad time or ``until`` before
    ``since`` is 422 naming the field; a tenant you may not act in is 403."""
    require_scope(request, "run")
    allowed = tenant_ids_for(request.auth, write=True)
    if allowed is not None and not allowed:
        raise PermissionDenied("you are not an admin of any tenant")
    flt = redrive.RedriveFilter(
        jobs=body.target == "jobs", service=body.service, tenant=body.tenant, error_contains=body.error_contains,
        since=body.since, until=body.until, node=body.node, include=frozenset(body.include))
    if body.dry_run:
        result = redrive.dry_run(flt, limit=body.limit, tenant_ids=allowed)
    else:
        result = redrive.redrive(flt, by=username(request), batch=body.batch, limit=body.limit, tenant_ids=allowed)
    return {"target": body.target, "dry_run": body.dry_run, "matched": result.matched, "redriven": result.redriven,
            "skipped": result.skipped, "batches": result.batches, "filter": flt.describe()}


# --------------------------------------------------------------------------------------------
# Triggers (declared before /{job_id} so "triggers" is not read as a job id)
# --------------------------------------------------------------------------------------------

@router.get("/triggers", response=responses({200: TriggerPage}), summary="List triggers")
def list_triggers(request: HttpRequest, filters: Query[TriggerFilter]):
    require_scope(request, "read")
    qs = _tenant_filter(request, Trigger.objects.select_related("tenant", "workflow", "service"), filters.tenant)
    if filters.trigger_type is not None:
        qs = qs.filter(trigger_type=filters.trigger_type)
    if filters.is_enabled is not None:
        qs = qs.filter(is_enabled=filters.is_enabled)
    rows = list(qs.order_by("label", "id")[filters.offset:filters.offset + filters.limit + 1])
    items, more = _page(rows, filters.limit)
    return {"items": [_trigger_out(t) for t in items], "limit": filters.limit, "offset": filters.offset,
            "has_more": more}


@router.post("/triggers", response=responses({201: TriggerOut}), summary="Create a trigger")
def create_trigger(request: HttpRequest, body: TriggerIn):
    """Validated on save: cron expression, time zone and template errors name their field (422)."""
    require_scope(request, "run")
    tenant = _tenant_to_act_in(request, body.tenant)
    fields = body.model_dump(exclude={"tenant"})
    trigger = triggers.create_trigger(tenant=tenant, created_by=request.auth, **fields)
    return Status(201, _trigger_out(trigger))


@router.get("/triggers/{trigger_id}", response=responses({200: TriggerOut}), summary="Get a trigger")
def get_trigger(request: HttpRequest, trigger_id: UUID):
    require_scope(request, "read")
    return _trigger_out(_visible_trigger(request, trigger_id))


@router.patch("/triggers/{trigger_id}", response=responses({200: TriggerOut}), summary="Change a trigger")
def update_trigger(request: HttpRequest, trigger_id: UUID, body: TriggerPatch):
    """Send only the fields to change; ``null`` clears ``workflow`` / ``service`` / ``event_name``."""
    require_scope(request, "run")
    trigger = _visible_trigger(request, trigger_id, write=True)
    changes = body.model_dump(exclude_unset=True)
    for name in ("label", "missed_run_policy", "payload_template", "priority", "dedupe_window_seconds", "is_enabled"):
        if name in changes and changes[name] is None:
            raise DefinitionError([Problem(name, "cannot be null")])
    if isinstance(changes.get("payload_template"), dict):
        # A template sent back as read (secrets shown as ``***``) keeps the stored secrets.
        changes["payload_template"] = keep_secrets(changes["payload_template"], trigger.payload_template)
    return _trigger_out(triggers.update_trigger(trigger, by=request.auth, **changes))


@router.delete("/triggers/{trigger_id}", response=responses({204: None}), summary="Delete a trigger")
def delete_trigger(request: HttpRequest, trigger_id: UUID):
    """Jobs it started stay; their ``source_ref`` still names it."""
    require_scope(request, "run")
    _visible_trigger(request, trigger_id, write=True).delete()
    return Status(204, None)


# --------------------------------------------------------------------------------------------
# One job
# --------------------------------------------------------------------------------------------

@router.get("/{job_id}", response=responses({200: JobDetailOut}), summary="A job with its tasks")
def get_job(request: HttpRequest, job_id: UUID):
    require_scope(request, "read")
    job = _visible_job(request, job_id)
    tasks = (Task.objects.filter(job=job).select_related("service", "host")
             .order_by("order_seq", "created_at", "task_key"))
    return {**_job_out(job), "tasks": [_task_out(t) for t in tasks]}


@router.get("/{job_id}/attempts", response=responses({200: list[AttemptOut]}), summary="Attempts of a job's tasks")
def job_attempts(request: HttpRequest, job_id: UUID):
    require_scope(request, "read")
    job = _visible_job(request, job_id)
    rows = Attempt.objects.filter(task__job=job).select_related("task").order_by("started_at", "task__task_key",
                                                                                 "attempt_no")
    return [{"task_id": a.task_id, "task_key": a.task.task_key, **{f: getattr(a, f) for f in (
        "attempt_no", "status", "node", "agent_id", "pid", "exit_code", "started_at", "finished_at", "stdout_tail",
        "stderr_tail", "error_text")}} for a in rows]


@router.post("/{job_id}/cancel", response=responses({200: ActionOut}), summary="Cancel a job")
def cancel_job(request: HttpRequest, job_id: UUID):
    """Queued/waiting tasks are canceled; running ones are told to stop at their next heartbeat."""
    require_scope(request, "run")
    job = _visible_job(request, job_id, write=True)
    return _action(request, job, api.cancel(job.id, by=username(request)))


@router.post("/{job_id}/retry", response=responses({200: ActionOut}), summary="Retry a failed or canceled job")
def retry_job(request: HttpRequest, job_id: UUID):
    """Failed/skipped/canceled tasks go back to work with attempts reset; never an unapproved job."""
    require_scope(request, "run")
    job = _visible_job(request, job_id, write=True)
    return _action(request, job, api.retry(job.id, by=username(request)))


@router.post("/{job_id}/approve", response=responses({200: ActionOut}), summary="Approve a job")
def approve_job(request: HttpRequest, job_id: UUID):
    require_scope(request, "approve")
    job = _visible_job(request, job_id, write=True)
    return _action(request, job, api.approve(job.id, by=username(request)))


@router.post("/{job_id}/reject", response=responses({200: ActionOut}), summary="Reject a job")
def reject_job(request: HttpRequest, job_id: UUID, body: RejectIn | None = None):
    """The job and its unstarted tasks are canceled."""
    require_scope(request, "approve")
    job = _visible_job(request, job_id, write=True)
    return _action(request, job, api.reject(job.id, by=username(request), reason=body.reason if body else ""))


@router.post("/{job_id}/tasks/{task_id}/cancel", response=responses({200: ActionOut}), summary="Cancel one task")
def cancel_task(request: HttpRequest, job_id: UUID, task_id: UUID):
    require_scope(request, "run")
    job = _visible_job(request, job_id, write=True)
    if not Task.objects.filter(pk=task_id, job=job).exists():
        raise api.NotFound(f"no task {task_id} in job {job_id}")
    return _action(request, job, api.cancel_task(task_id, by=username(request)))


@router.post("/{job_id}/tasks/{task_id}/retry", response=responses({200: ActionOut}), summary="Retry one task")
def retry_task(request: HttpRequest, job_id: UUID, task_id: UUID):
    require_scope(request, "run")
    job = _visible_job(request, job_id, write=True)
    if not Task.objects.filter(pk=task_id, job=job).exists():
        raise api.NotFound(f"no task {task_id} in job {job_id}")
    return _action(request, job, api.retry_task(task_id, by=username(request)))

