"""The public Python API of ACCS for other Django apps (CTL1).

Every function works inside the caller's transaction: a job exists if and only if the caller
commits, and the NOTIFY that wakes builders and agents is delivered at that commit. Params are
validated against the services' JSON Schemas before anything is written.

    from jobs import api
    job = api.start_workflow("publish", step_params={"render": {"preset": "4k"}}, external_id="hook-42")
    api.cancel(job.id)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import connection, transaction
from django.utils import timezone
from jsonschema import Draft202012Validator

from jobs import transitions
from jobs.models import ApprovalState, Job, JobSource, Tenant, DEFAULT_TENANT_SLUG
from jobs.notify import builder_channel, notify
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem

ActionResult = transitions.ActionResult


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
    qs = Workflow.objects.filter(name=workflow)
    found = qs.filter(version=version).first() if version else qs.filter(is_active=True).order_by("-version").first()
    if found is None:
        raise NotFound(f"no {'version %s of ' % version if version else 'active '}workflow {workflow!r}")
    if not found.is_active and not version:
        raise NotFound(f"workflow {workflow!r} is not active")
    return found


def resolve_service(service: str | Service) -> Service:
    """Return the active service object or the one with this key."""
    found = service if isinstance(service, Service) else Service.objects.filter(key=service).first()
    if found is None:
        raise NotFound(f"no service {service!r}")
    if not found.is_active:
        raise NotFound(f"service {found.key!r} is not active")
    return found


class _Validators:
    """Per-call caches: compiled JSON Schema validators and resolved targets (bulk starts reuse them)."""

    def __init__(self) -> None:
        self._cache: dict[int, Draft202012Validator] = {}
        self._resolved: dict[tuple, Any] = {}

    def resolved(self, kind: str, key: Any, resolve, *args) -> Any:
        """Resolve ``key`` once per call (tenant, workflow, service lookups)."""
        cache_key = (kind, key if isinstance(key, (str, UUID, int, type(None))) else id(key), *args)
        if cache_key not in self._resolved:
            self._resolved[cache_key] = resolve(key, *args)
        return self._resolved[cache_key]

    def errors(self, service: Service, params: dict[str, Any]) -> list[str]:
        validator = self._cache.get(service.id)
        if validator is None:
            validator = self._cache[service.id] = Draft202012Validator(service.params_schema or {})
        return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(params)]


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
    if spec.source not in JobSource.values:
        problems.append(Problem("source", f"must be one of {JobSource.values}"))
    for name in ("external_id", "dedupe_key"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, str) or not value or len(value) > 200):
            problems.append(Problem(name, "must be a non-empty string of at most 200 characters"))
    if problems:
        raise DefinitionError(problems)
    approval = ApprovalState.PENDING if any(s.requires_approval for s in involved) else ApprovalState.NOT_REQUIRED
    return _Plan(spec, tenant, workflow, service, step_params, approval, involved)


# --------------------------------------------------------------------------------------------
# Starting jobs
# --------------------------------------------------------------------------------------------

INSERT_JOBS_SQL = """
INSERT INTO accs_job (id, tenant_id, workflow_id, service_id, status, progress, current_task_key, priority, options,
                      step_params, scheduled_at, error_code, error_message, source, source_ref, external_id,
                      dedupe_key, correlation_id, approval_state, approved_by, created_by_id, created_at, updated_at)
SELECT id, tenant, wf, svc, 'queued', 0, '', prio, opts::jsonb, sp::jsonb, coalesce(sched, %(now)s), '', '', src,
       sref, ext, dk, corr, appr, '', cby, %(now)s, %(now)s
  FROM unnest(%(id)s::uuid[], %(tenant)s::uuid[], %(wf)s::uuid[], %(svc)s::bigint[], %(prio)s::int[],
              %(opts)s::text[], %(sp)s::text[], %(sched)s::timestamptz[], %(src)s::text[], %(sref)s::text[],
              %(ext)s::text[], %(dk)s::text[], %(corr)s::text[], %(appr)s::text[], %(cby)s::int[])
       AS v(id, tenant, wf, svc, prio, opts, sp, sched, src, sref, ext, dk, corr, appr, cby)
-- Idempotency (CTL2): a duplicate external_id or active dedupe_key inserts nothing; the caller
-- then finds the job that holds it. No exception, so the caller's transaction stays usable.
ON CONFLICT DO NOTHING
RETURNING id
"""


def _insert(plans: Sequence[_Plan], now: datetime) -> set[UUID]:
    ids = [uuid.uuid4() for _ in plans]
    for plan, jid in zip(plans, ids):
        plan.spec._id = jid  # type: ignore[attr-defined]
    params = {
        "now": now, "id": ids,
        "tenant": [p.tenant.id for p in plans],
        "wf": [p.workflow.id if p.workflow else None for p in plans],
        "svc": [p.service.id if p.service else None for p in plans],
        "prio": [p.spec.priority for p in plans],
        "opts": [json.dumps(p.spec.options or {}) for p in plans],
        "sp": [json.dumps(p.step_params) for p in plans],
        "sched": [p.spec.scheduled_at for p in plans],
        "src": [str(p.spec.source) for p in plans],
        "sref": [p.spec.source_ref for p in plans],
        "ext": [p.spec.external_id for p in plans],
        "dk": [p.spec.dedupe_key for p in plans],
        "corr": [p.spec.correlation_id for p in plans],
        "appr": [str(p.approval) for p in plans],
        "cby": [getattr(p.spec.created_by, "pk", p.spec.created_by) for p in plans],
    }
    with connection.cursor() as cur:
        cur.execute(INSERT_JOBS_SQL, params)
        return {r[0] for r in cur.fetchall()}


def _existing_for(plan: _Plan) -> UUID:
    """Return the job that made an insert conflict, or raise JobConflict for an active dedupe key."""
    spec = plan.spec
    if spec.external_id is not None:
        found = Job.objects.filter(tenant=plan.tenant, external_id=spec.external_id).values_list("id", flat=True).first()
        if found:
            return found
    if spec.dedupe_key is not None:
        holder = (Job.objects.filter(tenant=plan.tenant, dedupe_key=spec.dedupe_key, status__in=["queued", "running"])
                  .values_list("id", flat=True).first())
        if holder:
            raise JobConflict(spec.dedupe_key, holder)
    raise RuntimeError("job insert conflicted but no conflicting job was found")  # pragma: no cover


def _runs_now(plan: _Plan, now: datetime) -> bool:
    """True when the job can be instantiated in the caller's transaction without the builder."""
    return (
        plan.approval != ApprovalState.PENDING
        and (plan.spec.scheduled_at is None or plan.spec.scheduled_at <= now)
        and not (plan.workflow and plan.workflow.max_active_jobs)
        and not plan.tenant.max_in_flight
    )


def start(spec: JobSpec) -> Job:
    """Start one job (see :func:`start_workflow`); ``job.was_created`` tells a new job from a repeat."""
    now = timezone.now()
    plan = _plan(spec, _Validators(), {})
    with transaction.atomic():
        inserted = _insert([plan], now)
        jid = plan.spec._id  # type: ignore[attr-defined]
        if jid not in inserted:
            job = Job.objects.get(pk=_existing_for(plan))
            job.was_created = False
            return job
        if _runs_now(plan, now):
            transitions.start_jobs([jid], now=now, source=f"api:{spec.source}")
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
    """Start a one-task job that runs ``service`` with ``params`` (WF3)."""
    return start(JobSpec(service=service, params=params, **options))


def start_many(specs: Iterable[JobSpec], *, batch_size: int = 5000) -> list[UUID]:
    """Start many jobs at once (bulk): validated first, inserted set-based, instantiated by the builder.

    Returns the job ids in input order; a spec whose external_id already exists yields the
    existing job's id. Raises JobConflict when a dedupe key is held, DefinitionError when any spec
    is invalid (then nothing is written).
    """
    now = timezone.now()
    validators, services = _Validators(), {}
    plans = [_plan(s, validators, services) for s in specs]
    out: list[UUID] = []
    with transaction.atomic():
        for start_at in range(0, len(plans), batch_size):
            chunk = plans[start_at:start_at + batch_size]
            inserted = _insert(chunk, now)
            for plan in chunk:
                jid = plan.spec._id  # type: ignore[attr-defined]
                out.append(jid if jid in inserted else _existing_for(plan))
        with connection.cursor() as cur:
            notify(cur, [builder_channel()])
    return out


# --------------------------------------------------------------------------------------------
# Acting on jobs (transitions; each returns ActionResult)
# --------------------------------------------------------------------------------------------

def cancel(job_id: UUID, *, by: str = "") -> ActionResult:
    """Cancel a job (JOB5)."""
    return transitions.cancel_job(job_id, by=by)


def retry(job_id: UUID, *, by: str = "") -> ActionResult:
    """Retry a failed or canceled job, attempts reset (JOB5)."""
    return transitions.retry_job(job_id, by=by)


def approve(job_id: UUID, *, by: str = "") -> ActionResult:
    """Approve a job waiting for approval (CTL3)."""
    return transitions.approve(job_id, by=by)


def reject(job_id: UUID, *, by: str = "", reason: str = "") -> ActionResult:
    """Reject a job waiting for approval; it is canceled (CTL3)."""
    return transitions.reject(job_id, by=by, reason=reason)
