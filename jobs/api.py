"""The public Python API of ACCS for other Django apps.

Every function works inside the caller's transaction: a job exists if and only if the caller
commits, and the NOTIFY that wakes builders and agents is delivered at that commit. Params are
validated against the services' JSON Schemas before anything is written.

    from jobs import api
    job = api.start_workflow("publish", step_params={"render": {"preset": "4k"}}, external_id="hook-42")
    api.emit_event("provider.folder.updated", {"provider_id": "p-1"}, tenant="acme")
    api.cancel(job.id)
    api.raise_condition("live_session", reason="studio is live", by="alice")

Starting: :func:`start_workflow`, :func:`start_service`, :func:`start`, :func:`start_many`,
:func:`validate`. Events: :func:`emit_event`. Acting: :func:`cancel`, :func:`retry`,
:func:`approve`, :func:`reject`, :func:`cancel_task`, :func:`retry_task`, :func:`redrive` (in bulk, by
filter, :class:`RedriveFilter`). Governor:
:func:`raise_condition`, :func:`clear_condition`.

Idempotency: a repeated ``external_id`` (per tenant) returns the existing job, also under
concurrent duplicates (the unique index decides; ``job.was_created`` tells which). A ``dedupe_key``
held by a queued or running job of the tenant raises :class:`JobConflict` naming that job.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import jsonschema_rs
from django.db import connection, transaction
from django.utils import timezone
from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from jobs import admission, transitions
from jobs import redrive as redrive_module
from jobs.definitions import definitions
from jobs.instantiate import InstantiationError, JobRow, ServiceInfo, build_task_rows, steps_for
from jobs.models import JOB_ACTIVE, ApprovalState, Job, JobSource, JobStatus, TaskStatus
from jobs.notify import builder_channel, notify, service_channel
from tenants.models import DEFAULT_TENANT_SLUG, Tenant
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem

ActionResult = transitions.ActionResult
RedriveFilter = redrive_module.RedriveFilter
INT32 = 2**31 - 1


class JobConflict(Exception):
    """Another queued/running job of the tenant holds the dedupe key; ``job_id`` names it."""

    def __init__(self, dedupe_key: str, job_id: UUID) -> None:
        self.dedupe_key = dedupe_key
        self.job_id = job_id
        super().__init__(f"dedupe_key {dedupe_key!r} is held by active job {job_id}")


class NotFound(LookupError):
    """A named workflow, service or tenant does not exist (or is not active)."""


@dataclass
class JobSpec:
    """One job to start; the keyword arguments of :func:`start_workflow` / :func:`start_service`."""

    workflow: str | Workflow | None = None
    service: str | Service | None = None
    version: int | None = None
    params: dict[str, Any] | None = None
    step_params: dict[str, dict[str, Any]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    scheduled_at: datetime | None = None
    tenant: Tenant | str | UUID | None = None
    external_id: str | None = None
    dedupe_key: str | None = None
    correlation_id: str = ""
    source: str = JobSource.MANUAL
    source_ref: str = ""
    created_by: Any = None


# --------------------------------------------------------------------------------------------
# Resolution and validation (nothing written)
# --------------------------------------------------------------------------------------------

def resolve_tenant(tenant: Tenant | str | UUID | None) -> Tenant:
    """Return the tenant given as object, slug or id; None means the default tenant."""
    if isinstance(tenant, Tenant):
        return tenant
    return definitions.get(("tenant", str(tenant) if tenant is not None else None), lambda: _load_tenant(tenant))


def _load_tenant(tenant: str | UUID | None) -> Tenant:
    if tenant is None or tenant == DEFAULT_TENANT_SLUG:
        return Tenant.objects.get_or_create(slug=DEFAULT_TENANT_SLUG, defaults={"name": "Default tenant"})[0]
    try:
        lookup = {"id": UUID(str(tenant))}
    except ValueError:
        lookup = {"slug": str(tenant)}
    found = Tenant.objects.filter(**lookup).first()
    if found is None:
        raise NotFound(f"no tenant {tenant!r}")
    return found


def resolve_workflow(workflow: str | Workflow, version: int | None = None) -> Workflow:
    """Return the workflow object, or by name its given version or latest active version."""
    if isinstance(workflow, Workflow):
        return workflow
    return definitions.get(("workflow", workflow, version), lambda: _load_workflow(workflow, version))


def _load_workflow(workflow: str, version: int | None) -> Workflow:
    qs = Workflow.objects.filter(name=workflow)
    found = qs.filter(version=version).first() if version else qs.filter(is_active=True).order_by("-version").first()
    if found is None:
        raise NotFound(f"no {'version %s of ' % version if version else 'active '}workflow {workflow!r}")
    if not found.is_active and not version:
        raise NotFound(f"workflow {workflow!r} is not active")
    return found


def resolve_service(service: str | Service) -> Service:
    """Return the active service object or the one with this key."""
    if isinstance(service, Service):
        found = service
    else:
        found = definitions.get(("service", service), lambda: Service.objects.filter(key=service).first())
    if found is None:
        raise NotFound(f"no service {service!r}")
    if not found.is_active:
        raise NotFound(f"service {found.key!r} is not active")
    return found


class _Validators:
    """Per-call caches: compiled JSON Schema validators and resolved targets (bulk starts reuse them).

    Params are checked with jsonschema_rs (compiled, fast); only invalid params go through the
    pure-Python jsonschema, whose messages match the ones workflow validation gives.
    """

    def __init__(self) -> None:
        self._fast: dict[int, Any] = {}
        self._slow: dict[int, Draft202012Validator] = {}
        self._resolved: dict[tuple, Any] = {}

    def resolved(self, kind: str, key: Any, resolve, *args) -> Any:
        """Resolve ``key`` once per call (tenant, workflow, service lookups)."""
        cache_key = (kind, key if isinstance(key, (str, UUID, int, type(None))) else id(key), *args)
        if cache_key not in self._resolved:
            self._resolved[cache_key] = resolve(key, *args)
        return self._resolved[cache_key]

    def errors(self, service: Service, params: dict[str, Any]) -> list[str]:
        try:
            fast = self._fast.get(service.id)
            if fast is None:
                fast = self._fast[service.id] = _compiled(service)
            if fast.is_valid(params):
                return []
            slow = self._slow.get(service.id)
            if slow is None:
                slow = self._slow[service.id] = Draft202012Validator(service.params_schema or {})
            return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                    for e in slow.iter_errors(params)]
        except (Unresolvable, RecursionError, LookupError, ValueError, TypeError) as exc:
            # An unresolvable $ref or a pathological schema is the definition's fault, not a crash.
            return [f"(root): service {service.key!r} has a params_schema that cannot be applied: {exc}"[:500]]


_COMPILED: dict[tuple, Any] = {}


def _compiled(service: Service) -> Any:
    """Return the service's compiled params validator, compiled once per version of the service."""
    key = (service.id, service.updated_at)
    fast = _COMPILED.get(key)
    if fast is None:
        if len(_COMPILED) > 1000:
            _COMPILED.clear()
        fast = _COMPILED[key] = jsonschema_rs.validator_for(service.params_schema or {}, retriever=_refuse_remote_ref)
    return fast


def _refuse_remote_ref(uri: str) -> Any:
    """Never fetch a schema's remote ``$ref``: validation must not reach the network."""
    raise ValueError(f"remote $ref {uri!r} is not allowed")


SOURCES = frozenset(JobSource.values)


@dataclass
class _Plan:
    """A validated job ready to insert."""

    spec: JobSpec
    tenant: Tenant
    workflow: Workflow | None
    service: Service | None
    step_params: dict[str, dict[str, Any]]
    approval: str
    services: list[Service]
    priority: int  # the spec's, clamped into the tenant's band


def _plan(spec: JobSpec, validators: _Validators, services_by_key: dict[str, Service]) -> _Plan:
    problems: list[Problem] = []
    if (spec.workflow is None) == (spec.service is None):
        raise DefinitionError([Problem("target", "give exactly one of workflow or service")])
    tenant = validators.resolved("tenant", spec.tenant, resolve_tenant)
    workflow = service = None
    if spec.workflow is not None:
        workflow = validators.resolved("workflow", spec.workflow, resolve_workflow, spec.version)
        if spec.params is not None:
            problems.append(Problem("params", "a workflow job takes step_params={step: {...}}, not params"))
        step_params = dict(spec.step_params or {})
        steps = workflow.steps
    else:
        service = validators.resolved("service", spec.service, resolve_service)
        services_by_key.setdefault(service.key, service)
        if spec.step_params:
            problems.append(Problem("step_params", "a service job takes params={...}"))
        step_params = {service.key: dict(spec.params or {})}
        steps = [{"key": service.key, "service": service.key, "default_params": {}}]
    keys = {s["key"] for s in steps}
    for unknown in sorted(set(step_params) - keys):
        problems.append(Problem(f"step_params.{unknown}", f"no step {unknown!r} in {workflow or service}"))
    involved: list[Service] = []
    for step in steps:
        svc = services_by_key.get(step["service"])
        if svc is None:
            svc = services_by_key[step["service"]] = resolve_service(step["service"])
        involved.append(svc)
        overrides = step_params.get(step["key"]) or {}
        if not isinstance(overrides, dict):
            problems.append(Problem(f"step '{step['key']}'", "params must be an object"))
            continue
        merged = {**step.get("default_params", {}), **overrides}
        for err in validators.errors(svc, merged):
            problems.append(Problem(f"step '{step['key']}' params", err))
    options = spec.options or {}
    if not isinstance(options, dict):
        problems.append(Problem("options", "must be an object"))
    else:
        hosts = options.get("hosts")
        if hosts is not None and (not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts)):
            problems.append(Problem("options.hosts", "must be a list of host names"))
        selector = options.get("host_selector")
        if selector is not None and not isinstance(selector, dict):
            problems.append(Problem("options.host_selector", 'must be an object of labels, e.g. {"rack": "a"}'))
    if spec.source not in SOURCES:
        problems.append(Problem("source", f"must be one of {sorted(SOURCES)}"))
    for name in ("external_id", "dedupe_key"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, str) or not value or len(value) > 200):
            problems.append(Problem(name, "must be a non-empty string of at most 200 characters"))
    for name in ("correlation_id", "source_ref"):
        value = getattr(spec, name)
        if not isinstance(value, str) or len(value) > 200:
            problems.append(Problem(name, "must be a string of at most 200 characters"))
    if not isinstance(spec.priority, int) or isinstance(spec.priority, bool) or not -INT32 <= spec.priority <= INT32:
        problems.append(Problem("priority", f"must be a whole number between {-INT32} and {INT32}"))
    if spec.scheduled_at is not None and (not isinstance(spec.scheduled_at, datetime)
                                          or timezone.is_naive(spec.scheduled_at)):
        problems.append(Problem("scheduled_at", "must be a timezone-aware datetime"))
    if problems:
        raise DefinitionError(problems)
    approval = ApprovalState.PENDING if any(s.requires_approval for s in involved) else ApprovalState.NOT_REQUIRED
    return _Plan(spec, tenant, workflow, service, step_params, approval, involved, tenant.clamp_priority(spec.priority))


# --------------------------------------------------------------------------------------------
# Starting jobs
# --------------------------------------------------------------------------------------------

INSERT_JOBS_SQL = """
-- One JSON document carries the whole batch (cheaper to build and to parse than a dozen arrays).
-- Times come from PostgreSQL's clock; each new job writes its "created" event in the same statement.
WITH ins AS (
INSERT INTO accs_job (id, tenant_id, workflow_id, service_id, status, progress, current_task_key, priority, options,
                      step_params, scheduled_at, error_code, error_message, source, source_ref, external_id,
                      dedupe_key, correlation_id, approval_state, approved_by, created_by_id, created_at, updated_at)
SELECT r.id, r.tenant, r.wf, r.svc, 'queued', 0, '', r.prio, coalesce(r.opts, '{}'), r.sp,
       coalesce(r.sched, now()), '', '', r.src, r.sref, r.ext, r.dk, r.corr, r.appr, '', r.cby, now(), now()
  FROM jsonb_to_recordset(%(rows)s::jsonb)
       AS r(id uuid, tenant uuid, wf uuid, svc bigint, prio int, opts jsonb, sp jsonb, sched timestamptz, src text,
            sref text, ext text, dk text, corr text, appr text, cby int)
-- Idempotency: a duplicate external_id or active dedupe_key inserts nothing; the caller
-- then finds the job that holds it. No exception, so the caller's transaction stays usable.
ON CONFLICT DO NOTHING
RETURNING id, approval_state, source
), ev AS (
INSERT INTO accs_event (job_id, source, level, type, message, data)
SELECT id, 'api:' || source, 'info', 'status',
       CASE WHEN approval_state = 'pending' THEN 'job created queued, waiting for approval' ELSE 'job created queued' END,
       jsonb_build_object('from', 'created', 'to', 'queued', 'approval', approval_state) FROM ins
)
SELECT id FROM ins
"""


def _insert(plans: Sequence[_Plan]) -> set[UUID]:
    rows = []
    for plan in plans:
        spec = plan.spec
        spec._id = jid = uuid.uuid4()  # type: ignore[attr-defined]
        rows.append({
            "id": jid.hex, "tenant": plan.tenant.id.hex, "wf": plan.workflow.id.hex if plan.workflow else None,
            "svc": plan.service.id if plan.service else None, "prio": plan.priority, "opts": spec.options or None,
            "sp": plan.step_params, "sched": spec.scheduled_at.isoformat() if spec.scheduled_at else None,
            "src": str(spec.source), "sref": spec.source_ref, "ext": spec.external_id, "dk": spec.dedupe_key,
            "corr": spec.correlation_id, "appr": str(plan.approval),
            "cby": getattr(spec.created_by, "pk", spec.created_by),
        })
    with connection.cursor() as cur:
        cur.execute(INSERT_JOBS_SQL, {"rows": json.dumps(rows, default=str)})
        return {r[0] for r in cur.fetchall()}


def _existing_for(plan: _Plan) -> UUID | None:
    """Return the job that made an insert conflict, or raise JobConflict for an active dedupe key.

    None means the conflicting job is gone already (its transaction rolled back, or it finished and
    freed the dedupe key): the caller inserts again.
    """
    spec = plan.spec
    if spec.external_id is not None:
        found = Job.objects.filter(tenant=plan.tenant, external_id=spec.external_id).values_list("id", flat=True).first()
        if found:
            return found
    if spec.dedupe_key is not None:
        holder = (Job.objects.filter(tenant=plan.tenant, dedupe_key=spec.dedupe_key, status__in=JOB_ACTIVE)
                  .values_list("id", flat=True).first())
        if holder:
            raise JobConflict(spec.dedupe_key, holder)
    return None


INSERT_ATTEMPTS = 3


def _runs_now(plan: _Plan, now: datetime) -> bool:
    """True when the job can be instantiated in the caller's transaction without the builder."""
    return (
        plan.approval != ApprovalState.PENDING
        and (plan.spec.scheduled_at is None or plan.spec.scheduled_at <= now)
        and not (plan.workflow and plan.workflow.max_active_jobs)
        and not plan.tenant.max_in_flight
    )


def _start_now(plan: _Plan) -> Job | None:
    """Start a job that runs now in one statement; None when the general path must decide.

    Taken for a job that is due, needs no approval, has no cap and no fan-out step. None also
    when its external_id or dedupe_key is taken (nothing was written then).
    """
    spec = plan.spec
    steps = plan.workflow.steps if plan.workflow else None
    if steps and any(step.get("fan_out") for step in steps):
        return None
    services = {s.key: ServiceInfo(s.id, s.key, s.base_priority, s.max_attempts, s.timeout_seconds,
                                   s.exclusive_per_host) for s in plan.services if s.is_active}
    jid = uuid.uuid4()
    row = JobRow(jid, plan.tenant.id, plan.workflow.id if plan.workflow else None,
                 plan.service.id if plan.service else None, plan.priority, 0, spec.options or {}, plan.step_params)
    try:
        tasks = build_task_rows(row, steps_for(row, steps, plan.service.key if plan.service else None), services,
                                hosts=[], blocked=set())
    except InstantiationError:
        return None  # the general path fails the job with the reason
    for task in tasks:
        task["id"] = task["id"].hex
    channels = {service_channel(key) for key in services if any(
        t["status"] == TaskStatus.QUEUED and t["service_id"] == services[key].id for t in tasks)}
    created_by = getattr(spec.created_by, "pk", spec.created_by)
    inserted = admission.insert_and_start(
        job={"id": jid, "tenant": plan.tenant.id, "wf": row.workflow_id, "svc": row.service_id, "prio": plan.priority,
             "opts": json.dumps(spec.options or {}), "sp": json.dumps(plan.step_params), "sched": spec.scheduled_at,
             "src": str(spec.source), "sref": spec.source_ref, "ext": spec.external_id, "dk": spec.dedupe_key,
             "corr": spec.correlation_id, "cby": created_by},
        tasks=tasks, channels=sorted(channels), source=f"api:{spec.source}", event_source=f"api:{spec.source}")
    if inserted is None:
        return None
    jid, order_seq, created_at, scheduled_at = inserted[:4]
    job = Job(id=jid, tenant=plan.tenant, workflow=plan.workflow, service=plan.service, status=JobStatus.WAITING,
              progress=0.0, current_task_key=min(tasks, key=lambda r: r["position"])["task_key"],
              priority=plan.priority, order_seq=order_seq, options=spec.options or {}, step_params=plan.step_params,
              scheduled_at=scheduled_at, source=spec.source, source_ref=spec.source_ref, external_id=spec.external_id,
              dedupe_key=spec.dedupe_key, correlation_id=spec.correlation_id,
              approval_state=ApprovalState.NOT_REQUIRED, created_by_id=created_by, created_at=created_at,
              started_at=created_at, updated_at=created_at)
    job._state.adding = False
    job._state.db = "default"
    job.was_created = True
    return job


def validate(spec: JobSpec) -> None:
    """Check a job spec as :func:`start` would, writing nothing; raise DefinitionError or NotFound."""
    _plan(spec, _Validators(), {})


def start(spec: JobSpec) -> Job:
    """Start one job (see :func:`start_workflow`); ``job.was_created`` tells a new job from a repeat."""
    now = timezone.now()
    plan = _plan(spec, _Validators(), {})
    if spec.scheduled_at is None and _runs_now(plan, now):
        # Due now by PostgreSQL's clock (no scheduled time given). One statement, atomic on its own:
        # no savepoint or transaction of ours is needed.
        job = _start_now(plan)
        if job is not None:
            return job
    with transaction.atomic():
        for _ in range(INSERT_ATTEMPTS):
            inserted = _insert([plan])
            jid = plan.spec._id  # type: ignore[attr-defined]
            if jid in inserted:
                break
            existing = _existing_for(plan)
            if existing is not None:
                job = Job.objects.get(pk=existing)
                job.was_created = False
                return job
        else:  # pragma: no cover - needs a conflicting job to vanish three times in a row
            raise RuntimeError("job insert kept conflicting with jobs that disappeared; try again")
        if _runs_now(plan, now):
            transitions.start_jobs([jid], source=f"api:{spec.source}")
        else:
            with connection.cursor() as cur:
                notify(cur, [builder_channel()])
        job = Job.objects.get(pk=jid)
        job.was_created = True
        return job


def start_workflow(workflow: str | Workflow, *, version: int | None = None, **options: Any) -> Job:
    """Start a job of a workflow: by name its latest active version, or ``version``.

    Keyword options: step_params, options (hosts / host_selector for fan-out), priority,
    scheduled_at, tenant, external_id, dedupe_key, correlation_id, source, source_ref, created_by.
    Raises DefinitionError (invalid params), NotFound, JobConflict (dedupe key held).
    """
    return start(JobSpec(workflow=workflow, version=version, **options))


def start_service(service: str | Service, *, params: dict[str, Any] | None = None, **options: Any) -> Job:
    """Start a one-task job that runs ``service`` with ``params``."""
    return start(JobSpec(service=service, params=params, **options))


def start_many(specs: Iterable[JobSpec], *, batch_size: int = 5000) -> list[UUID]:
    """Start many jobs at once (bulk): validated first, inserted set-based, instantiated by the builder.

    Returns the job ids in input order; a spec whose external_id already exists yields the
    existing job's id. Raises JobConflict when a dedupe key is held, DefinitionError when any spec
    is invalid (then nothing is written).
    """
    validators, services = _Validators(), {}
    plans = [_plan(s, validators, services) for s in specs]
    out: list[UUID] = []
    # A savepoint (one per call, not per job): on JobConflict nothing of this call remains and the
    # caller's own transaction stays usable, as with start().
    with transaction.atomic():
        for start_at in range(0, len(plans), batch_size):
            chunk = plans[start_at:start_at + batch_size]
            inserted = _insert(chunk)
            for plan in chunk:
                jid = plan.spec._id  # type: ignore[attr-defined]
                if jid in inserted:
                    out.append(jid)
                    continue
                existing = _existing_for(plan)
                for _ in range(INSERT_ATTEMPTS - 1):
                    if existing is not None:
                        break
                    if _insert([plan]):
                        existing = plan.spec._id  # type: ignore[attr-defined]
                    else:
                        existing = _existing_for(plan)
                if existing is None:  # pragma: no cover - see start()
                    raise RuntimeError("job insert kept conflicting with jobs that disappeared; try again")
                out.append(existing)
        with connection.cursor() as cur:
            notify(cur, [builder_channel()])
    return out


# --------------------------------------------------------------------------------------------
# Acting on jobs (transitions; each returns ActionResult)
# --------------------------------------------------------------------------------------------

def cancel(job_id: UUID, *, by: str = "") -> ActionResult:
    """Cancel a job: unstarted tasks are canceled, running ones stop at their next heartbeat."""
    return transitions.cancel_job(job_id, by=by)


def retry(job_id: UUID, *, by: str = "") -> ActionResult:
    """Retry a failed or canceled job, attempts reset."""
    return transitions.retry_job(job_id, by=by)


def approve(job_id: UUID, *, by: str = "") -> ActionResult:
    """Approve a job waiting for approval."""
    return transitions.approve(job_id, by=by)


def reject(job_id: UUID, *, by: str = "", reason: str = "") -> ActionResult:
    """Reject a job waiting for approval; it is canceled."""
    return transitions.reject(job_id, by=by, reason=reason)


def cancel_task(task_id: UUID, *, by: str = "") -> ActionResult:
    """Cancel one task: unstarted → canceled, held → the agent stops it at its next heartbeat."""
    return transitions.cancel_task(task_id, by=by)


def retry_task(task_id: UUID, *, by: str = "") -> ActionResult:
    """Put one failed, skipped, canceled or blocked task back to queued, attempts reset."""
    return transitions.retry_task(task_id, by=by)


def redrive(flt: redrive_module.RedriveFilter, *, by: str = "", dry_run: bool = False, batch: int = 500,
            limit: int | None = None) -> redrive_module.RedriveResult:
    """Retry every dead-lettered task (or, with ``flt.jobs``, failed job) matching ``flt``, in batches.

    With ``dry_run`` only count them (``matched``), writing nothing. Each batch commits on its
    own, so call it outside a transaction of yours. See :mod:`jobs.redrive`.
    """
    if dry_run:
        return redrive_module.dry_run(flt, limit=limit)
    return redrive_module.redrive(flt, by=by, batch=batch, limit=limit)


# --------------------------------------------------------------------------------------------
# Application events and governor conditions
# --------------------------------------------------------------------------------------------

def emit_event(name: str, context: dict[str, Any] | None = None, *, tenant: Tenant | str | UUID | None = None,
               correlation_id: str = "", source: str = "app"):
    """Record an application event and start the jobs of the tenant's matching event triggers.

    Runs in the caller's transaction: the event and its jobs exist iff the caller commits. A
    trigger that cannot fire (a template value missing from ``context``, invalid params) records
    its error on the trigger and the timeline and starts nothing; the others still fire. Return a
    :class:`jobs.triggers.EmitResult` (``jobs``, ``deduplicated``, ``errors``).
    """
    from jobs import triggers

    return triggers.fire_event(name, context, tenant=resolve_tenant(tenant), correlation_id=correlation_id,
                               source=source)


def raise_condition(name: str, *, reason: str, expires_at: datetime | None = None, by: str):
    """Raise (or re-arm) a governor condition until ``expires_at`` or until cleared, with an event."""
    from workflows import governor

    return governor.raise_condition(name, reason=reason, expires_at=expires_at, by=by)


def clear_condition(name: str, by: str = "") -> bool:
    """Clear a governor condition; False when it does not hold."""
    from workflows import governor

    return governor.clear_condition(name, by)
