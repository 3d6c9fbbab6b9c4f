"""The public Python API of ACCS for other Django apps.

Every function works inside the caller's transaction: a job exists if and only if the caller
commits, and the NOTIFY that wakes builders and agents is delivered at that commit. Params are
validated against the services' JSON Schemas before anything is written.

    from jobs import api
    job = api.start_workflow("publish", step_params={"render": {"preset": "4k"}}, external_id="hook-42")
    api.emit_event("provider.folder.updated", {"provider_id": "p-1"}, tenant="acme")
    api.cancel(job.id)
    api.raise_condition("live_session", reason="studio is live", by="alice")

Starting: :func:`start_workflow`, :func:`start_service`, :func:`start`, :func:`start_many`,
:func:`validate`. Events: :func:`emit_event`. Acting: :func:`cancel`, :func:`retry`,
:func:`approve`, :func:`reject`, :func:`cancel_task`, :func:`retry_task`, :func:`redrive` (in bulk, by
filter, :class:`RedriveFilter`). Governor:
:func:`raise_condition`, :func:`clear_condition`.

This module is the list an embedding site reads: each verb is a line or two over the module
that owns it (:mod:`jobs.enqueue` creates jobs, :mod:`jobs.transitions` changes them,
:mod:`jobs.triggers` fires events, :mod:`workflows.governor` holds conditions).

Idempotency: a repeated ``external_id`` (per tenant) returns the existing job, also under
concurrent duplicates (the unique index decides; ``job.was_created`` tells which). A ``dedupe_key``
held by a queued or running job of the tenant raises :class:`JobConflict` naming that job. A
fan-out workflow started with no host to run on raises :class:`NoHostsError` (a DefinitionError).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from jobs import redrive as redrive_module, transitions, triggers
from jobs.enqueue import (
    INSERT_ATTEMPTS,
    INSERT_JOBS_SQL,
    INT32,
    SOURCES,
    JobConflict,
    JobSpec,
    NoHostsError,
    NotFound,
    resolve_service,
    resolve_tenant,
    resolve_workflow,
    start,
    start_many,
    validate,
)
from jobs.models import Job
from tenants.models import Tenant
from workflows import governor
from workflows.models import GovernorCondition, Service, Workflow
from workflows.validation import DefinitionError, Problem

ActionResult = transitions.ActionResult
RedriveFilter = redrive_module.RedriveFilter

__all__ = [
    # Starting jobs and their errors
    "start_workflow", "start_service", "start", "start_many", "validate", "JobSpec", "JobConflict", "NotFound",
    "NoHostsError", "DefinitionError", "Problem", "resolve_tenant", "resolve_workflow", "resolve_service",
    # Acting on jobs and tasks
    "cancel", "retry", "approve", "reject", "cancel_task", "retry_task", "redrive", "RedriveFilter", "ActionResult",
    # Application events and governor conditions
    "emit_event", "raise_condition", "clear_condition",
    # Public here before job creation moved to jobs.enqueue; kept importable for embedding sites
    "INSERT_ATTEMPTS", "INSERT_JOBS_SQL", "INT32", "SOURCES",
]


# --------------------------------------------------------------------------------------------
# Starting jobs (jobs.enqueue)
# --------------------------------------------------------------------------------------------

def start_workflow(workflow: str | Workflow, *, version: int | None = None, **options: Any) -> Job:
    """Start a job of a workflow: by name its latest active version, or ``version``.

    Keyword options: step_params, options (hosts / host_selector for fan-out), priority,
    scheduled_at, tenant, external_id, dedupe_key, correlation_id, source, source_ref, created_by.
    Raises DefinitionError (invalid params), NotFound, JobConflict (dedupe key held).
    """
    return start(JobSpec(workflow=workflow, version=version, **options))


def start_service(service: str | Service, *, params: dict[str, Any] | None = None, **options: Any) -> Job:
    """Start a one-task job that runs ``service`` with ``params``."""
    return start(JobSpec(service=service, params=params, **options))


# --------------------------------------------------------------------------------------------
# Acting on jobs (transitions; each returns ActionResult)
# --------------------------------------------------------------------------------------------

def cancel(job_id: UUID, *, by: str = "") -> ActionResult:
    """Cancel a job: unstarted tasks are canceled, running ones stop at their next heartbeat."""
    return transitions.cancel_job(job_id, by=by)


def retry(job_id: UUID, *, by: str = "") -> ActionResult:
    """Retry a failed or canceled job, attempts reset."""
    return transitions.retry_job(job_id, by=by)


def approve(job_id: UUID, *, by: str = "") -> ActionResult:
    """Approve a job waiting for approval."""
    return transitions.approve(job_id, by=by)


def reject(job_id: UUID, *, by: str = "", reason: str = "") -> ActionResult:
    """Reject a job waiting for approval; it is canceled."""
    return transitions.reject(job_id, by=by, reason=reason)


def cancel_task(task_id: UUID, *, by: str = "") -> ActionResult:
    """Cancel one task: unstarted → canceled, held → the agent stops it at its next heartbeat."""
    return transitions.cancel_task(task_id, by=by)


def retry_task(task_id: UUID, *, by: str = "") -> ActionResult:
    """Put one failed, skipped, canceled or blocked task back to queued, attempts reset."""
    return transitions.retry_task(task_id, by=by)


def redrive(flt: redrive_module.RedriveFilter, *, by: str = "", dry_run: bool = False, batch: int = 500,
            limit: int | None = None) -> redrive_module.RedriveResult:
    """Retry every dead-lettered task (or, with ``flt.jobs``, failed job) matching ``flt``, in batches.

    With ``dry_run`` only count them (``matched``), writing nothing. Each batch commits on its
    own, so call it outside a transaction of yours. See :mod:`jobs.redrive`.
    """
    if dry_run:
        return redrive_module.dry_run(flt, limit=limit)
    return redrive_module.redrive(flt, by=by, batch=batch, limit=limit)


# --------------------------------------------------------------------------------------------
# Application events and governor conditions
# --------------------------------------------------------------------------------------------

def emit_event(name: str, context: dict[str, Any] | None = None, *, tenant: Tenant | str | UUID | None = None,
               correlation_id: str = "", source: str = "app", sent_by: Any = None) -> triggers.EmitResult:
    """Record an application event and start the jobs of the tenant's matching event triggers.

    Runs in the caller's transaction: the event and its jobs exist iff the caller commits. A
    trigger that cannot fire (a template value missing from ``context``, invalid params) records
    its error on the trigger and the timeline and starts nothing; the others still fire. Return a
    :class:`jobs.triggers.EmitResult` (``jobs``, ``deduplicated``, ``errors``). ``sent_by`` is the
    user who sent the event, if any: the jobs are recorded as theirs, so they may not approve them.
    """
    return triggers.fire_event(name, context, tenant=resolve_tenant(tenant), correlation_id=correlation_id,
                               source=source, sent_by=sent_by)


def raise_condition(name: str, *, reason: str, expires_at: datetime | None = None,
                    by: str) -> GovernorCondition:
    """Raise (or re-arm) a governor condition until ``expires_at`` or until cleared, with an event."""
    return governor.raise_condition(name, reason=reason, expires_at=expires_at, by=by)


def clear_condition(name: str, by: str = "") -> bool:
    """Clear a governor condition; False when it does not hold."""
    return governor.clear_condition(name, by)
