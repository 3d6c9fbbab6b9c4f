"""Bulk redrive: retry every dead-lettered task, or every failed job, that matches a filter.

A dead letter is a task in final ``error`` (its attempts used up); a failed job is one in
``error`` (and, when asked, ``partial`` or ``canceled``). :func:`count` is the dry run: how many
match, nothing written. :func:`redrive` works through them in batches, each batch its own short
transaction: it selects the next ids in primary-key order after the last batch's (keyset
pagination, so a batch never rereads what an earlier one saw) and hands them, with the
``finished_at`` it saw, to the operators' retry verbs (:func:`jobs.verbs.retry_tasks`,
:func:`jobs.verbs.retry_jobs`). Those take the engine's locks in its one order and retry only
what is still the failure seen: a task retried by someone else meanwhile (or by a second
redrive running at the same time) is skipped and counted, never retried twice.

Every status event a redrive writes says "bulk redrive by <who>" and carries the filter in its
data, under ``redrive``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from django.core.exceptions import PermissionDenied
from django.db import connection, transaction

from jobs import verbs
from jobs.models import JobStatus, TaskStatus
from jobs.states import sql_in
from tenants.models import Tenant
from workflows.models import Service
from workflows.validation import DefinitionError, Problem

MAX_BATCH = 10_000
#: Final job states a redrive may take in besides ``error``.
JOB_EXTRA = frozenset({JobStatus.PARTIAL, JobStatus.CANCELED})


@dataclass(frozen=True)
class RedriveFilter:
    """What to redrive: dead-lettered tasks (default) or, with ``jobs``, failed jobs.

    Every field given narrows the match: ``service`` (key; for jobs, the job's service or a
    service of one of its tasks), ``tenant`` (slug or id), ``error_contains`` (case-insensitive
    part of the error message; for jobs, the job's or a failed task's), ``since`` / ``until``
    (``since <= finished_at < until``), ``node`` (the node that last held the task; for jobs,
    one of its tasks). ``include`` adds ``partial`` and/or ``canceled`` jobs to the failed ones.
    """

    jobs: bool = False
    service: str | None = None
    tenant: str | None = None
    error_contains: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    node: str | None = None
    include: frozenset[str] = frozenset()

    def describe(self) -> dict[str, Any]:
        """Return the fields given, as JSON (for the timeline)."""
        out: dict[str, Any] = {"target": "jobs" if self.jobs else "tasks"}
        for name in ("service", "tenant", "error_contains", "node"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        for name in ("since", "until"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).isoformat()
        if self.include:
            out["include"] = sorted(self.include)
        return out


@dataclass
class RedriveResult:
    """How many matched, how many were redriven, how many were skipped (no longer applicable)."""

    matched: int = 0
    redriven: int = 0
    skipped: int = 0
    batches: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Where:
    """A validated filter as SQL conditions on ``t`` (tasks) or ``j`` (jobs) and their parameters."""

    conditions: tuple[str, ...]
    params: dict[str, Any]
    table: str


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _tenant_ids(given: str | None, allowed: Collection[UUID] | None) -> list[UUID] | None:
    """Return the tenants to match (None: all); a tenant not in ``allowed`` is refused like an unknown one."""
    if given:
        lookup: dict[str, Any]
        try:
            lookup = {"id": UUID(given)}
        except ValueError:
            lookup = {"slug": given}
        tenant = Tenant.objects.filter(**lookup).values_list("id", flat=True).first()
        if allowed is not None and tenant not in allowed:
            # Same answer for "no such tenant" and "not yours": tenant names are not disclosed.
            raise PermissionDenied(f"you may not act in tenant {given!r}")
        if tenant is None:
            raise DefinitionError([Problem("tenant", f"no tenant {given!r}")])
        return [tenant]
    return None if allowed is None else sorted(allowed, key=str)


def _where(flt: RedriveFilter, tenant_ids: Collection[UUID] | None) -> _Where:
    """Validate ``flt`` (naming the field at fault) and turn it into SQL; nothing is written."""
    problems = []
    since, until = _aware(flt.since), _aware(flt.until)
    if since and until and since >= until:
        problems.append(Problem("until", f"must be later than since ({since.isoformat()})"))
    if flt.include and not flt.jobs:
        problems.append(Problem("include", "partial and canceled apply to jobs only"))
    if extra := set(flt.include) - JOB_EXTRA:
        problems.append(Problem("include", f"unknown job state(s) {sorted(extra)}; expected partial, canceled"))
    service = None
    if flt.service:
        service = Service.objects.filter(key=flt.service).values_list("id", flat=True).first()
        if service is None:
            problems.append(Problem("service", f"no service {flt.service!r}"))
    if problems:
        raise DefinitionError(problems)
    tenants = _tenant_ids(flt.tenant, tenant_ids)
    params = {"service": service, "tenants": tenants, "error": flt.error_contains, "since": since, "until": until,
              "node": flt.node}
    # A condition per field given, so the planner sees only what narrows (no "param IS NULL OR ...").
    if flt.jobs:
        table = "accs_job j"
        statuses = {JobStatus.ERROR, *flt.include}
        task_of_job = "EXISTS (SELECT 1 FROM accs_task t WHERE t.job_id = j.id AND {})"
        conditions = [f"j.status IN {sql_in(statuses)}", "j.approval_state <> 'rejected'"]
        pick = {
            "service": "(j.service_id = %(service)s OR " + task_of_job.format("t.service_id = %(service)s") + ")",
            "tenants": "j.tenant_id = ANY(%(tenants)s::uuid[])",
            "error": "(strpos(lower(j.error_message), lower(%(error)s)) > 0 OR " + task_of_job.format(
                f"t.status = '{TaskStatus.ERROR}' AND strpos(lower(t.error_message), lower(%(error)s)) > 0") + ")",
            "since": "j.finished_at >= %(since)s",
            "until": "j.finished_at < %(until)s",
            "node": task_of_job.format("t.node = %(node)s"),
        }
    else:
        table = "accs_task t"
        conditions = [f"t.status = '{TaskStatus.ERROR}'"]
        pick = {
            "service": "t.service_id = %(service)s",
            "tenants": "t.tenant_id = ANY(%(tenants)s::uuid[])",
            "error": "strpos(lower(t.error_message), lower(%(error)s)) > 0",
            "since": "t.finished_at >= %(since)s",
            "until": "t.finished_at < %(until)s",
            "node": "t.node = %(node)s",
        }
    conditions += [sql for name, sql in pick.items() if params[name] is not None and params[name] != ""]
    return _Where(tuple(conditions), params, table)


def count(flt: RedriveFilter, *, tenant_ids: Collection[UUID] | None = None) -> int:
    """Return how many tasks (or jobs) a redrive with ``flt`` would retry now (the dry run).

    ``tenant_ids`` limits the match to the tenants the caller may act in (None: all tenants).
    """
    where = _where(flt, tenant_ids)
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {where.table} WHERE {' AND '.join(where.conditions)}", where.params)
        return cur.fetchone()[0]


def dry_run(flt: RedriveFilter, *, limit: int | None = None,
            tenant_ids: Collection[UUID] | None = None) -> RedriveResult:
    """Return what :func:`redrive` would take in now (``matched``, capped at ``limit``), writing nothing."""
    matched = count(flt, tenant_ids=tenant_ids)
    return RedriveResult(matched=matched if limit is None else min(matched, limit))


def _next_batch(cur, where: _Where, *, after: UUID | None, size: int) -> list[tuple[UUID, datetime]]:
    """Return the next (id, finished_at) matches after ``after`` in primary-key order."""
    alias = where.table[-1]
    conditions = [*where.conditions, *([f"{alias}.id > %(after)s"] if after else [])]
    # Keyset pagination: the primary key (or the partial dead-letter index) is read from the
    # last id on, so each batch costs its own size, not the rows before it.
    cur.execute(f"SELECT {alias}.id, {alias}.finished_at FROM {where.table} WHERE {' AND '.join(conditions)}"
                f" ORDER BY {alias}.id LIMIT %(size)s", {**where.params, "after": after, "size": size})
    return cur.fetchall()


def redrive(flt: RedriveFilter, *, by: str, batch: int = 500, limit: int | None = None,
            tenant_ids: Collection[UUID] | None = None,
            on_batch: Callable[[RedriveResult], None] | None = None) -> RedriveResult:
    """Retry every task (or job) matching ``flt``, ``batch`` at a time, each batch in its own transaction.

    At most ``limit`` matches are taken (None: all). ``on_batch`` is called with the running
    totals after each batch. Return the totals: matched, redriven, skipped (no longer
    applicable: retried or changed by someone else since it was selected).
    """
    totals = RedriveResult()
    for totals in redrive_batches(flt, by=by, batch=batch, limit=limit, tenant_ids=tenant_ids):
        if on_batch is not None:
            on_batch(totals)
    return totals


def redrive_batches(flt: RedriveFilter, *, by: str, batch: int = 500, limit: int | None = None,
                    tenant_ids: Collection[UUID] | None = None) -> Iterator[RedriveResult]:
    """Validate ``flt`` now (a bad filter raises here, before anything is written), then return an
    iterator that redrives one batch per step, in its own transaction, and yields the running totals
    after each commit. Whoever stops iterating stops the redrive at a batch boundary: every batch
    is whole or absent, and a later redrive takes in the rest."""
    if not 1 <= batch <= MAX_BATCH:
        raise DefinitionError([Problem("batch", f"must be between 1 and {MAX_BATCH}, got {batch}")])
    if limit is not None and limit < 1:
        raise DefinitionError([Problem("limit", f"must be at least 1, got {limit}")])
    return _batches(flt, _where(flt, tenant_ids), by=by, batch=batch, limit=limit)


def _batches(flt: RedriveFilter, where: _Where, *, by: str, batch: int,
             limit: int | None) -> Iterator[RedriveResult]:
    who = by or "api"
    why = verbs.Note(task=f"bulk redrive by {who}", job=f"bulk redrive by {who}",
                     data={"redrive": {"by": who, "filter": flt.describe()}})
    retry = verbs.retry_jobs if flt.jobs else verbs.retry_tasks
    statuses = {JobStatus.ERROR, *flt.include} if flt.jobs else {TaskStatus.ERROR}
    totals = RedriveResult()
    after = None
    while limit is None or totals.matched < limit:
        size = batch if limit is None else min(batch, limit - totals.matched)
        with transaction.atomic(), connection.cursor() as cur:
            found = _next_batch(cur, where, after=after, size=size)
            if not found:
                break
            outcomes = retry(dict(found), by=by, statuses=statuses, why=why)
        after = found[-1][0]
        totals.batches += 1
        totals.matched += len(found)
        for outcome in outcomes.values():
            if outcome.changed:
                totals.redriven += 1
            else:
                totals.skipped += 1
                totals.reasons[outcome.message] = totals.reasons.get(outcome.message, 0) + 1
        yield totals
        if len(found) < size:
            break
