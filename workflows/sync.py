"""Compare the definitions in code (:mod:`workflows.code`) with the stored rows, and apply the difference.

Services are updated in place (their key is their identity). A workflow version is never edited:
when a workflow's steps, description or job cap differ from its latest version, the next version
is stored, so jobs of earlier versions finish on what they started with. A service or workflow
that code defined and no longer declares is deactivated, never deleted; deactivating a service
that unfinished jobs or triggers still name is destructive and needs ``allow_destructive``.

Everything is validated by :mod:`workflows.validation` (the admin's and the API's rules) before
anything is written, and each problem names the file and line of the declaration.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Field, Max

from workflows.code import Definitions, Origin, ServiceDef, WorkflowDef
from workflows.diff import steps_diff
from workflows.models import Service, Workflow, workflows_naming_service
from workflows.validation import DefinitionError, Problem, service_problems, service_users, step_problems

SERVICE_FIELDS = tuple(sorted({f.name for f in Service._meta.concrete_fields}
                              - {"id", "key", "created_at", "updated_at", "defined_in", "is_active"}))
#: One sync at a time: two would each compute the same next version number.
LOCK_KEY = 0x0ACC5_5C
_STEP_WHERE = re.compile(r"^step '(?P<key>.*)'$|^step #(?P<index>\d+)$")


@dataclass(frozen=True)
class Action:
    """One line of the plan: what happens to which definition, and why it may be refused."""

    kind: str  # "create", "change", "new version", "mark", "deactivate" or "unchanged"
    target: str  # "service shop-pack", "workflow ship-order v2"
    detail: str = ""
    origin: Origin | None = None
    destructive: str = ""  # why applying it loses something (empty: it does not)
    write: Callable[[], None] | None = None

    @property
    def changes(self) -> bool:
        return self.kind != "unchanged"

    def __str__(self) -> str:
        where = f"  ({self.origin.label})" if self.origin else ""
        detail = f": {self.detail}" if self.detail else ""
        danger = f"  [destructive: {self.destructive}]" if self.destructive else ""
        return f"{self.kind} {self.target}{detail}{where}{danger}"


@dataclass(frozen=True)
class Plan:
    """The actions that bring the database to the code, unchanged definitions included."""

    actions: tuple[Action, ...]

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.changes]

    @property
    def destructive(self) -> list[Action]:
        return [a for a in self.actions if a.destructive]


class DestructiveChange(Exception):
    """The plan would deactivate something still in use, and destructive changes were not allowed."""


# --------------------------------------------------------------------------------------------
# Validation, with the place of each declaration
# --------------------------------------------------------------------------------------------

def _placed(origin: Origin, what: str, problem: Problem | str) -> Problem:
    if isinstance(problem, Problem):
        return Problem(f"{origin.place}: {what} {problem.where}", problem.message)
    return Problem(f"{origin.place}: {what}", problem)


def _field_problems(instance: Service | Workflow, *, exclude: list[str]) -> list[Problem]:
    """Return the model fields' own checks (slug, choices, lengths, ranges) as problems."""
    try:
        instance.clean_fields(exclude=exclude)
    except ValidationError as exc:
        return [Problem(name, message) for name, messages in exc.message_dict.items() for message in messages]
    return []


def _service_row(definition: ServiceDef, stored: Service | None) -> tuple[Service, list[str]]:
    """Return the service row code wants (stored fields code does not set go back to their defaults)."""
    row = Service.objects.get(pk=stored.pk) if stored else Service(key=definition.key)
    unknown = sorted(set(definition.fields) - set(SERVICE_FIELDS) - {"is_active"})
    for name in SERVICE_FIELDS:
        model_field = cast("Field[Any, Any]", Service._meta.get_field(name))
        setattr(row, name, definition.fields.get(name, model_field.get_default()))
    row.is_active = definition.fields.get("is_active", True)
    row.defined_in = definition.origin.label
    return row, unknown


def _step_origin(definition: WorkflowDef, where: str) -> Origin:
    match = _STEP_WHERE.match(where)
    if match and match["key"] is not None:
        for item in definition.steps:
            if item.key == match["key"]:
                return item.origin
    if match and match["index"] is not None and 0 < int(match["index"]) <= len(definition.steps):
        return definition.steps[int(match["index"]) - 1].origin
    return definition.origin


def _steps(definition: WorkflowDef) -> list[dict[str, Any]]:
    return [dict(item.data) for item in definition.steps]


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

def _service_actions(definitions: Definitions, stored: dict[str, Service],
                     problems: list[Problem]) -> tuple[list[Action], dict[str, Service]]:
    """Return the services' actions and the services the workflows may name once they are applied."""
    actions: list[Action] = []
    known = dict(stored)
    for definition in definitions.services.values():
        current = stored.get(definition.key)
        row, unknown = _service_row(definition, current)
        where = f"service {definition.key!r}"
        problems += [_placed(definition.origin, where, f"unknown fields {unknown}")] if unknown else []
        problems += [_placed(definition.origin, where, p) for p in
                     _field_problems(row, exclude=["created_at", "updated_at"]) + service_problems(row)]
        known[definition.key] = row
        if current is None:
            actions.append(Action("create", f"service {definition.key}", row.executor, definition.origin,
                                  write=row.save))
            continue
        changed = [n for n in (*SERVICE_FIELDS, "is_active") if getattr(row, n) != getattr(current, n)]
        if changed:
            actions.append(Action("change", f"service {definition.key}", ", ".join(changed), definition.origin,
                                  write=row.save))
        elif row.defined_in != current.defined_in:
            detail = f"defined in code (was {current.defined_in or 'the admin'})"
            actions.append(Action("mark", f"service {definition.key}", detail, definition.origin, write=row.save))
        else:
            actions.append(Action("unchanged", f"service {definition.key}", origin=definition.origin))
    for key, current in stored.items():
        if current.defined_in and current.is_active and key not in definitions.services:
            # Only jobs and triggers lose something: workflows naming it are checked by the validator.
            naming = set(workflows_naming_service(key))
            users = [u for u in service_users(key) if u not in naming]
            gone = Service.objects.get(pk=current.pk)
            gone.is_active = False
            known[key] = gone
            actions.append(Action("deactivate", f"service {key}", f"no longer in code (was {current.defined_in})",
                                  destructive=", ".join(users),
                                  write=partial(gone.save, update_fields=["is_active", "updated_at"])))
    return actions, known


def _workflow_actions(definitions: Definitions, known: dict[str, Service],
                      problems: list[Problem]) -> list[Action]:
    actions: list[Action] = []
    latest_versions = dict(Workflow.objects.order_by().values_list("name").annotate(v=Max("version")))
    for definition in definitions.workflows.values():
        steps = _steps(definition)
        where = f"workflow {definition.name!r}"
        problems += [_placed(_step_origin(definition, p.where), where, p) for p in step_problems(steps, known)]
        version = latest_versions.get(definition.name)
        latest = Workflow.objects.get(name=definition.name, version=version) if version else None
        row = Workflow(name=definition.name, version=(version or 0) + 1, steps=steps,
                       description=definition.description, max_active_jobs=definition.max_active_jobs,
                       defined_in=definition.origin.label)
        problems += [_placed(definition.origin, where, p)
                     for p in _field_problems(row, exclude=["id", "steps", "created_at", "updated_at"])]
        if latest is None or (latest.steps, latest.description, latest.max_active_jobs) != (
                row.steps, row.description, row.max_active_jobs):
            detail = (f"{len(steps)} steps" if latest is None else
                      "; ".join(f"step {c.key} {c.change}" for c in steps_diff(latest.steps, steps))
                      or "description or max_active_jobs changed")
            actions.append(Action("new version" if latest else "create", f"workflow {row}", detail,
                                  definition.origin, write=row.save))
        elif latest.defined_in != row.defined_in or not latest.is_active:
            # Where it is written and whether it may start are not what jobs ran: the version keeps its steps.
            detail = f"defined in code (was {latest.defined_in or 'the admin'})" + (
                "" if latest.is_active else ", active again")
            latest.defined_in, latest.is_active = row.defined_in, True
            actions.append(Action("mark", f"workflow {latest}", detail, definition.origin,
                                  write=partial(latest.save, update_fields=["defined_in", "is_active", "updated_at"])))
        else:
            actions.append(Action("unchanged", f"workflow {latest}", origin=definition.origin))
    gone = (Workflow.objects.exclude(defined_in="").filter(is_active=True)
            .exclude(name__in=list(definitions.workflows)).order_by("name", "version"))
    for stale in gone:
        stale.is_active = False
        actions.append(Action("deactivate", f"workflow {stale}", f"no longer in code (was {stale.defined_in})",
                              write=partial(stale.save, update_fields=["is_active", "updated_at"])))
    return actions


def plan(definitions: Definitions) -> Plan:
    """Return what applying ``definitions`` would do; raise DefinitionError (nothing written) if invalid."""
    problems = [Problem(f"{second.place}: {what}", f"declared again (first at {first.place})")
                for what, first, second in definitions.duplicates]
    stored = {s.key: s for s in Service.objects.all()}
    service_actions, known = _service_actions(definitions, stored, problems)
    workflow_actions = _workflow_actions(definitions, known, problems)
    if problems:
        raise DefinitionError(problems)
    return Plan(tuple(service_actions + workflow_actions))


def apply(definitions: Definitions, *, allow_destructive: bool = False) -> Plan:
    """Validate, plan and write ``definitions`` in one transaction; return the plan applied.

    Raise DefinitionError when a definition is invalid and DestructiveChange when the plan would
    deactivate a service still in use without ``allow_destructive``; nothing is written then.
    """
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK_KEY])
        planned = plan(definitions)
        if planned.destructive and not allow_destructive:
            raise DestructiveChange("; ".join(str(a) for a in planned.destructive))
        for action in planned.changes:
            assert action.write is not None
            action.write()
    return planned
