"""Triggers: application events and cron schedules that start jobs inside one tenant.

**Event triggers.** :func:`fire_event` (public as :func:`jobs.api.emit_event`) records the
application event on the timeline and starts one job per enabled trigger of the tenant that names
the event, in the caller's transaction. The job's params are the trigger's ``payload_template``
rendered from the event context (``"{{event.provider_id}}"``). A placeholder the context cannot fill
is an error recorded on the trigger (``last_error``) and as an error event; no job is started with
a hole in it. Within ``dedupe_window_seconds`` the same trigger with the same rendered payload
starts no second job.

**Schedule triggers.** A cron expression (5 fields or an ``@daily``-style alias) read in an IANA
time zone. :func:`fire_due_schedules` is a builder-leader duty: it fires every trigger whose
``next_run_at`` has come, at most once per due time even when several builders call it at once
(row locks with SKIP LOCKED, a conditional UPDATE of ``next_run_at`` from its expected value, and
the job's ``external_id = "trigger:<id>:<due time>"``). Daylight-saving rules and missed runs are
described in ``docs/triggers.md`` and at :class:`Schedule` and :func:`fire_due_schedules`.

Placeholders: ``{{event.<path>}}`` (event triggers), ``{{schedule.due_at|due_local|timezone|cron|
runs_covered}}`` (schedule triggers), and ``{{trigger.id|label|event_name}}``, ``{{tenant.id|slug|
name}}`` (both). A string that is exactly one placeholder takes the value's JSON type; placeholders
inside a longer string are replaced by text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone as djtz

from events.timeline import EventRow, write_events
from jobs.models import Job, JobSource, MissedRunPolicy, Trigger, TriggerType
from tenants.models import Tenant
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem

if TYPE_CHECKING:
    from jobs.verbs import ActionResult

# --------------------------------------------------------------------------------------------
# Payload templates
# --------------------------------------------------------------------------------------------

PLACEHOLDER_RE = re.compile(r"\{\{(.*?)\}\}")
ONLY_PLACEHOLDER_RE = re.compile(r"^\{\{(.*?)\}\}$")
PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*$")
TEMPLATE_NAMESPACES = {
    TriggerType.EVENT: {"event": None, "trigger": {"id", "label", "event_name"}, "tenant": {"id", "slug", "name"}},
    TriggerType.SCHEDULE: {
        "schedule": {"due_at", "due_local", "timezone", "cron", "runs_covered"},
        "trigger": {"id", "label", "event_name"}, "tenant": {"id", "slug", "name"},
    },
}
MAX_TEMPLATE_DEPTH = 20


class TemplateError(ValueError):
    """A placeholder cannot be filled; ``where`` is the template path, ``placeholder`` the missing name."""

    def __init__(self, where: str, placeholder: str, reason: str) -> None:
        self.where = where
        self.placeholder = placeholder
        super().__init__(f"payload_template.{where}: {{{{{placeholder}}}}} {reason}")


def _walk(template: Any, where: str = "", depth: int = 0):
    """Yield (where, string) for every string value of a JSON template."""
    if depth > MAX_TEMPLATE_DEPTH:
        raise TemplateError(where or "(root)", "", f"nests deeper than {MAX_TEMPLATE_DEPTH} levels")
    if isinstance(template, str):
        yield where or "(root)", template
    elif isinstance(template, dict):
        for key, value in template.items():
            yield from _walk(value, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(template, list):
        for index, value in enumerate(template):
            yield from _walk(value, f"{where}[{index}]", depth + 1)


def template_problems(template: Any, *, trigger_type: str) -> list[Problem]:
    """Return every syntax problem of a payload template (unbalanced braces, unknown namespaces)."""
    if not isinstance(template, dict):
        return [Problem("payload_template", "must be a JSON object")]
    namespaces = TEMPLATE_NAMESPACES.get(trigger_type, {})
    problems: list[Problem] = []
    try:
        strings = list(_walk(template))
    except TemplateError as exc:
        return [Problem(f"payload_template.{exc.where}", str(exc).split(": ", 1)[-1])]
    for where, text in strings:
        name = f"payload_template.{where}"
        leftover = PLACEHOLDER_RE.sub("", text)
        if "{{" in leftover or "}}" in leftover:
            problems.append(Problem(name, "unbalanced '{{' or '}}'"))
        for raw in PLACEHOLDER_RE.findall(text):
            path = raw.strip()
            if not PATH_RE.match(path):
                problems.append(Problem(name, f"{{{{{raw}}}}} is not a dotted name such as {{{{event.provider_id}}}}"))
                continue
            root, _, rest = path.partition(".")
            if root not in namespaces:
                problems.append(Problem(name, f"{{{{{path}}}}}: unknown namespace {root!r}; use one of "
                                              f"{sorted(namespaces)} in a {trigger_type} trigger"))
            elif not rest:
                problems.append(Problem(name, f"{{{{{path}}}}} names a namespace, not a value"))
            elif namespaces[root] is not None and rest.split(".")[0] not in namespaces[root]:
                problems.append(Problem(name, f"{{{{{path}}}}}: {root} has only {sorted(namespaces[root])}"))
    return problems


def _lookup(context: dict[str, Any], path: str, where: str) -> Any:
    value: Any = context
    walked: list[str] = []
    for part in path.split("."):
        walked.append(part)
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(where, path, f"is missing: the context has no {'.'.join(walked)!r}")
    return value


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def render(template: Any, context: dict[str, Any], *, where: str = "") -> Any:
    """Render a JSON template from ``context``; raise TemplateError naming the first missing value."""
    if isinstance(template, str):
        here = where or "(root)"
        only = ONLY_PLACEHOLDER_RE.match(template)
        if only and "{{" not in only.group(1):
            return _lookup(context, only.group(1).strip(), here)
        return PLACEHOLDER_RE.sub(lambda m: _as_text(_lookup(context, m.group(1).strip(), here)), template)
    if isinstance(template, dict):
        return {k: render(v, context, where=f"{where}.{k}" if where else str(k)) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, context, where=f"{where}[{i}]") for i, v in enumerate(template)]
    return template


def payload_digest(payload: Any) -> str:
    """Return a stable SHA-256 of a rendered payload (the dedupe identity of an event firing)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# Cron schedules in IANA time zones
# --------------------------------------------------------------------------------------------

CRON_ALIASES = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
# A DST change moves wall-clock times by at most two hours anywhere; three gives margin.
DST_SLACK = timedelta(hours=3)
MAX_SCAN = 2000  # wall-clock candidates examined per computation (6 h of an every-minute cron)


class ScheduleError(ValueError):
    """A cron expression or time zone is unusable; ``field`` names which."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def zone(name: Any) -> ZoneInfo:
    """Return the IANA time zone ``name``; raise ScheduleError naming the field otherwise."""
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ScheduleError("timezone", "give an IANA time zone name such as 'Europe/Budapest'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError("timezone", f"unknown IANA time zone {name!r}") from None


@dataclass(frozen=True)
class Schedule:
    """A cron expression read in a time zone, with cron's daylight-saving rules.

    Following Vixie/ISC cron: a *fixed-time* job (no ``*`` in the minute or hour field) runs once
    per matching day even when DST repeats its wall time (the first occurrence counts), and a time
    skipped by the spring change runs once, shifted by the size of the gap (02:30 → 03:30). A
    *wildcard* job (``*`` or ``*/n`` in the minute or hour field) follows real time: repeated wall
    times run again and skipped ones do not exist.
    """

    expr: str
    tz: ZoneInfo
    wildcard: bool

    @classmethod
    def parse(cls, cron_expr: Any, timezone: Any) -> Schedule:
        """Validate and return a schedule; raise ScheduleError naming ``cron_expr`` or ``timezone``."""
        tz = zone(timezone)
        if not isinstance(cron_expr, str) or not cron_expr.strip() or len(cron_expr) > 200:
            raise ScheduleError("cron_expr", "give a cron expression such as '0 2 * * *'")
        expr = CRON_ALIASES.get(cron_expr.strip().lower(), cron_expr.strip())
        fields = expr.split()
        if len(fields) != 5:
            raise ScheduleError("cron_expr", f"expected 5 fields (minute hour day-of-month month day-of-week) "
                                             f"or an alias {sorted(CRON_ALIASES)}, got {len(fields)} in {cron_expr!r}")
        if not croniter.is_valid(expr):
            raise ScheduleError("cron_expr", f"{cron_expr!r} is not a valid cron expression")
        schedule = cls(expr=" ".join(fields), tz=tz, wildcard="*" in fields[0] or "*" in fields[1])
        try:
            schedule.next_after(djtz.now())
        except ScheduleError:
            raise
        except (CroniterError, ValueError, OverflowError) as exc:
            raise ScheduleError("cron_expr", f"{cron_expr!r} never matches a date ({exc})") from None
        return schedule

    def _instants(self, wall: datetime) -> list[datetime]:
        """Map one wall-clock match to the instants it runs at (none, one, or two)."""
        first = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        exists = first.astimezone(self.tz).replace(tzinfo=None) == wall
        if not exists:  # in the spring-forward gap; fold=0 reads it with the old offset, i.e. shifted forward
            return [] if self.wildcard else [first]
        if first != second:  # repeated by the autumn change
            return [first, second] if self.wildcard else [first]
        return [first]

    def _clean(self, at: datetime) -> bool:
        """True when no DST change lies within DST_SLACK of ``at``."""
        return (at - DST_SLACK).astimezone(self.tz).utcoffset() == (at + DST_SLACK).astimezone(self.tz).utcoffset()

    def next_after(self, after: datetime) -> datetime:
        """Return the first due instant strictly after ``after`` (aware, UTC)."""
        after = after.astimezone(UTC)
        local = after.astimezone(self.tz).replace(tzinfo=None)
        wall = croniter(self.expr, local).get_next(datetime)
        candidate = wall.replace(tzinfo=self.tz).astimezone(UTC)
        if self._clean(after) and self._clean(candidate):
            return candidate  # far from any DST change, wall-clock order is time order
        # Near a DST change a wall time before ``local`` can map after ``after`` (gap shift, second
        # occurrence) and one after can map before, so examine every candidate around it.
        it = croniter(self.expr, local - DST_SLACK)
        best: datetime | None = None
        limit: datetime | None = None
        for _ in range(MAX_SCAN):
            wall = it.get_next(datetime)
            if limit is not None and wall > limit:
                break
            for instant in self._instants(wall):
                if instant > after and (best is None or instant < best):
                    best = instant
                    limit = best.astimezone(self.tz).replace(tzinfo=None) + DST_SLACK
        if best is None:
            raise ScheduleError("cron_expr", f"{self.expr!r}: no due time found after {after.isoformat()}")
        return best

    def due_times(self, start: datetime, end: datetime, *, limit: int = 1000) -> list[datetime]:
        """Return the due instants in (start, end], at most ``limit``."""
        out: list[datetime] = []
        current = start
        while len(out) < limit:
            current = self.next_after(current)
            if current > end:
                break
            out.append(current)
        return out


# --------------------------------------------------------------------------------------------
# Validation and saving (HTTP API; the admin form saves raw fields, fire_due_schedules copes)
# --------------------------------------------------------------------------------------------

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
    elif trigger.service_id is not None and not trigger.service.is_active:
        problems.append(Problem("service", f"service {trigger.service.key!r} is not active"))
    if not isinstance(trigger.priority, int) or isinstance(trigger.priority, bool) or abs(trigger.priority) > INT32:
        problems.append(Problem("priority", "must be a whole number"))
    window = trigger.dedupe_window_seconds
    if not isinstance(window, int) or isinstance(window, bool) or not 0 <= window <= INT32:
        problems.append(Problem("dedupe_window_seconds", "must be a whole number of seconds, 0 or more"))
    problems += template_problems(trigger.payload_template, trigger_type=kind)
    if not problems and trigger.workflow_id is not None:
        steps = {s.get("key") for s in _workflow_for(trigger).steps if isinstance(s, dict)}
        for key, value in trigger.payload_template.items():
            if key not in steps:
                problems.append(Problem(f"payload_template.{key}", f"workflow {trigger.workflow.name!r} has no step "
                                                                   f"{key!r}; a workflow trigger's template is "
                                                                   "{step: {params}}"))
            elif not isinstance(value, dict):
                problems.append(Problem(f"payload_template.{key}", "must be an object of params for that step"))
    if not problems and kind == TriggerType.SCHEDULE:
        # A schedule's context is known up front, so a trial render catches what firing would.
        from jobs import api

        try:
            api.validate(_spec(trigger, render(trigger.payload_template, _schedule_context(trigger, djtz.now())),
                               source=JobSource.SCHEDULE, source_ref="", external_id=None))
        except TemplateError as exc:
            problems.append(Problem(f"payload_template.{exc.where}", str(exc).split(": ", 1)[1]))
        except DefinitionError as exc:
            problems += [Problem(f"payload_template ({p.where})", p.message) for p in exc.problems]
        except LookupError as exc:
            problems.append(Problem("target", str(exc)))
    return problems


def _workflow_for(trigger: Trigger) -> Workflow:
    """The workflow a trigger starts: the latest active version of its workflow's name."""
    latest = Workflow.objects.filter(name=trigger.workflow.name, is_active=True).order_by("-version").first()
    return latest or trigger.workflow


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
                found = (Workflow.objects.filter(name=value, is_active=True).order_by("-version").first()
                         if isinstance(value, str) else None)
                if found is None:
                    problems.append(Problem("workflow", f"no active workflow {value!r}"))
                else:
                    trigger.workflow = found
        elif name == "service":
            if value is None:
                trigger.service = None
            elif isinstance(value, Service):
                trigger.service = value
            else:
                found = Service.objects.filter(key=value).first() if isinstance(value, str) else None
                if found is None:
                    problems.append(Problem("service", f"no service {value!r}"))
                else:
                    trigger.service = found
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


def update_trigger(trigger: Trigger, *, now: datetime | None = None, **changes: Any) -> Trigger:
    """Validate and save changes to a trigger.

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
    with transaction.atomic():
        return _save(trigger, reschedule=reschedule, now=now)


# --------------------------------------------------------------------------------------------
# Firing
# --------------------------------------------------------------------------------------------

def _base_context(trigger: Trigger) -> dict[str, Any]:
    return {
        "trigger": {"id": str(trigger.id), "label": trigger.label, "event_name": trigger.event_name or ""},
        "tenant": {"id": str(trigger.tenant.id), "slug": trigger.tenant.slug, "name": trigger.tenant.name},
    }


def _schedule_context(trigger: Trigger, due: datetime, *, runs: int = 1) -> dict[str, Any]:
    tz = zone(trigger.timezone)
    return {**_base_context(trigger), "schedule": {
        "due_at": due.astimezone(UTC).isoformat(), "due_local": due.astimezone(tz).isoformat(),
        "timezone": trigger.timezone, "cron": trigger.cron_expr, "runs_covered": runs,
    }}


def _spec(trigger: Trigger, payload: Any, *, source: str, source_ref: str, external_id: str | None,
          correlation_id: str = ""):
    from jobs.api import JobSpec

    common = dict(priority=trigger.priority, tenant=trigger.tenant, source=source, source_ref=source_ref,
                  external_id=external_id, correlation_id=correlation_id, created_by=trigger.created_by_id)
    if trigger.service_id is not None:
        return JobSpec(service=trigger.service, params=payload, **common)
    return JobSpec(workflow=_workflow_for(trigger), step_params=payload, **common)


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
               source: str = "app", now: datetime | None = None) -> EmitResult:
    """Record an application event and start the jobs of its triggers, in the caller's transaction.

    One savepoint per trigger: a trigger that cannot fire (missing context value, params that fail
    the service schema, inactive service...) records its error and the others still fire.
    """
    from jobs import api

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
            ctx = {**_base_context(trigger), "event": context}
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
                    job = api.start(_spec(trigger, payload, source=JobSource.EVENT, source_ref=source_ref,
                                          external_id=None, correlation_id=correlation_id))
            except (DefinitionError, LookupError, api.JobConflict, DatabaseError) as exc:
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
            data={"name": name, "tenant": tenant.slug, "context": context, "correlation_id": correlation_id,
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
    from jobs import api

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
    context = _schedule_context(trigger, expected, runs=runs)
    try:
        payload = render(trigger.payload_template, context)
        with transaction.atomic():
            job = api.start(_spec(trigger, payload, source=JobSource.SCHEDULE, source_ref=f"trigger:{trigger.id}",
                                  external_id=f"trigger:{trigger.id}:{expected.astimezone(UTC).isoformat()}"))
    except (TemplateError, DefinitionError, LookupError, api.JobConflict, DatabaseError) as exc:
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
    from jobs import api
    from jobs.verbs import ActionResult

    trigger = Trigger.objects.select_related("tenant", "workflow", "service").filter(pk=trigger_id).first()
    if trigger is None:
        return ActionResult(False, "no such trigger")
    if trigger.trigger_type != TriggerType.SCHEDULE:
        return ActionResult(False, f"event triggers start jobs when {trigger.event_name!r} is emitted; emit it instead")
    now = now or djtz.now()
    source = f"user:{by}" if by else "api"
    try:
        payload = render(trigger.payload_template, _schedule_context(trigger, now))
        with transaction.atomic():
            job = api.start(_spec(trigger, payload, source=JobSource.SCHEDULE, source_ref=f"trigger:{trigger.id}",
                                  external_id=f"trigger:{trigger.id}:now:{now.astimezone(UTC).isoformat()}"))
            write_events([_started_event(job, trigger, f"job started by 'run now' of schedule trigger "
                                                       f"{trigger.label!r}", source=source,
                                         data={"due_at": now.astimezone(UTC).isoformat(), "run_now": True})])
    except (TemplateError, DefinitionError, LookupError, ScheduleError, api.JobConflict) as exc:
        message = "; ".join(str(p) for p in exc.problems) if isinstance(exc, DefinitionError) else str(exc)
        return ActionResult(False, message)
    return ActionResult(True, f"job {str(job.id)[:8]} started")


__all__ = [
    "EmitResult", "Schedule", "ScheduleError", "TemplateError", "create_trigger", "fire_due_schedules", "fire_event",
    "payload_digest", "render", "run_now", "template_problems", "trigger_problems", "update_trigger", "zone",
]
