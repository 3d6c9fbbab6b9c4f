"""Triggers: application events and cron schedules that start jobs inside one tenant.

One concern per module: :mod:`~jobs.triggers.templates` (placeholders), :mod:`~jobs.triggers.schedule`
(cron in time zones), :mod:`~jobs.triggers.definitions` (validate and save), :mod:`~jobs.triggers.context`
(what a firing renders and starts), :mod:`~jobs.triggers.fire` (events, due schedules, run now). Jobs
are started through :mod:`jobs.enqueue`.

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

from jobs.triggers.definitions import INT32, TRIGGER_FIELDS, create_trigger, trigger_problems, update_trigger
from jobs.triggers.fire import (
                                DUE_SCHEDULES_SQL,
                                ON_TIME_GRACE,
                                RUNS_COUNT_LIMIT,
                                EmitResult,
                                fire_due_schedules,
                                fire_event,
                                run_now,
)
from jobs.triggers.schedule import CRON_ALIASES, DST_SLACK, MAX_SCAN, Schedule, ScheduleError, zone
from jobs.triggers.templates import (
                                MAX_TEMPLATE_DEPTH,
                                ONLY_PLACEHOLDER_RE,
                                PATH_RE,
                                PLACEHOLDER_RE,
                                TEMPLATE_NAMESPACES,
                                TemplateError,
                                payload_digest,
                                render,
                                template_problems,
)

__all__ = [
    "EmitResult", "Schedule", "ScheduleError", "TemplateError", "create_trigger", "fire_due_schedules", "fire_event",
    "payload_digest", "render", "run_now", "template_problems", "trigger_problems", "update_trigger", "zone",
    # Constants that were module-level names of jobs/triggers.py, kept importable from here
    "CRON_ALIASES", "DST_SLACK", "DUE_SCHEDULES_SQL", "INT32", "MAX_SCAN", "MAX_TEMPLATE_DEPTH", "ONLY_PLACEHOLDER_RE",
    "ON_TIME_GRACE", "PATH_RE", "PLACEHOLDER_RE", "RUNS_COUNT_LIMIT", "TEMPLATE_NAMESPACES", "TRIGGER_FIELDS",
]
