"""Public Python functions to define services and workflows; validation runs before any write."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Max

from accs_site.redaction import keep_secrets, redact_params
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem, service_problems, step_problems, validate_workflow

SERVICE_FIELDS = ({f.name for f in Service._meta.get_fields() if getattr(f, "concrete", False)}
                  - {"id", "created_at", "updated_at"})


def _service_from_dict(data: dict[str, Any]) -> Service:
    unknown = sorted(set(data) - SERVICE_FIELDS)
    if unknown:
        raise DefinitionError([Problem(f"service {data.get('key')!r}", f"unknown fields {unknown}")])
    existing = Service.objects.filter(key=data.get("key")).first()
    service = existing or Service()
    for name, value in data.items():
        setattr(service, name, value)
    return service


def save_service(**fields: Any) -> Service:
    """Create or update a service by ``key`` after validating it."""
    service = _service_from_dict(fields)
    problems = service_problems(service)
    if problems:
        raise DefinitionError(problems)
    service.save()
    return service


def create_workflow(*, name: str, steps: list[dict[str, Any]], version: int | None = None,
                    description: str = "", max_active_jobs: int = 0, is_active: bool = True) -> Workflow:
    """Validate and save a workflow; ``version`` defaults to the next free number for ``name``."""
    with transaction.atomic():
        if version is None:
            version = next_version(name)
        workflow = Workflow(name=name, version=version, steps=steps, description=description,
                            max_active_jobs=max_active_jobs, is_active=is_active)
        validate_workflow(workflow)  # raises DefinitionError naming each problem
        if Workflow.objects.filter(name=name, version=version).exists():
            raise DefinitionError([Problem("version", f"workflow {name!r} already has version {version}")])
        workflow.save()
        return workflow


def steps_frozen_reason(workflow: Workflow) -> str | None:
    """Return why this stored version's steps may not change in place (jobs use it), or None.

    A job records the version it ran, so changing that version's steps would rewrite what the
    job claims to have run; a changed definition is the next version instead. Call it inside the
    transaction that saves, after locking the workflow row FOR UPDATE: inserting a job takes a
    key-share lock on that row, so no job can start using the version between check and save.
    """
    if workflow.pk is None or not workflow.jobs.exists():
        return None
    return f"workflow {workflow.name!r} version {workflow.version} has jobs"


def next_version(name: str) -> int:
    """Return the next free version number of the workflow ``name`` (1 for a new name)."""
    return (Workflow.objects.filter(name=name).aggregate(v=Max("version"))["v"] or 0) + 1


def import_definitions(data: dict[str, Any]) -> tuple[list[Service], list[Workflow]]:
    """Load ``{"services": [...], "workflows": [...]}`` in one transaction, all or nothing.

    Services are validated first; workflows are validated against the services being imported
    plus those already stored. Nothing is written unless everything is valid.
    """
    problems: list[Problem] = []
    services = [_service_from_dict(dict(s)) for s in data.get("services", [])]
    for service in services:
        problems += [Problem(f"service '{service.key}' {p.where}", p.message) for p in service_problems(service)]
    known = {s.key: s for s in Service.objects.all()}
    known.update({s.key: s for s in services})
    workflows: list[Workflow] = []
    for spec in data.get("workflows", []):
        name, version = spec.get("name"), spec.get("version", 1)
        workflow = Workflow.objects.filter(name=name, version=version).first() or Workflow(name=name, version=version)
        workflow.steps = spec.get("steps")
        workflow.description = spec.get("description", "")
        workflow.max_active_jobs = spec.get("max_active_jobs", 0)
        problems += [Problem(f"workflow '{name}' v{version} {p.where}", p.message)
                     for p in step_problems(workflow.steps, known)]
        workflows.append(workflow)
    if problems:
        raise DefinitionError(problems)
    with transaction.atomic():
        for service in services:
            service.save()
        for workflow in workflows:
            workflow.save()
    return services, workflows


def redacted_steps(steps: Any) -> Any:
    """Return a copy of a workflow's steps with every secret-named default param shown as ``***``."""
    if not isinstance(steps, list):
        return steps
    return [{**step, "default_params": redact_params(step["default_params"])}
            if isinstance(step, dict) and isinstance(step.get("default_params"), dict) else step for step in steps]


def steps_keeping_secrets(given: Any, *, name: str, stored: Any = None) -> Any:
    """Return ``given`` steps (edited from a redacted copy) with each ``***`` default param put back
    from the stored step of the same key: of ``stored`` steps, else of the latest version of ``name``.
    Matching by step key, not position, so reordered steps never swap their secrets."""
    if not isinstance(given, list):
        return given
    if stored is None:
        latest = Workflow.objects.filter(name=name).order_by("-version").only("steps").first()
        stored = latest.steps if latest is not None else []
    by_key = {s.get("key"): s for s in stored if isinstance(s, dict)} if isinstance(stored, list) else {}
    return [{**step, "default_params": keep_secrets(step["default_params"],
                                                    by_key.get(step.get("key"), {}).get("default_params"))}
            if isinstance(step, dict) and isinstance(step.get("default_params"), dict) else step for step in given]
