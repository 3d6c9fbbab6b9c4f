"""Trigger definitions: validating and saving them (the HTTP API; the admin form saves raw fields,
and :func:`jobs.triggers.fire.fire_due_schedules` copes with what it saved)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone as djtz

from jobs import enqueue
from jobs.models import JobSource, MissedRunPolicy, Trigger, TriggerType
from jobs.triggers.context import job_spec, schedule_context, workflow_for
from jobs.triggers.schedule import Schedule, ScheduleError
from jobs.triggers.templates import TemplateError, render, template_problems
from tenants.models import Tenant
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem

TRIGGER_FIELDS = ("label", "is_enabled", "trigger_type", "event_name", "cron_expr", "timezone", "missed_run_policy",
                  "workflow", "service", "payload_template", "priority", "dedupe_window_seconds")
INT32 = 2**31 - 1


def trigger_problems(trigger: Trigger) -> list[Problem]:
    """Return every problem of a trigger definition, each naming its field."""
    problems: list[Problem] = []
    if not isinstance(trigger.label, str) or not trigger.label.strip() or len(trigger.label) > 200:
        problems.append(Problem("label", "must be a non-empty text of at most 200 characters"))
    kind = trigger.trigger_type
    if kind not in TriggerType.values:
        problems.append(Problem("trigger_type", f"must be one of {TriggerType.values}"))
    if kind == TriggerType.EVENT:
        if not isinstance(trigger.event_name, str) or not trigger.event_name.strip() or len(trigger.event_name) > 200:
            problems.append(Problem("event_name",
                                    "an event trigger needs the event name, e.g. 'provider.folder.updated'"))
        if trigger.cron_expr:
            problems.append(Problem("cron_expr", "an event trigger has no cron expression"))
    elif kind == TriggerType.SCHEDULE:
        if trigger.event_name:
            problems.append(Problem("event_name", "a schedule trigger has no event name"))
        try:
            Schedule.parse(trigger.cron_expr, trigger.timezone)
        except ScheduleError as exc:
            problems.append(Problem(exc.field, str(exc).split(": ", 1)[1]))
    if trigger.missed_run_policy not in MissedRunPolicy.values:
        problems.append(Problem("missed_run_policy", f"must be one of {MissedRunPolicy.values}"))
    if (trigger.workflow_id is None) == (trigger.service_id is None):
        problems.append(Problem("target", "give exactly one of workflow or service"))
    elif (service := trigger.service) is not None and not service.is_active:
        problems.append(Problem("service", f"service {service.key!r} is not active"))
    if not isinstance(trigger.priority, int) or isinstance(trigger.priority, bool) or abs(trigger.priority) > INT32:
        problems.append(Problem("priority", "must be a whole number"))
    window = trigger.dedupe_window_seconds
    if not isinstance(window, int) or isinstance(window, bool) or not 0 <= window <= INT32:
        problems.append(Problem("dedupe_window_seconds", "must be a whole number of seconds, 0 or more"))
    problems += template_problems(trigger.payload_template, trigger_type=kind)
    if not problems and trigger.workflow_id is not None:
        workflow = workflow_for(trigger)
        steps = {s.get("key") for s in workflow.steps if isinstance(s, dict)}
        for key, value in trigger.payload_template.items():
            if key not in steps:
                problems.append(Problem(f"payload_template.{key}", f"workflow {workflow.name!r} has no step "
                                                                   f"{key!r}; a workflow trigger's template is "
                                                                   "{step: {params}}"))
            elif not isinstance(value, dict):
                problems.append(Problem(f"payload_template.{key}", "must be an object of params for that step"))
    if not problems and kind == TriggerType.SCHEDULE:
        # A schedule's context is known up front, so a trial render catches what firing would.
        try:
            payload = render(trigger.payload_template, schedule_context(trigger, djtz.now()))
            enqueue.validate(job_spec(trigger, payload, source=JobSource.SCHEDULE, source_ref="", external_id=None))
        except TemplateError as exc:
            problems.append(Problem(f"payload_template.{exc.where}", str(exc).split(": ", 1)[1]))
        except DefinitionError as exc:
            problems += [Problem(f"payload_template ({p.where})", p.message) for p in exc.problems]
        except LookupError as exc:
            problems.append(Problem("target", str(exc)))
    return problems


def _apply(trigger: Trigger, fields: dict[str, Any]) -> list[Problem]:
    """Set fields on a trigger, resolving ``workflow`` (name) and ``service`` (key) to objects."""
    problems: list[Problem] = []
    unknown = sorted(set(fields) - set(TRIGGER_FIELDS))
    if unknown:
        problems.append(Problem("trigger", f"unknown fields {unknown}"))
    for name, value in fields.items():
        if name == "workflow":
            if value is None:
                trigger.workflow = None
            elif isinstance(value, Workflow):
                trigger.workflow = value
            else:
                found_workflow = (Workflow.objects.filter(name=value, is_active=True).order_by("-version").first()
                                  if isinstance(value, str) else None)
                if found_workflow is None:
                    problems.append(Problem("workflow", f"no active workflow {value!r}"))
                else:
                    trigger.workflow = found_workflow
        elif name == "service":
            if value is None:
                trigger.service = None
            elif isinstance(value, Service):
                trigger.service = value
            else:
                found_service = Service.objects.filter(key=value).first() if isinstance(value, str) else None
                if found_service is None:
                    problems.append(Problem("service", f"no service {value!r}"))
                else:
                    trigger.service = found_service
        elif name in TRIGGER_FIELDS:
            setattr(trigger, name, value)
    if trigger.trigger_type == TriggerType.EVENT:
        trigger.timezone = None  # meaningless for events; the CHECK constraint only allows it
    elif trigger.trigger_type == TriggerType.SCHEDULE and not trigger.timezone and trigger.tenant_id:
        trigger.timezone = trigger.tenant.timezone  # a schedule without a zone runs in its tenant's
    return problems


def _save(trigger: Trigger, *, reschedule: bool, now: datetime) -> Trigger:
    if trigger.trigger_type == TriggerType.SCHEDULE and trigger.is_enabled:
        if reschedule or trigger.next_run_at is None:
            trigger.next_run_at = Schedule.parse(trigger.cron_expr, trigger.timezone).next_after(now)
    else:
        trigger.next_run_at = None
    trigger.last_error = ""
    trigger.save()
    return trigger


def create_trigger(*, tenant: Tenant, created_by: Any = None, now: datetime | None = None, **fields: Any) -> Trigger:
    """Validate and save a new trigger; a schedule's first ``next_run_at`` is computed from now.

    ``fields`` are the Trigger fields; ``workflow`` is a workflow name (the latest active version
    runs) and ``service`` a service key. Raises DefinitionError naming every problem.
    """
    now = now or djtz.now()
    trigger = Trigger(tenant=tenant, created_by=created_by, label="", trigger_type="",
                      missed_run_policy=MissedRunPolicy.RUN_ONCE)
    problems = _apply(trigger, fields)
    problems += [] if problems else trigger_problems(trigger)
    if problems:
        raise DefinitionError(problems)
    with transaction.atomic():
        return _save(trigger, reschedule=True, now=now)


def update_trigger(trigger: Trigger, *, by: Any = None, now: datetime | None = None, **changes: Any) -> Trigger:
    """Validate and save changes to a trigger; ``by`` (a user) becomes its last editor, who may not
    approve the jobs it starts from then on.

    Changing the cron expression or time zone, or enabling the trigger, computes ``next_run_at``
    afresh from now: missed-run handling applies to downtime, not to a trigger that was off.
    """
    now = now or djtz.now()
    before = (trigger.trigger_type, trigger.cron_expr, trigger.timezone, trigger.is_enabled)
    problems = _apply(trigger, changes)
    problems += [] if problems else trigger_problems(trigger)
    if problems:
        raise DefinitionError(problems)
    after = (trigger.trigger_type, trigger.cron_expr, trigger.timezone, trigger.is_enabled)
    reschedule = before[:3] != after[:3] or (after[3] and not before[3])
    if by is not None:
        trigger.updated_by = by
    with transaction.atomic():
        return _save(trigger, reschedule=reschedule, now=now)
