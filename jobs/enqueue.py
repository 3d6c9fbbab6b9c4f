"""Creating jobs: the one place a job is planned, validated and inserted.

:mod:`jobs.api` publishes these verbs; triggers and the Tasks backend call them here. Everything
runs inside the caller's transaction: a job exists if and only if the caller commits, and the
NOTIFY that wakes builders and agents is delivered at that commit. Params are validated against
the services' JSON Schemas before anything is written.

Two insert paths, built from one column list (:data:`JOB_COLUMNS`) so they cannot drift apart:

* :data:`START_NOW_SQL` starts a job that is due, needs no approval, is under no cap and has no
  fan-out step in ONE statement (job row already ``waiting``, its tasks, step counts, its one creation
  event, NOTIFY);
* :data:`INSERT_JOBS_SQL` inserts ``queued`` jobs in batches (:func:`start_many`, and every other
  :func:`start`); the builder admits and instantiates them (:mod:`jobs.admission`), or the caller's
  transaction does at once when nothing needs deciding.

Idempotency: a repeated ``external_id`` (per tenant) returns the existing job, also under
concurrent duplicates (the unique index decides; ``job.was_created`` tells which). A ``dedupe_key``
held by a queued or running job of the tenant raises :class:`JobConflict` naming that job. A fan-out
job with no host to run on raises :class:`NoHostsError` (see ``docs/api.md``, "Fan-out hosts").
"""

from __future__ import annotations

import functools
import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import jsonschema_rs
import psycopg
from django.db import connection, transaction
from django.utils import timezone
from referencing.exceptions import Unresolvable

from accs_site.conf import accs
from events.timeline import CREATED, created_tasks, creation_level, creation_message
from jobs.admission import read_hosts, start_jobs
from jobs.definitions import definitions
from jobs.ids import uuid7, uuid7_many
from jobs.instantiate import (
    InstantiationError,
    JobRow,
    ServiceInfo,
    build_task_rows,
    params_json,
    select_hosts,
    step_rows,
    steps_for,
)
from jobs.models import JOB_ACTIVE, ApprovalState, Job, JobSource, JobStatus, TaskStatus
from jobs.narrow import CREATIONS_SQL, WIDEN_FUNCTION, WIDENED
from jobs.notify import builder_channel, not_yet_notified, notify, service_channel
from jobs.sql import bind_params, query_function_sql
from tenants.models import DEFAULT_TENANT_SLUG, Tenant
from workflows.models import Service, Workflow
from workflows.validation import DefinitionError, Problem, validator_errors

INT32 = 2**31 - 1


class JobConflict(Exception):
    """Another queued/running job of the tenant holds the dedupe key; ``job_id`` names it."""

    def __init__(self, dedupe_key: str, job_id: UUID) -> None:
        self.dedupe_key = dedupe_key
        self.job_id = job_id
        super().__init__(f"dedupe_key {dedupe_key!r} is held by active job {job_id}")


class NotFound(LookupError):
    """A named workflow, service or tenant does not exist (or is not active)."""


class NoHostsError(DefinitionError):
    """A fan-out step has no host to run on (none given, or a selector that matches none); nothing is written.

    ``problems`` names the step and the option, and every other problem of the spec.
    """


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
    #: Users (ids) who may not approve the job besides ``created_by`` (a trigger's creator and editor).
    approval_barred: tuple[int, ...] = ()


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
        lookup: dict[str, UUID | str] = {"id": UUID(str(tenant))}
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

if TYPE_CHECKING:  # the pure-Python validator is imported for invalid params only (daemons start without it)
    from jsonschema import Draft202012Validator


class _Validators:
    """Per-call caches: compiled JSON Schema validators and resolved targets (bulk starts reuse them).

    Params are checked with jsonschema_rs (compiled, fast); only invalid params go through the
    pure-Python jsonschema, whose messages match the ones workflow validation gives.
    """

    def __init__(self) -> None:
        self._fast: dict[int, Any] = {}
        self._slow: dict[int, Draft202012Validator] = {}
        self._resolved: dict[tuple, Any] = {}

    def resolved(self, kind: str, key: Any, resolve: Callable[..., Any], *args: Any) -> Any:
        """Resolve ``key`` once per call (tenant, workflow, service lookups)."""
        cache_key = (kind, key if isinstance(key, (str, UUID, int, type(None))) else id(key), *args)
        if cache_key not in self._resolved:
            self._resolved[cache_key] = resolve(key, *args)
        return self._resolved[cache_key]

    def accepts(self, service: Service, params: dict[str, Any]) -> bool:
        """Whether the service's schema accepts ``params`` (False also when it cannot be applied)."""
        try:
            fast = self._fast.get(service.id)
            if fast is None:
                fast = self._fast[service.id] = _compiled(service)
            return bool(fast.is_valid(params))
        except (Unresolvable, RecursionError, LookupError, ValueError, TypeError):
            return False

    def errors(self, service: Service, params: dict[str, Any]) -> list[str]:
        try:
            fast = self._fast.get(service.id)
            if fast is None:
                fast = self._fast[service.id] = _compiled(service)
            if fast.is_valid(params):
                return []
            slow = self._slow.get(service.id)
            if slow is None:
                from jsonschema import Draft202012Validator

                slow = self._slow[service.id] = Draft202012Validator(service.params_schema or {})
            return validator_errors(slow, params)
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
    job_id: UUID = field(default_factory=uuid7)  # drawn afresh by each insert attempt (see _insert)


def _fan_out_steps(steps: list[dict[str, Any]]) -> list[str]:
    return [step["key"] for step in steps if step.get("fan_out") == "hosts"]


def _missing_hosts(steps: list[dict[str, Any]], options: dict[str, Any]) -> list[Problem]:
    """Return the problem of fan-out steps started with no host named and no selector (empty ones included).

    Which hosts a selector matches is known only when the job's tasks are built, see :func:`_check_selector`.
    """
    fan_out = _fan_out_steps(steps)
    hosts, selector = options.get("hosts"), options.get("host_selector")
    if not fan_out or hosts or selector:
        return []  # hosts or a selector given (one of the wrong type is reported as such)
    given = "an empty options.hosts" if hosts is not None else (
        "an empty options.host_selector" if selector is not None else "no options.hosts or options.host_selector")
    return [Problem("options.hosts", f"step {', '.join(map(repr, fan_out))} fans out over hosts but the job was "
                                     f"started with {given}; name the hosts or give a host_selector")]


def params_too_large(params: dict[str, Any]) -> str:
    """Return why a task cannot be started with ``params`` (more than ``ACC_MAX_PARAMS_BYTES`` of JSON), or ""."""
    limit = accs.max_params_bytes
    try:
        size = len(params_json(params).encode())
    except (TypeError, ValueError):
        return ""  # not JSON at all: the schema check and the insert say so, as for any start
    if size <= limit:
        return ""
    return (f"params are {size:,} bytes of JSON, more than the limit of {limit:,} bytes (ACC_MAX_PARAMS_BYTES); "
            "pass large inputs as artifacts (ACCS_INPUT_DIR) rather than params")


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
        too_large = params_too_large(merged)
        if too_large:
            problems.append(Problem(f"step '{step['key']}' params", too_large))
            continue  # a schema is not worth applying to params that cannot be started
        for err in validators.errors(svc, merged):
            problems.append(Problem(f"step '{step['key']}' params", err))
    options = spec.options or {}
    no_hosts: list[Problem] = []
    if not isinstance(options, dict):
        problems.append(Problem("options", "must be an object"))
    else:
        hosts = options.get("hosts")
        if hosts is not None and (not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts)):
            problems.append(Problem("options.hosts", "must be a list of host names"))
        selector = options.get("host_selector")
        if selector is not None and not isinstance(selector, dict):
            problems.append(Problem("options.host_selector", 'must be an object of labels, e.g. {"rack": "a"}'))
        no_hosts = _missing_hosts(steps, options)
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
    if no_hosts:
        raise NoHostsError(problems + no_hosts)
    if problems:
        raise DefinitionError(problems)
    approval = ApprovalState.PENDING if any(s.requires_approval for s in involved) else ApprovalState.NOT_REQUIRED
    return _Plan(spec, tenant, workflow, service, step_params, approval, involved, tenant.clamp_priority(spec.priority))


# --------------------------------------------------------------------------------------------
# The job row: one column list for both insert paths
# --------------------------------------------------------------------------------------------

# Every column a new job row is written with, in one order, and where its value comes from:
# ``{name}`` is a field of the row :func:`_job_fields` builds (a recordset column in the batch
# insert, a bound parameter in the one-statement start); anything else is SQL as written. Both
# insert statements below are built from this table, so they cannot drift apart.
JOB_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "{id}"), ("tenant_id", "{tenant}"), ("workflow_id", "{wf}"), ("service_id", "{svc}"),
    ("status", "'queued'"), ("progress", "0"), ("current_task_key", "''"), ("priority", "{prio}"),
    ("options", "coalesce({opts}, '{{}}')"), ("step_params", "{sp}"), ("scheduled_at", "coalesce({sched}, now())"),
    ("error_code", "''"), ("error_message", "''"), ("source", "{src}"), ("source_ref", "{sref}"),
    ("external_id", "{ext}"), ("dedupe_key", "{dk}"), ("correlation_id", "{corr}"), ("approval_state", "{appr}"),
    ("approved_by", "''"), ("created_by_id", "{cby}"), ("created_at", "now()"), ("updated_at", "now()"),
    ("started_at", "NULL"), ("approval_barred", "{barred}"),
)
# The fields of a new job's row and their SQL types.
JOB_FIELDS: dict[str, str] = {
    "id": "uuid", "tenant": "uuid", "wf": "uuid", "svc": "bigint", "prio": "int", "opts": "jsonb", "sp": "jsonb",
    "sched": "timestamptz", "src": "text", "sref": "text", "ext": "text", "dk": "text", "corr": "text",
    "appr": "text", "cby": "int", "barred": "int[]",
}


def insert_job_sql(read: Callable[[str], str], *, order_seq: str | None = None, **fixed: str) -> str:
    """Return ``INSERT INTO accs_job (<every column>) SELECT <their values>`` for one insert path.

    ``read(name)`` says how the path reads a field of the row (``r.tenant``, ``%(tenant)s::uuid``);
    ``fixed`` gives a column SQL of the path's own instead (the one-statement start writes its job
    already ``waiting``, with its first task named). ``order_seq``: the job's place in the global
    order, when the path took it already (a widened narrow start); otherwise the column's default
    draws it.
    """
    unknown = sorted(set(fixed) - {column for column, _ in JOB_COLUMNS})
    if unknown:
        raise ValueError(f"no job column {unknown}")
    fields = {name: read(name) for name in JOB_FIELDS}
    columns = ", ".join(column for column, _ in JOB_COLUMNS)
    values = ", ".join(fixed.get(column, value.format(**fields)) for column, value in JOB_COLUMNS)
    if order_seq is not None:
        columns, values = f"{columns}, order_seq", f"{values}, {order_seq}"
    return f"{_wrap(f'INSERT INTO accs_job ({columns})', 22)}\n{_wrap(f'SELECT {values}', 7)}"


def _wrap(sql: str, indent: int) -> str:
    """Wrap generated SQL at 116 characters, so it reads well in pg_stat_statements and logs."""
    return textwrap.fill(sql, width=116, subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False)


def _job_fields(plan: _Plan, jid: UUID, *, for_json: bool) -> dict[str, Any]:
    """Return the fields of a new job's row (the ``{name}`` values of :data:`JOB_COLUMNS`).

    ``for_json``: for the batch insert's JSON document (ids as hex, options as objects), built
    directly in that shape because bulk starts encode thousands; otherwise bound parameters of
    the one-statement start (ids as UUIDs, options as JSON text).
    """
    spec = plan.spec
    wf = plan.workflow.id if plan.workflow else None
    ids: tuple[str | UUID, str | UUID, str | UUID | None]
    opts: dict[str, Any] | str
    sp: dict[str, dict[str, Any]] | str
    if for_json:
        ids = (jid.hex, plan.tenant.id.hex, wf.hex if wf else None)
        opts, sp = spec.options or {}, plan.step_params
        sched: Any = spec.scheduled_at.isoformat() if spec.scheduled_at else None
    else:
        ids = (jid, plan.tenant.id, wf)
        opts, sp = json.dumps(spec.options or {}), json.dumps(plan.step_params)
        sched = spec.scheduled_at
    return {
        "id": ids[0], "tenant": ids[1], "wf": ids[2], "svc": plan.service.id if plan.service else None,
        "prio": plan.priority, "opts": opts, "sp": sp, "sched": sched, "src": str(spec.source),
        "sref": spec.source_ref, "ext": spec.external_id, "dk": spec.dedupe_key, "corr": spec.correlation_id,
        "appr": str(plan.approval), "cby": getattr(spec.created_by, "pk", spec.created_by),
        "barred": sorted(set(spec.approval_barred)) or None,
    }


# --------------------------------------------------------------------------------------------
# Starting jobs: the batch insert (queued; the builder or the caller instantiates)
# --------------------------------------------------------------------------------------------

INSERT_JOBS_SQL = """
-- One JSON document carries the whole batch (cheaper to build and to parse than a dozen arrays).
-- Times come from PostgreSQL's clock; each new job writes its "created" event in the same statement.
WITH ins AS (
""" + insert_job_sql(lambda name: f"r.{name}") + """
""" + _wrap("  FROM jsonb_to_recordset(%(rows)s::jsonb) AS r("
             + ", ".join(f"{name} {kind}" for name, kind in JOB_FIELDS.items()) + ")", 7) + """
-- Idempotency: a duplicate external_id or active dedupe_key inserts nothing; the caller then
-- finds the job that holds it. No exception, so the caller's transaction stays usable.
ON CONFLICT DO NOTHING
RETURNING id, approval_state, source
), ev AS (
INSERT INTO accs_event (job_id, source, level, type, message, data)
SELECT id, 'api:' || source, 'info', 'status',
       CASE WHEN approval_state = 'pending' THEN 'job created queued, waiting for approval'
            ELSE 'job created queued' END,
       jsonb_build_object('from', 'created', 'to', 'queued', 'approval', approval_state) FROM ins
)
SELECT id FROM ins
"""


def _insert(plans: Sequence[_Plan]) -> set[UUID]:
    rows = []
    for plan in plans:
        plan.job_id = jid = uuid7()
        rows.append(_job_fields(plan, jid, for_json=True))
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
        found = (Job.objects.filter(tenant=plan.tenant, external_id=spec.external_id)
                 .values_list("id", flat=True).first())
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


def _check_selector(plan: _Plan) -> None:
    """Refuse a fan-out job whose host selector matches no host, for a job instantiated in this call.

    Only then is the outcome known at start: a job that waits (scheduled, approval, a cap) gets
    its hosts when the builder admits it, and fails then with ``no_hosts`` if none match.
    """
    steps = plan.workflow.steps if plan.workflow else []
    options = plan.spec.options or {}
    fan_out = _fan_out_steps(steps)
    selector = options.get("host_selector")
    if not fan_out or options.get("hosts") or not selector:
        return
    with connection.cursor() as cur:
        if select_hosts(options, read_hosts(cur)):
            return
    raise NoHostsError([Problem("options.host_selector", f"{json.dumps(selector, sort_keys=True, default=str)} "
                                                         f"matches no host, so step "
                                                         f"{', '.join(map(repr, fan_out))} has nothing to run on")])


# --------------------------------------------------------------------------------------------
# Starting jobs: one statement for a job that runs now
# --------------------------------------------------------------------------------------------

START_NOW_SQL = """
-- A job that is due now, needs no approval and is under no cap starts in ONE statement: the job
-- row (already admitted: waiting), its tasks, its step counts, its events and the wake-up of the agents.
-- A conflicting external_id or dedupe_key inserts nothing at all (the caller then finds the
-- holder): every part below reads from the job insert's RETURNING.
WITH j AS (
""" + insert_job_sql(lambda name: f"%({name})s::{JOB_FIELDS[name]}", status="'waiting'",
                     current_task_key="%(first_key)s", started_at="now()") + """
    ON CONFLICT DO NOTHING
    RETURNING id, order_seq, created_at, scheduled_at
), t AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT r.id, j.id, %(tenant)s, r.task_key, r.step_key, r.service_id, NULL, r.exclusive, r.status,
           ARRAY(SELECT jsonb_array_elements_text(r.depends_on)), 0, r.max_attempts, now(), r.priority, j.order_seq,
           r.timeout_seconds, r.params, '', '', '', '', '', now(), now()
      FROM j, jsonb_to_recordset(%(tasks)s::jsonb) AS r(
           id uuid, task_key text, step_key text, service_id bigint, exclusive boolean, status text,
           depends_on jsonb, max_attempts int, priority int, timeout_seconds int, params jsonb)
    RETURNING id, task_key, status
), s AS (
    INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked,
                               released, poisoned, on_failure, always, max_items)
    SELECT j.id, r.step_key, r.position, r.total, 0, 0, 0, 0, 0, false, false, r.on_failure, r.always, r.max_items
      FROM j, jsonb_to_recordset(%(steps)s::jsonb) AS r(step_key text, position int, total int, on_failure text,
                                                       always boolean, max_items int)
), ev AS (
    -- ONE row records the job's creation with its tasks (events.timeline.creation_event's shape):
    -- the job's move, each task's id, key and first status in data.tasks; readers unfold it.
    INSERT INTO accs_event (job_id, source, level, type, message, data)
    SELECT j.id, %(source)s, %(level)s, 'status', %(message)s, %(event_data)s::jsonb FROM j
), n AS (
    SELECT pg_notify(c, '') FROM unnest(%(channels)s::text[]) AS c
)
SELECT j.id, j.order_seq, j.created_at, j.scheduled_at, (SELECT count(*) FROM n) FROM j
"""


# The statement above as a server-side function, created by a migration: PostgreSQL plans it once per
# server connection (PL/pgSQL caches its plans) instead of at every start. Django's connection
# prepares nothing (its psycopg ``prepare_threshold`` is None, for poolers), so the statement sent
# as it is was planned at every call: 0.33-0.46 ms of the server's 1.0-1.3 ms per start. Nothing
# here is session state a pooler could lose: the function lives in the database, and a server
# connection that never ran it plans it at its first call.
START_FUNCTION = "accs_start_now"

# Its arguments: the statement's parameters with their SQL types, in this order.
START_ARGS: dict[str, str] = {
    **JOB_FIELDS, "first_key": "text", "tasks": "jsonb", "steps": "jsonb", "source": "text", "level": "text",
    "message": "text", "event_data": "jsonb", "channels": "text[]",
}

# The call, each argument cast to its type (a list of small ints is sent as int2[], say).
START_CALL_SQL = (f"SELECT * FROM {START_FUNCTION}("
                  + ", ".join(f"%({name})s::{kind}" for name, kind in START_ARGS.items()) + ")")


def _statement_function_sql(name: str, statement: str, args: dict[str, str], returns: str) -> str:
    """Return the CREATE FUNCTION statement of a start ``statement`` whose parameters are ``args``."""
    body = bind_params(statement, {arg: f"p_{arg}" for arg in args}).strip()
    # Each "name type" kept on one line (no-break spaces while the lines are filled).
    listed = ", ".join(f"p_{arg}\u00a0{kind}" for arg, kind in args.items())
    listed = textwrap.fill(listed, 116, initial_indent="    ", subsequent_indent="    ").replace("\u00a0", " ")
    return query_function_sql(name, f"\n{listed}", returns, body, volatility="VOLATILE", tag="start")


def start_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`START_FUNCTION`, built from START_NOW_SQL.

    A migration holds a copy; a test compares the database's function with this text.
    """
    return _statement_function_sql(
        START_FUNCTION, START_NOW_SQL, START_ARGS,
        "TABLE (id uuid, order_seq bigint, created_at timestamptz, scheduled_at timestamptz, notified bigint)")


# A start on the narrow path (jobs.narrow): one row of accs_start and the agents' wake-up, nothing
# else. The row takes its place in the global order (order_seq) and its creation time now, as a
# job row would; widening gives both to the job, task and event it becomes. Its columns are the ones
# the batch insert below writes too.
_INSERT_START = """
    INSERT INTO accs_start (id, task_id, tenant_id, service_id, priority, job_priority, params, source, source_ref,
                            correlation_id, created_by_id, created_at)"""
NARROW_START_SQL = """
WITH s AS (""" + _INSERT_START + """
    VALUES (%(id)s, %(task_id)s, %(tenant)s, %(svc)s, %(priority)s, %(job_priority)s, %(params)s, %(src)s,
            %(sref)s, %(corr)s, %(cby)s, now())
    RETURNING order_seq, created_at
), n AS (
    SELECT pg_notify(c, '') FROM unnest(%(channels)s::text[]) AS c
)
SELECT s.order_seq, s.created_at, (SELECT count(*) FROM n) FROM s
"""
NARROW_START_FUNCTION = "accs_start_narrow"
NARROW_START_ARGS: dict[str, str] = {
    "id": "uuid", "task_id": "uuid", "tenant": "uuid", "svc": "bigint", "priority": "int", "job_priority": "int",
    "params": "jsonb", "src": "text", "sref": "text", "corr": "text", "cby": "int", "channels": "text[]",
}
NARROW_START_CALL_SQL = (f"SELECT * FROM {NARROW_START_FUNCTION}("
                         + ", ".join(f"%({name})s::{kind}" for name, kind in NARROW_START_ARGS.items()) + ")")


# Many narrow starts in one statement (start_many): one JSON document carries the rows, each takes its
# place in the global order in the order given.
INSERT_NARROW_SQL = """
WITH s AS (""" + _INSERT_START + """
    SELECT r.id, r.task_id, r.tenant, r.svc, r.priority, r.job_priority, r.params, r.src, r.sref, r.corr, r.cby, now()
      FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb) AS (
           id uuid, task_id uuid, tenant uuid, svc bigint, priority int, job_priority int, params jsonb, src text,
           sref text, corr text, cby int)) WITH ORDINALITY AS r
     ORDER BY r.ordinality
    RETURNING 1
)
SELECT count(*) FROM s
"""


def narrow_start_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`NARROW_START_FUNCTION`, built from NARROW_START_SQL."""
    return _statement_function_sql(NARROW_START_FUNCTION, NARROW_START_SQL, NARROW_START_ARGS,
                                   "TABLE (order_seq bigint, created_at timestamptz, notified bigint)")


def insert_and_start(*, job: dict[str, Any], tasks: list[dict[str, Any]], channels: Sequence[str],
                     source: str) -> tuple | None:
    """Insert and start one job in one statement; return (id, order_seq, created_at, scheduled_at).

    ``job`` holds the fields of :func:`_job_fields` (as bound parameters). None means
    the job's external_id or dedupe_key is taken: nothing was written. The caller checked that the
    job is due, needs no approval and is under no cap, and built its tasks with
    :func:`jobs.instantiate.build_task_rows` (no fan-out: hosts are resolved by the builder path).
    """
    first_key = min(tasks, key=lambda r: r["position"])["task_key"] if tasks else ""
    created = created_tasks(tasks)
    statuses = [t["to"] for t in created]
    params = {**job, "first_key": first_key, "tasks": json.dumps(tasks, default=str),
              "steps": json.dumps(step_rows(tasks)), "channels": not_yet_notified(channels), "source": source,
              "message": creation_message(CREATED, statuses), "level": creation_level(statuses),
              "event_data": json.dumps({"from": CREATED, "to": "waiting", "approval": "not_required",
                                        "tasks": created})}
    # The statement runs as its server-side function (planned once per server connection), on
    # Django's own connection, so in the caller's transaction.
    connection.ensure_connection()
    # Server-side binding (Django's cursors bind client-side); errors are still Django's.
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cur:
        cur.execute(START_CALL_SQL, params)
        return cur.fetchone()


def _is_narrow(plan: _Plan) -> bool:
    """Whether the start needs nothing decided before it runs, so it may be one narrow row (jobs.narrow).

    A one-task service job, due now (no scheduled time given), with no idempotency key, approval,
    options or tenant cap, of an active service without a rate or per-key limit (those are claimed
    by the keyed path, which does not widen), on a site that turned narrow starts on.
    """
    spec, service = plan.spec, plan.service
    return (accs.narrow_starts and service is not None and service.is_active
            and spec.external_id is None and spec.dedupe_key is None and spec.scheduled_at is None
            and not spec.options and plan.approval != ApprovalState.PENDING and not plan.tenant.max_in_flight
            and not (service.rate_limit or service.rate_key_limit or service.concurrency_key_limit))


def _narrow_row(plan: _Plan) -> dict[str, Any]:
    """Return the start row of a narrow start (the arguments of :data:`NARROW_START_SQL`), drawing its ids."""
    spec, service = plan.spec, plan.service
    assert service is not None
    plan.job_id, task_id = uuid7_many(2)
    return {"id": plan.job_id, "task_id": task_id, "tenant": plan.tenant.id, "svc": service.id,
            "priority": plan.priority + service.base_priority, "job_priority": plan.priority,
            "params": params_json(plan.step_params[service.key]), "src": str(spec.source), "sref": spec.source_ref,
            "corr": spec.correlation_id, "cby": getattr(spec.created_by, "pk", spec.created_by)}


def _start_narrow(plan: _Plan) -> Job:
    """Start a job on the narrow path: one row of accs_start, in the caller's transaction."""
    service = plan.service
    assert service is not None
    call = _narrow_row(plan)
    call["channels"] = not_yet_notified([service_channel(service.key)])
    jid, cby = plan.job_id, call["cby"]
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cur:
        cur.execute(NARROW_START_CALL_SQL, call)
        row = cur.fetchone()
    assert row is not None, "the narrow start's insert answers its row"
    order_seq, created_at = row[:2]
    return _built_job(plan, jid=jid, order_seq=order_seq, created_at=created_at, scheduled_at=created_at,
                      current_task_key=service.key, created_by=cby, barred=None)


@functools.cache
def _job_attnames() -> list[str]:
    """The job table's columns in the model's field order (what :meth:`Job.from_db` takes)."""
    return [f.attname for f in Job._meta.concrete_fields]


def _start_now(plan: _Plan) -> Job | None:
    """Start a job that runs now in one statement; None when the general path must decide.

    Taken for a job that is due, needs no approval, has no cap and no fan-out step. None also
    when its external_id or dedupe_key is taken (nothing was written then).
    """
    spec = plan.spec
    steps = plan.workflow.steps if plan.workflow else None
    if steps and _fan_out_steps(steps):
        return None
    services = {s.key: ServiceInfo(s.id, s.key, s.base_priority, s.max_attempts, s.timeout_seconds,
                                   s.exclusive_per_host) for s in plan.services if s.is_active}
    jid = uuid7()
    row = JobRow(jid, plan.tenant.id, plan.workflow.id if plan.workflow else None,
                 plan.service.id if plan.service else None, plan.priority, 0, spec.options or {}, plan.step_params)
    try:
        tasks = build_task_rows(row, steps_for(row, steps, plan.service.key if plan.service else None), services,
                                hosts=[], blocked=set())
    except InstantiationError:
        return None  # the general path fails the job with the reason
    for task in tasks:
        task["id"] = str(task["id"])
    channels = {service_channel(key) for key in services if any(
        t["status"] == TaskStatus.QUEUED and t["service_id"] == services[key].id for t in tasks)}
    fields = _job_fields(plan, jid, for_json=False)
    inserted = insert_and_start(job=fields, tasks=tasks, channels=sorted(channels), source=f"api:{spec.source}")
    if inserted is None:
        return None
    jid, order_seq, created_at, scheduled_at = inserted[:4]
    return _built_job(plan, jid=jid, order_seq=order_seq, created_at=created_at, scheduled_at=scheduled_at,
                      current_task_key=min(tasks, key=lambda r: r["position"])["task_key"],
                      created_by=fields["cby"], barred=fields["barred"])


def _built_job(plan: _Plan, *, jid: UUID, order_seq: int, created_at: datetime, scheduled_at: datetime,
               current_task_key: str, created_by: int | None, barred: list[int] | None) -> Job:
    """Return a job a start wrote already admitted (``waiting``), read from nothing.

    The values the statement answered (its id, place in the global order and times) and the rest from
    the plan. Built as a row read from the database is (positional values, no keyword or relation
    handling: half the cost of the keyword constructor), with its tenant, workflow and service attached.
    """
    spec = plan.spec
    values = {
        "id": jid, "tenant_id": plan.tenant.id, "workflow_id": plan.workflow.id if plan.workflow else None,
        "service_id": plan.service.id if plan.service else None, "status": JobStatus.WAITING, "progress": 0.0,
        "current_task_key": current_task_key, "priority": plan.priority, "order_seq": order_seq,
        "options": spec.options or {}, "step_params": plan.step_params, "scheduled_at": scheduled_at,
        "error_code": "", "error_message": "", "source": spec.source, "source_ref": spec.source_ref,
        "external_id": spec.external_id, "dedupe_key": spec.dedupe_key, "correlation_id": spec.correlation_id,
        "approval_state": ApprovalState.NOT_REQUIRED, "approved_by": "", "approved_at": None,
        "created_by_id": created_by, "created_at": created_at, "started_at": created_at, "finished_at": None,
        "updated_at": created_at, "approval_barred": barred,
    }
    job = Job.from_db("default", _job_attnames(), [values[name] for name in _job_attnames()])
    job._state.fields_cache.update(tenant=plan.tenant, workflow=plan.workflow, service=plan.service)
    job.was_created = True
    return job


# --------------------------------------------------------------------------------------------
# Widening narrow starts (jobs.narrow): the job rows they become are inserted here too
# --------------------------------------------------------------------------------------------

# The job row of a widened start: the columns of every job insert (jobs.enqueue.JOB_COLUMNS), read
# from the start and its service.
_JOB_FIELD_SQL = {
    "id": "g.id", "tenant": "g.tenant_id", "wf": "NULL::uuid", "svc": "g.service_id", "prio": "g.job_priority",
    "opts": "'{}'::jsonb", "sp": "jsonb_build_object(g.svc_key, g.params)", "sched": "g.created_at",
    "src": "g.source", "sref": "g.source_ref", "ext": "NULL::text", "dk": "NULL::text", "corr": "g.correlation_id",
    "appr": "'not_required'", "cby": "g.created_by_id", "barred": "NULL::int[]",
}


def widen_sql() -> str:
    """Return the statement that widens the starts in ``v_ids``, which the statement before it locked.

    What each start becomes is what the one-statement start writes for a one-task service job: the
    job already admitted (waiting, its task named current, stamped at the start's creation), and its
    task queued with the service's attempts, timeout and exclusivity as they are now, and its one
    step row. Its creation event is written after it (jobs.narrow.CREATIONS_SQL), or carried by the
    claim's row of its task. The statement answers the ids of the jobs it made.
    """
    return """WITH gone AS (
    DELETE FROM accs_start s WHERE s.id = ANY(v_ids)
    RETURNING s.id, s.task_id, s.tenant_id, s.service_id, s.priority, s.job_priority, s.order_seq, s.params,
              s.source, s.source_ref, s.correlation_id, s.created_by_id, s.created_at
), g AS (
    SELECT gone.*, sv.key::text AS svc_key, sv.exclusive_per_host, sv.max_attempts, sv.timeout_seconds
      FROM gone JOIN accs_service sv ON sv.id = gone.service_id
), j AS (
""" + insert_job_sql(lambda name: _JOB_FIELD_SQL[name], order_seq="g.order_seq", status="'waiting'",
                     current_task_key="g.svc_key", started_at="g.created_at", created_at="g.created_at") + """
      FROM g
    RETURNING id
), t AS (
    INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, host_id, exclusive, status,
                           depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds,
                           params, assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)
    SELECT g.task_id, j.id, g.tenant_id, g.svc_key, g.svc_key, g.service_id, NULL, g.exclusive_per_host, 'queued',
           '{}', 0, g.max_attempts, g.created_at, g.priority, g.order_seq, g.timeout_seconds, g.params,
           '', '', '', '', '', g.created_at, now()
      FROM g JOIN j ON j.id = g.id
), st AS (
    INSERT INTO accs_job_step (job_id, step_key, position, total, done, error, skipped, canceled, blocked,
                               released, poisoned, on_failure, always, max_items)
    SELECT j.id, g.svc_key, 0, 1, 0, 0, 0, 0, 0, false, false, 'fail_job', false, NULL
      FROM g JOIN j ON j.id = g.id
)
""" + WIDENED


def widen_function_sql() -> str:
    """Return the CREATE FUNCTION statement of :data:`WIDEN_FUNCTION`.

    ``accs_widen_starts(ids, services, per_queue, before, limit, events)`` widens, by the first
    argument given: the starts ``ids`` (waiting for a start another transaction is widening: it is a
    job once that commits), the first ``per_queue`` starts of each of ``services`` per tenant in the
    claim's order, or up to ``limit`` starts created before ``before``. Those two pass over a start
    another transaction holds. With ``events`` it writes the jobs' creation rows (the plain claim
    passes false: its rows carry them). It answers the ids of the jobs it made. A migration holds a
    copy; a test compares the database's function with this text.
    """
    widen = widen_sql().replace(WIDENED, WIDENED.replace(" FROM g", " INTO v_widened FROM g"))
    return f"""CREATE OR REPLACE FUNCTION {WIDEN_FUNCTION}(
    p_ids uuid[], p_svc_ids bigint[], p_per_queue int, p_before timestamptz, p_limit int, p_events boolean)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
-- One plan per server connection (see jobs.claim's claim function); every statement reads rows by
-- the ids and index order it is given.
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $widen$
DECLARE
    v_ids uuid[];
    v_widened uuid[];
BEGIN
    IF p_ids IS NOT NULL THEN
        -- Locked in id order, waited for: one lock order for every widening that waits.
        v_ids := ARRAY(SELECT s.id FROM accs_start s WHERE s.id = ANY(p_ids) ORDER BY s.id FOR UPDATE);
    ELSIF p_svc_ids IS NOT NULL THEN
        -- Each service's tenants with starts, by a skip scan of start_claim_idx (one descent per
        -- tenant), then each tenant's first starts in the claim's order (priority, then order).
        v_ids := ARRAY(
            WITH RECURSIVE heads AS (
                SELECT q.id AS service_id,
                       (SELECT s.tenant_id FROM accs_start s WHERE s.service_id = q.id
                         ORDER BY s.service_id, s.tenant_id LIMIT 1) AS tenant_id
                  FROM unnest(p_svc_ids) AS q(id)
                UNION ALL
                SELECT h.service_id,
                       (SELECT s.tenant_id FROM accs_start s WHERE s.service_id = h.service_id
                           AND s.tenant_id > h.tenant_id ORDER BY s.service_id, s.tenant_id LIMIT 1)
                  FROM heads h WHERE h.tenant_id IS NOT NULL
            )
            SELECT x.id FROM heads h CROSS JOIN LATERAL (
                SELECT s.id FROM accs_start s
                 WHERE s.service_id = h.service_id AND s.tenant_id = h.tenant_id
                 ORDER BY s.priority DESC, s.order_seq, s.id
                 LIMIT p_per_queue
                   FOR UPDATE SKIP LOCKED) x
             WHERE h.tenant_id IS NOT NULL);
    ELSE
        -- The oldest first, by the time-ordered ids of the primary key.
        v_ids := ARRAY(SELECT s.id FROM accs_start s WHERE s.created_at < p_before ORDER BY s.id
                        LIMIT p_limit FOR UPDATE SKIP LOCKED);
    END IF;
    IF cardinality(v_ids) = 0 THEN
        RETURN '{{}}';
    END IF;
{widen};
    IF p_events THEN
{textwrap.indent(CREATIONS_SQL.format(jobs="v_widened").strip(), "        ")};
    END IF;
    RETURN v_widened;
END
$widen$"""


# --------------------------------------------------------------------------------------------
# The verbs (re-exported by jobs.api)
# --------------------------------------------------------------------------------------------

def validate(spec: JobSpec) -> None:
    """Check a job spec as :func:`start` would, writing nothing; raise DefinitionError or NotFound."""
    plan = _plan(spec, _Validators(), {})
    if _runs_now(plan, timezone.now()):
        _check_selector(plan)


def start(spec: JobSpec) -> Job:
    """Start one job (see :func:`jobs.api.start_workflow`); ``job.was_created`` tells a new job from a repeat."""
    now = timezone.now()
    plan = _plan(spec, _Validators(), {})
    if _is_narrow(plan):
        return _start_narrow(plan)
    if spec.scheduled_at is None and _runs_now(plan, now):
        # Due now by PostgreSQL's clock (no scheduled time given). One statement, atomic on its own:
        # no savepoint or transaction of ours is needed.
        job = _start_now(plan)
        if job is not None:
            return job
    with transaction.atomic():
        for _ in range(INSERT_ATTEMPTS):
            inserted = _insert([plan])
            jid = plan.job_id
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
            # Instantiated in this call, so its hosts are known now; a refusal rolls the savepoint back.
            _check_selector(plan)
            start_jobs([jid], source=f"api:{spec.source}")
        else:
            with connection.cursor() as cur:
                notify(cur, [builder_channel()])
        job = Job.objects.get(pk=jid)
        job.was_created = True
        return job


def start_many(specs: Iterable[JobSpec], *, batch_size: int = 5000) -> list[UUID]:
    """Start many jobs at once (bulk): validated first, inserted set-based, instantiated by the builder.

    Returns the job ids in input order; a spec whose external_id already exists yields the
    existing job's id. Raises JobConflict when a dedupe key is held, DefinitionError when any spec
    is invalid (then nothing is written).
    """
    validators = _Validators()
    specs = list(specs)
    narrow = _narrow_rows(specs, validators) if accs.narrow_starts and specs else None
    if narrow is not None:
        return _start_many_narrow(*narrow, batch_size=batch_size)
    services: dict[str, Service] = {}
    plans = [_plan(s, validators, services) for s in specs]
    out: list[UUID] = []
    # A savepoint (one per call, not per job): on JobConflict nothing of this call remains and the
    # caller's own transaction stays usable, as with start().
    with transaction.atomic():
        for start_at in range(0, len(plans), batch_size):
            chunk = plans[start_at:start_at + batch_size]
            inserted = _insert(chunk)
            for plan in chunk:
                jid = plan.job_id
                if jid in inserted:
                    out.append(jid)
                    continue
                existing = _existing_for(plan)
                for _ in range(INSERT_ATTEMPTS - 1):
                    if existing is not None:
                        break
                    if _insert([plan]):
                        existing = plan.job_id
                    else:
                        existing = _existing_for(plan)
                if existing is None:  # pragma: no cover - see start()
                    raise RuntimeError("job insert kept conflicting with jobs that disappeared; try again")
                out.append(existing)
        with connection.cursor() as cur:
            notify(cur, [builder_channel()])
    return out


def _start_many_narrow(rows: list[str], jobs: list[UUID], keys: set[str], *, batch_size: int) -> list[UUID]:
    """Write a bulk start's narrow starts (:func:`_narrow_rows`), a statement a batch, in the caller's transaction."""
    with transaction.atomic(), connection.cursor() as cur:
        for start_at in range(0, len(rows), batch_size):
            cur.execute(INSERT_NARROW_SQL, {"rows": "[" + ",".join(rows[start_at:start_at + batch_size]) + "]"})
        notify(cur, [service_channel(key) for key in keys])
    return jobs


def _narrow_rows(specs: Sequence[JobSpec], validators: _Validators) -> tuple[list[str], list[UUID], set[str]] | None:
    """Return ``specs`` as narrow starts (each one's row as JSON, the job ids, the services' keys), or None.

    The bulk start's fast lane: each spec must be a one-task service job with nothing but params,
    priority, tenant, correlation and source, that passes every check :func:`_plan` makes of such a
    spec (params an object within ``ACC_MAX_PARAMS_BYTES`` that its service's schema accepts, a
    priority in range, known source, short references). Each check here only accepts: None sends
    the whole call through :func:`_plan`, which names whatever is wrong. Each params is encoded once,
    into the batch's document.
    """
    limit = accs.max_params_bytes
    ids = uuid7_many(2 * len(specs))
    parts: list[str] = []
    jobs: list[UUID] = []
    keys: set[str] = set()
    for n, spec in enumerate(specs):
        if (spec.workflow is not None or spec.service is None or spec.step_params or spec.options
                or spec.external_id is not None or spec.dedupe_key is not None or spec.scheduled_at is not None
                or spec.source not in SOURCES or type(spec.priority) is not int or not -INT32 <= spec.priority <= INT32
                or type(spec.source_ref) is not str or len(spec.source_ref) > 200
                or type(spec.correlation_id) is not str or len(spec.correlation_id) > 200
                or not (spec.params is None or type(spec.params) is dict)):
            return None
        try:
            tenant = validators.resolved("tenant", spec.tenant, resolve_tenant)
            service = validators.resolved("service", spec.service, resolve_service)
        except NotFound:
            return None
        if (tenant.max_in_flight or service.requires_approval or service.rate_limit or service.rate_key_limit
                or service.concurrency_key_limit):
            return None
        params = spec.params or {}
        try:
            text = json.dumps(params)
        except (TypeError, ValueError):
            return None
        # (ASCII: json.dumps escapes the rest, as params_json does, so its length is its size in bytes.)
        if len(text) > limit or not validators.accepts(service, params):
            return None
        priority = tenant.clamp_priority(spec.priority)
        jid, task_id = ids[2 * n], ids[2 * n + 1]
        cby = getattr(spec.created_by, "pk", spec.created_by)
        parts.append(f'{{"id":"{jid.hex}","task_id":"{task_id.hex}","tenant":"{tenant.id.hex}","svc":{service.id},'
                     f'"priority":{priority + service.base_priority},"job_priority":{priority},"params":{text},'
                     f'"src":{json.dumps(str(spec.source))},"sref":{json.dumps(spec.source_ref)},'
                     f'"corr":{json.dumps(spec.correlation_id)},"cby":{json.dumps(cby)}}}')
        jobs.append(jid)
        keys.add(service.key)
    return parts, jobs, keys
