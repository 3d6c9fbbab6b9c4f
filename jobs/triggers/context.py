"""What a firing renders its template from, and the job it asks :mod:`jobs.enqueue` to start."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from jobs.enqueue import JobSpec
from jobs.models import Trigger
from jobs.triggers.schedule import zone
from workflows.models import Workflow


def workflow_for(trigger: Trigger) -> Workflow:
    """The workflow a trigger starts: the latest active version of its workflow's name."""
    workflow = trigger.workflow
    if workflow is None:
        raise ValueError(f"trigger {trigger.pk} starts a service, not a workflow")
    latest = Workflow.objects.filter(name=workflow.name, is_active=True).order_by("-version").first()
    return latest or workflow


def base_context(trigger: Trigger) -> dict[str, Any]:
    """Return the ``trigger`` and ``tenant`` namespaces every template may use."""
    return {
        "trigger": {"id": str(trigger.id), "label": trigger.label, "event_name": trigger.event_name or ""},
        "tenant": {"id": str(trigger.tenant.id), "slug": trigger.tenant.slug, "name": trigger.tenant.name},
    }


def schedule_context(trigger: Trigger, due: datetime, *, runs: int = 1) -> dict[str, Any]:
    """Return a schedule trigger's template context for the due time ``due`` standing for ``runs`` runs."""
    tz = zone(trigger.timezone)
    return {**base_context(trigger), "schedule": {
        "due_at": due.astimezone(UTC).isoformat(), "due_local": due.astimezone(tz).isoformat(),
        "timezone": trigger.timezone, "cron": trigger.cron_expr, "runs_covered": runs,
    }}


def job_spec(trigger: Trigger, payload: Any, *, source: str, source_ref: str, external_id: str | None,
             correlation_id: str = "", caused_by: Any = None) -> JobSpec:
    """Return the job a firing starts: the trigger's service or workflow, with the rendered payload as params.

    The job is created by ``caused_by``, the user who caused the firing (the event's sender, the
    operator who pressed "run now"; None for a schedule's due time): that is who "started" it for
    the four-eyes rule. The trigger's creator and last editor chose what it runs, so they may not
    approve its jobs either (:attr:`jobs.enqueue.JobSpec.approval_barred`).
    """
    barred = tuple(uid for uid in (trigger.created_by_id, trigger.updated_by_id) if uid is not None)
    spec = JobSpec(priority=trigger.priority, tenant=trigger.tenant, source=source, source_ref=source_ref,
                   external_id=external_id, correlation_id=correlation_id, created_by=caused_by,
                   approval_barred=barred)
    if trigger.service_id is not None:
        spec.service, spec.params = trigger.service, payload
    else:
        spec.workflow, spec.step_params = workflow_for(trigger), payload
    return spec
