"""HTTP endpoints for services and workflows under /api/v1/.

Superusers only: services and workflows are global, not per tenant. Saving runs the same
validation as the admin and :mod:`workflows.api`; a 422 lists every problem, naming its field or step.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from django.db import transaction
from django.http import HttpRequest
from ninja import Field, Path, Query, Router, Schema, Status
from ninja.errors import HttpError
from pydantic import StrictBool

from accs_site.http import INT32, In, require_scope, require_superuser, responses
from workflows.api import create_workflow, redacted_steps, save_service, steps_frozen_reason, steps_keeping_secrets
from workflows.models import Executor, Service, Workflow
from workflows.validation import DefinitionError, Problem, validate_workflow

router = Router(tags=["services and workflows"])

SLUG = r"^[-a-zA-Z0-9_]+$"
MAX_SECONDS = 10**9


class ServiceFields(In):
    """Every editable field of a service; see the admin for the meaning of each."""

    description: str = Field("", max_length=10_000)
    executor: Executor = Executor.COMMAND
    executor_config: dict[str, Any] = Field(default_factory=dict)
    params_schema: dict[str, Any] = Field(default_factory=dict)
    timeout_seconds: int = Field(600, ge=1, le=INT32)
    max_attempts: int = Field(3, ge=1, le=32767)
    backoff_base_seconds: float | None = Field(None, ge=0, le=MAX_SECONDS)
    backoff_cap_seconds: float = Field(3600.0, ge=0, le=MAX_SECONDS)
    lease_seconds: int | None = Field(None, ge=3, le=INT32, description="Empty: the site's ACC_HEARTBEAT_TTL_SEC.")
    cpu_weight: int = Field(1, ge=1, le=5)
    max_concurrent: int = Field(0, ge=0, le=INT32)
    base_priority: int = Field(0, ge=-INT32, le=INT32)
    requires_approval: bool = False
    exclusive_per_host: bool = False
    quarantine_host_on_final_failure: bool = False
    block_during: list[str] = Field(default_factory=list, max_length=100)
    priority_adjust_during: dict[str, int] = Field(default_factory=dict)
    required_labels: dict[str, str] = Field(default_factory=dict)
    rate_limit: int = Field(0, ge=0, le=INT32)
    rate_period_seconds: int = Field(60, ge=1, le=INT32)
    rate_key: str = Field("", max_length=200)
    rate_key_limit: int = Field(0, ge=0, le=INT32)
    concurrency_key: str = Field("", max_length=200)
    concurrency_key_limit: int = Field(0, ge=0, le=INT32)
    is_active: bool = True


class ServiceIn(ServiceFields):
    key: str = Field(min_length=1, max_length=100, pattern=SLUG)


class ServicePatch(In):
    description: str | None = Field(None, max_length=10_000)
    executor: Executor | None = None
    executor_config: dict[str, Any] | None = None
    params_schema: dict[str, Any] | None = None
    timeout_seconds: int | None = Field(None, ge=1, le=INT32)
    max_attempts: int | None = Field(None, ge=1, le=32767)
    backoff_base_seconds: float | None = Field(None, ge=0, le=MAX_SECONDS)
    backoff_cap_seconds: float | None = Field(None, ge=0, le=MAX_SECONDS)
    lease_seconds: int | None = Field(None, ge=3, le=INT32)
    cpu_weight: int | None = Field(None, ge=1, le=5)
    max_concurrent: int | None = Field(None, ge=0, le=INT32)
    base_priority: int | None = Field(None, ge=-INT32, le=INT32)
    requires_approval: bool | None = None
    exclusive_per_host: bool | None = None
    quarantine_host_on_final_failure: bool | None = None
    block_during: list[str] | None = Field(None, max_length=100)
    priority_adjust_during: dict[str, int] | None = None
    required_labels: dict[str, str] | None = None
    rate_limit: int | None = Field(None, ge=0, le=INT32)
    rate_period_seconds: int | None = Field(None, ge=1, le=INT32)
    rate_key: str | None = Field(None, max_length=200)
    rate_key_limit: int | None = Field(None, ge=0, le=INT32)
    concurrency_key: str | None = Field(None, max_length=200)
    concurrency_key_limit: int | None = Field(None, ge=0, le=INT32)
    is_active: bool | None = None


class ServiceOut(Schema):
    id: int
    key: str
    description: str
    executor: str
    executor_config: dict[str, Any]
    params_schema: dict[str, Any]
    timeout_seconds: int
    max_attempts: int
    backoff_base_seconds: float | None
    backoff_cap_seconds: float
    lease_seconds: int | None
    cpu_weight: int
    max_concurrent: int
    base_priority: int
    requires_approval: bool
    exclusive_per_host: bool
    quarantine_host_on_final_failure: bool
    block_during: list[str]
    priority_adjust_during: dict[str, Any]
    required_labels: dict[str, Any]
    rate_limit: int
    rate_period_seconds: int
    rate_key: str
    rate_key_limit: int
    concurrency_key: str
    concurrency_key_limit: int
    is_active: bool
    created_at: datetime
    updated_at: datetime


class StepIn(In):
    key: str = Field(min_length=1, max_length=100)
    service: str = Field(min_length=1, max_length=100)
    depends_on: list[str] = Field(default_factory=list)
    default_params: dict[str, Any] = Field(default_factory=dict)
    # "hosts", or {"over": "<jsonpath to a list in a parent's output>"}: the validator checks the object.
    fan_out: Literal["hosts"] | dict[str, str] | None = None
    on_failure: Literal["fail_job", "continue"] | None = None
    always: StrictBool | None = None
    # What the step's output must meet, and the condition over its parents' outputs under which it runs
    # (docs/workflows-as-code.md); the validator checks both.
    output_schema: dict[str, Any] | None = None
    when: str | None = Field(None, max_length=2000)


class WorkflowIn(In):
    """A workflow version; ``version`` defaults to the next free number for ``name``."""

    name: str = Field(min_length=1, max_length=100, pattern=SLUG)
    version: int | None = Field(None, ge=1, le=INT32)
    description: str = Field("", max_length=10_000)
    is_active: bool = True
    max_active_jobs: int = Field(0, ge=0, le=INT32)
    steps: list[StepIn] = Field(min_length=1, max_length=1000)


class WorkflowPatch(In):
    description: str | None = Field(None, max_length=10_000)
    is_active: bool | None = None
    max_active_jobs: int | None = Field(None, ge=0, le=INT32)
    steps: list[StepIn] | None = Field(None, min_length=1, max_length=1000,
                                       description="Only while no job uses this version; else POST a new version.")


class WorkflowOut(Schema):
    id: UUID
    name: str
    version: int
    description: str
    is_active: bool
    max_active_jobs: int
    steps: list[dict[str, Any]]
    created_at: datetime
    updated_at: datetime

    @staticmethod
    def resolve_steps(obj: Workflow) -> Any:
        """Secret-named default params answer ``***``; a PATCH or POST sending ``***`` back keeps them."""
        return redacted_steps(obj.steps)


class ListFilter(In):
    name: str | None = Field(None, max_length=100)
    is_active: bool | None = None
    limit: int = Field(200, ge=1, le=1000)
    offset: int = Field(0, ge=0, le=1_000_000)


def _steps(steps: list[StepIn]) -> list[dict[str, Any]]:
    return [s.model_dump(exclude_none=True) for s in steps]


def _in_code_refusal(row: Service | Workflow | None, what: str) -> Status | None:
    """A 409 naming the file that defines ``row``, when code defines it (``manage.py accs_sync`` owns it)."""
    if row is None or not row.defined_in:
        return None
    return Status(409, {"detail": f"{what} is defined in code ({row.defined_in}): change it there and run "
                                  "manage.py accs_sync"})


def _service(key: str) -> Service:
    found = Service.objects.filter(key=key).first()
    if found is None:
        raise HttpError(404, f"no service {key!r}")
    return found


def _workflow(name: str, version: int) -> Workflow:
    found = Workflow.objects.filter(name=name, version=version).first()
    if found is None:
        raise HttpError(404, f"no workflow {name!r} version {version}")
    return found


# --------------------------------------------------------------------------------------------
# Services
# --------------------------------------------------------------------------------------------

@router.get("/services", response=responses({200: list[ServiceOut]}), summary="List services")
def list_services(request: HttpRequest, filters: Query[ListFilter]):
    require_scope(request, "read")
    require_superuser(request)
    qs = Service.objects.order_by("key")
    if filters.name:
        qs = qs.filter(key=filters.name)
    if filters.is_active is not None:
        qs = qs.filter(is_active=filters.is_active)
    return list(qs[filters.offset:filters.offset + filters.limit])


@router.post("/services", response=responses({201: ServiceOut}), summary="Create a service")
def create_service(request: HttpRequest, body: ServiceIn):
    require_scope(request, "definitions")
    require_superuser(request)
    if Service.objects.filter(key=body.key).exists():
        return Status(409, {"detail": f"service {body.key!r} exists; PATCH /services/{body.key} changes it"})
    with transaction.atomic():
        return Status(201, save_service(**body.model_dump()))


@router.get("/services/{key}", response=responses({200: ServiceOut}), summary="Get a service")
def get_service(request: HttpRequest, key: str = Path(..., min_length=1, max_length=100, pattern=SLUG)):
    require_scope(request, "read")
    require_superuser(request)
    return _service(key)


# Fields whose null means "the site's default".
NULLABLE = ("backoff_base_seconds", "lease_seconds")


@router.patch("/services/{key}", response=responses({200: ServiceOut}), summary="Change a service")
def update_service(request: HttpRequest, body: ServicePatch,
                   key: str = Path(..., min_length=1, max_length=100, pattern=SLUG)):
    """Send only the fields to change; the whole service is validated again before saving."""
    require_scope(request, "definitions")
    require_superuser(request)
    if refusal := _in_code_refusal(_service(key), f"service {key!r}"):
        return refusal
    changes = body.model_dump(exclude_unset=True)
    nulls = sorted(name for name, value in changes.items() if value is None and name not in NULLABLE)
    if nulls:
        raise DefinitionError([Problem(name, "cannot be null") for name in nulls])
    with transaction.atomic():
        return save_service(key=key, **changes)


# --------------------------------------------------------------------------------------------
# Workflows
# --------------------------------------------------------------------------------------------

@router.get("/workflows", response=responses({200: list[WorkflowOut]}), summary="List workflows")
def list_workflows(request: HttpRequest, filters: Query[ListFilter]):
    require_scope(request, "read")
    require_superuser(request)
    qs = Workflow.objects.order_by("name", "-version")
    if filters.name:
        qs = qs.filter(name=filters.name)
    if filters.is_active is not None:
        qs = qs.filter(is_active=filters.is_active)
    return list(qs[filters.offset:filters.offset + filters.limit])


@router.post("/workflows", response=responses({201: WorkflowOut}), summary="Create a workflow version")
def create_workflow_version(request: HttpRequest, body: WorkflowIn):
    """Validated as a whole (unique keys, known services, deps, no cycles, params); nothing is saved on error."""
    require_scope(request, "definitions")
    require_superuser(request)
    latest = Workflow.objects.filter(name=body.name).order_by("-version").first()
    if refusal := _in_code_refusal(latest, f"workflow {body.name!r}"):
        return refusal
    workflow = create_workflow(name=body.name, version=body.version,
                               steps=steps_keeping_secrets(_steps(body.steps), name=body.name),
                               description=body.description, max_active_jobs=body.max_active_jobs,
                               is_active=body.is_active)
    return Status(201, workflow)


@router.get("/workflows/{name}/{version}", response=responses({200: WorkflowOut}), summary="Get a workflow version")
def get_workflow(request: HttpRequest, name: str = Path(..., min_length=1, max_length=100, pattern=SLUG),
                 version: int = Path(..., ge=1, le=INT32)):
    require_scope(request, "read")
    require_superuser(request)
    return _workflow(name, version)


@router.patch("/workflows/{name}/{version}", response=responses({200: WorkflowOut}),
              summary="Change a workflow version")
def update_workflow(request: HttpRequest, body: WorkflowPatch,
                    name: str = Path(..., min_length=1, max_length=100, pattern=SLUG),
                    version: int = Path(..., ge=1, le=INT32)):
    """Activate/deactivate, describe, cap; steps change only while no job uses the version."""
    require_scope(request, "definitions")
    require_superuser(request)
    changes = body.model_dump(exclude_unset=True)
    nulls = sorted(n for n, v in changes.items() if v is None)
    if nulls:
        raise DefinitionError([Problem(n, "cannot be null") for n in nulls])
    with transaction.atomic():
        workflow = Workflow.objects.select_for_update().filter(name=name, version=version).first()
        if workflow is None:
            raise HttpError(404, f"no workflow {name!r} version {version}")
        if refusal := _in_code_refusal(workflow, f"workflow {name!r} version {version}"):
            return refusal
        if "steps" in changes:
            if reason := steps_frozen_reason(workflow):
                return Status(409, {"detail": f"{reason}; POST /workflows with the new steps to create the next "
                                              "version"})
            workflow.steps = steps_keeping_secrets(_steps(body.steps or []), name=name, stored=workflow.steps)
        for field in ("description", "is_active", "max_active_jobs"):
            if field in changes:
                setattr(workflow, field, changes[field])
        validate_workflow(workflow)
        workflow.save()
        return workflow
