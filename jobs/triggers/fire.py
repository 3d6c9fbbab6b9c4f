"""Firing triggers: an application event starts its triggers' jobs; the builder fires due schedules.

Every firing starts its job through :func:`jobs.enqueue.start`; a trigger that cannot fire records
the reason on itself (``last_error``) and on the timeline, and starts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import DatabaseError, connection, transaction
from django.utils import timezone as djtz

from accs_site.admin_kit import ActionResult
from accs_site.redaction import redact_params
from events.timeline import EventRow, operator_source, write_events
from jobs import enqueue
from jobs.ids import short_id
from jobs.models import Job, JobSource, MissedRunPolicy, Trigger, TriggerType
from jobs.triggers.context import base_context, job_spec, schedule_context
from jobs.triggers.schedule import Schedule, ScheduleError
from jobs.triggers.templates import TemplateError, payload_digest, render
from tenants.accounts import user_id_named
from tenants.models import Tenant
from workflows.validation import DefinitionError, Problem


def _record_error(trigger: Trigger, message: str, *, source: str, data: dict[str, Any] | None = None,
                  locked: bool = False) -> None:
    """Record a firing error on the trigger and as an error event (in the current transaction)."""
    with connection.cursor() as cur:
        # An emitter does not wait for, or deadlock on, a trigger row another transaction holds;
        # the event below is written regardless.
        lock = "" if locked else " AND id IN (SELECT id FROM accs_trigger WHERE id = %(id)s FOR UPDATE SKIP LOCKED)"
        cur.execute("UPDATE accs_trigger SET last_error = %(err)s WHERE id = %(id)s AND last_error <> %(err)s" + lock,
                    {"id": trigger.id, "err": message[:2000]})
        write_events([EventRow(type="trigger", level="error", source=source,
                               message=f"trigger {trigger.label!r} did not start a job: {message}",
                               data={"trigger_id": str(trigger.id), "tenant": trigger.tenant.slug, "error": message,
                                     **(data or {})})], cursor=cur)


def _clear_error(trigger: Trigger, *, locked: bool = False) -> None:
    """Clear ``last_error`` after a successful firing (skipped, not waited for, if the row is busy)."""
    with connection.cursor() as cur:
        lock = "" if locked else " AND id IN (SELECT id FROM accs_trigger WHERE id = %(id)s FOR UPDATE SKIP LOCKED)"
        cur.execute("UPDATE accs_trigger SET last_error = '' WHERE id = %(id)s AND last_error <> ''" + lock,
                    {"id": trigger.id})


def _started_event(job: Job, trigger: Trigger, message: str, *, source: str, data: dict[str, Any]) -> EventRow:
    return EventRow(type="trigger", job_id=job.id, source=source, message=message,
                    data={"trigger_id": str(trigger.id), "label": trigger.label, **data})


def _clean_json(value: Any, depth: int = 0) -> Any:
    """Return ``value`` as JSON-safe data PostgreSQL's jsonb accepts (no NUL characters)."""
    if depth > 50:
        return "…"
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_clean_json(str(k), depth + 1): _clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_json(v, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


@dataclass
class EmitResult:
    """What an application event did: jobs started, firings suppressed by the dedupe window, errors."""

    name: str
    jobs: list[Job] = field(default_factory=list)
    deduplicated: list[tuple[UUID, UUID]] = field(default_factory=list)  # (trigger id, job holding the window)
    errors: list[tuple[UUID, str]] = field(default_factory=list)  # (trigger id, message)


def fire_event(name: str, context: dict[str, Any] | None = None, *, tenant: Tenant, correlation_id: str = "",
               source: str = "app", sent_by: Any = None, now: datetime | None = None) -> EmitResult:
    """Record an application event and start the jobs of its triggers, in the caller's transaction.

    ``sent_by`` is the user who sent the event (a token's user, a signed-in user; None for code):
    the jobs are theirs, so they may not approve them.

    One savepoint per trigger: a trigger that cannot fire (missing context value, params that fail
    the service schema, inactive service...) records its error and the others still fire.
    """
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise DefinitionError([Problem("name", "an event name is a non-empty text of at most 200 characters")])
    if context is not None and not isinstance(context, dict):
        raise DefinitionError([Problem("context", "must be a JSON object")])
    now = now or djtz.now()
    context = _clean_json(context or {})
    result = EmitResult(name=name)
    events: list[EventRow] = []
    with transaction.atomic():
        triggers = list(Trigger.objects.filter(tenant=tenant, trigger_type=TriggerType.EVENT, event_name=name,
                                               is_enabled=True).select_related("tenant", "service", "workflow")
                        .order_by("id"))
        for trigger in triggers:
            ctx = {**base_context(trigger), "event": context}
            try:
                payload = render(trigger.payload_template, ctx)
            except TemplateError as exc:
                result.errors.append((trigger.id, str(exc)))
                _record_error(trigger, str(exc), source=source, data={"event": name})
                continue
            digest = payload_digest(payload)
            source_ref = f"trigger:{trigger.id}:{digest}"
            try:
                with transaction.atomic():
                    if trigger.dedupe_window_seconds:
                        holder = _window_holder(trigger, source_ref, now=now)
                        if holder:
                            result.deduplicated.append((trigger.id, holder))
                            continue
                    job = enqueue.start(job_spec(trigger, payload, source=JobSource.EVENT, source_ref=source_ref,
                                                 external_id=None, correlation_id=correlation_id, caused_by=sent_by))
            except (DefinitionError, LookupError, enqueue.JobConflict, DatabaseError) as exc:
                message = "; ".join(str(p) for p in exc.problems) if isinstance(exc, DefinitionError) else str(exc)
                result.errors.append((trigger.id, message))
                _record_error(trigger, message, source=source, data={"event": name})
                continue
            result.jobs.append(job)
            events.append(_started_event(job, trigger, f"job started by trigger {trigger.label!r} on event {name}",
                                         source=source, data={"event": name}))
            if trigger.last_error:
                _clear_error(trigger)
        events.append(EventRow(
            type="app_event", source=source, message=f"app event {name} ({len(result.jobs)} job(s) started)",
            # The context as the timeline keeps and shows it: secret-named values as ***.
            data={"name": name, "tenant": tenant.slug, "context": redact_params(context),
                  "correlation_id": correlation_id,
                  "jobs": [str(j.id) for j in result.jobs],
                  "deduplicated": [{"trigger_id": str(t), "job_id": str(j)} for t, j in result.deduplicated],
                  "errors": [{"trigger_id": str(t), "error": e} for t, e in result.errors]},
        ))
        write_events(events)
    return result


def _window_holder(trigger: Trigger, source_ref: str, *, now: datetime) -> UUID | None:
    """Return the job this trigger started with the same payload within its dedupe window, if any.

    A transaction-scoped advisory lock on (trigger, payload) makes concurrent emitters take turns,
    so two identical events cannot both see an empty window; the lock ends with the caller's
    transaction, when the first one's job becomes visible.
    """
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:{source_ref}"])
    since = now - timedelta(seconds=trigger.dedupe_window_seconds)
    return (Job.objects.filter(tenant_id=trigger.tenant_id, source=JobSource.EVENT, source_ref=source_ref,
                               created_at__gte=since)
            .order_by("-created_at").values_list("id", flat=True).first())


ON_TIME_GRACE = timedelta(minutes=5)
RUNS_COUNT_LIMIT = 1000

DUE_SCHEDULES_SQL = """
-- Served by trigger_due_idx (next_run_at WHERE schedule AND enabled). NULL next_run_at: a trigger
-- saved through the admin form, scheduled here. SKIP LOCKED: builders share the due triggers,
-- none waits, none takes a trigger another is firing.
SELECT id FROM accs_trigger
 WHERE trigger_type = 'schedule' AND is_enabled AND (next_run_at <= %(now)s OR next_run_at IS NULL)
 ORDER BY next_run_at NULLS FIRST, id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED
"""


def fire_due_schedules(*, now: datetime | None = None, limit: int = 100) -> int:
    """Fire due schedule triggers (a builder-leader duty, every tick). Return the number of jobs started.

    For each due trigger, with D its ``next_run_at``:

    * on time (no later due time has passed and now − D ≤ 5 minutes): one job for D;
    * missed (the builder was down over one or more due times, or is more than 5 minutes late):
      ``run_once`` starts one job for all of them (keyed by D; ``{{schedule.runs_covered}}`` tells
      how many due times it stands for, counted up to 1000), ``skip`` starts none and writes an
      event saying how many were skipped;
    * ``next_run_at`` becomes the first due time after now.

    Idempotent and safe with several builders: a trigger row is locked (SKIP LOCKED) and advanced
    only from the value read; the job's external_id ``trigger:<id>:<D>`` cannot repeat.
    """
    now = now or djtz.now()
    started = 0
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(DUE_SCHEDULES_SQL, {"now": now, "limit": limit})
            ids = [r[0] for r in cur.fetchall()]
        if not ids:
            return 0
        triggers = Trigger.objects.filter(pk__in=ids).select_related("tenant", "service", "workflow").order_by("id")
        for trigger in triggers:
            with transaction.atomic():
                started += _fire_schedule(trigger, now=now)
    return started


def _fire_schedule(trigger: Trigger, *, now: datetime) -> int:
    source = "builder"
    expected = trigger.next_run_at
    try:
        schedule = Schedule.parse(trigger.cron_expr, trigger.timezone)
        following = schedule.next_after(now)
    except ScheduleError as exc:
        # A definition saved through the admin form; it stays unscheduled until fixed.
        Trigger.objects.filter(pk=trigger.pk).update(next_run_at=None)
        if trigger.last_error != str(exc):
            _record_error(trigger, str(exc), source=source, locked=True)
        return 0
    if expected is None:
        Trigger.objects.filter(pk=trigger.pk, next_run_at__isnull=True).update(next_run_at=following)
        return 0
    dues = schedule.due_times(expected - timedelta(microseconds=1), now, limit=RUNS_COUNT_LIMIT)
    on_time = len(dues) <= 1 and now - expected <= ON_TIME_GRACE
    fire = on_time or trigger.missed_run_policy == MissedRunPolicy.RUN_ONCE
    advanced = Trigger.objects.filter(pk=trigger.pk, next_run_at=expected).update(
        next_run_at=following, last_fired_at=now if fire else trigger.last_fired_at)
    if not advanced:
        return 0  # another builder handled this due time
    runs = max(len(dues), 1)
    counted = f"{runs}{'+' if runs >= RUNS_COUNT_LIMIT else ''}"
    if not fire:
        write_events([EventRow(type="trigger", level="warn", source=source,
                               message=f"schedule trigger {trigger.label!r} skipped {counted} missed run(s) "
                                       f"from {expected.isoformat()} (missed_run_policy=skip)",
                               data={"trigger_id": str(trigger.id), "first_due_at": expected.isoformat(),
                                     "skipped": runs, "next_run_at": following.isoformat()})])
        return 0
    context = schedule_context(trigger, expected, runs=runs)
    try:
        payload = render(trigger.payload_template, context)
        with transaction.atomic():
            job = enqueue.start(job_spec(
                trigger, payload, source=JobSource.SCHEDULE, source_ref=f"trigger:{trigger.id}",
                external_id=f"trigger:{trigger.id}:{expected.astimezone(UTC).isoformat()}"))
    except (TemplateError, DefinitionError, LookupError, enqueue.JobConflict, DatabaseError) as exc:
        message = "; ".join(str(p) for p in exc.problems) if isinstance(exc, DefinitionError) else str(exc)
        _record_error(trigger, message, source=source, data={"due_at": expected.isoformat()}, locked=True)
        return 0
    if not job.was_created:
        return 0
    if trigger.last_error:
        _clear_error(trigger, locked=True)
    note = "" if on_time else f" ({counted} missed due times, missed_run_policy=run_once)"
    write_events([_started_event(job, trigger, f"job started by schedule trigger {trigger.label!r} for "
                                               f"{context['schedule']['due_local']}{note}",
                                 source=source, data={"due_at": context["schedule"]["due_at"], "runs_covered": runs})])
    return 1


def run_now(trigger_id: UUID, *, by: str = "", now: datetime | None = None) -> ActionResult:
    """Start a schedule trigger's job now, as if it were due now (an operator's "run now").

    The job is the trigger's like its scheduled ones (``source_ref`` ``trigger:<id>``), with its own
    external id, so it is listed with them; the schedule's next due time does not move. Event
    triggers run when their event is emitted, so they are refused with that reason.
    """
    trigger = Trigger.objects.select_related("tenant", "workflow", "service").filter(pk=trigger_id).first()
    if trigger is None:
        return ActionResult(False, "no such trigger")
    if trigger.trigger_type != TriggerType.SCHEDULE:
        return ActionResult(False, f"event triggers start jobs when {trigger.event_name!r} is emitted; emit it instead")
    now = now or djtz.now()
    source = operator_source(by)
    try:
        payload = render(trigger.payload_template, schedule_context(trigger, now))
        with transaction.atomic():
            job = enqueue.start(job_spec(
                trigger, payload, source=JobSource.SCHEDULE, source_ref=f"trigger:{trigger.id}",
                external_id=f"trigger:{trigger.id}:now:{now.astimezone(UTC).isoformat()}", caused_by=user_id_named(by)))
            write_events([_started_event(job, trigger, f"job started by 'run now' of schedule trigger "
                                                       f"{trigger.label!r}", source=source,
                                         data={"due_at": now.astimezone(UTC).isoformat(), "run_now": True})])
    except (TemplateError, DefinitionError, LookupError, ScheduleError, enqueue.JobConflict) as exc:
        message = "; ".join(str(p) for p in exc.problems) if isinstance(exc, DefinitionError) else str(exc)
        return ActionResult(False, message)
    return ActionResult(True, f"job {short_id(job.id)} started")
