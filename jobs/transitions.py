"""Every task and job status change, by owner (one import point for callers).

* :mod:`jobs.admission` — admission and instantiation, the builder's side (queued → running);
* :mod:`jobs.reports` — the agents' side: start, heartbeat, progress, outcomes;
* :mod:`jobs.rescue` — the lease rescue (what a failure does is decided in :mod:`jobs.failure`);
* :mod:`jobs.verbs` — operators' verbs: cancel, retry (one or many), approve, reject;
* :mod:`jobs.finalize` — promotion and completion, shared by all of them.

The fleet's verbs (drain, undrain, clear a host's quarantine) live in :mod:`nodes.verbs`.

Each transition is a conditional UPDATE naming the state(s) it leaves (and, for tasks held by an
agent, the attempt number, which fences late reports), plus its Event rows, in one transaction,
with locks taken in the order of :mod:`jobs.locks` and times from PostgreSQL's clock. The
allowed moves are listed in :mod:`jobs.states`.
"""

from __future__ import annotations

from jobs.admission import start_due_jobs, start_jobs
from jobs.reports import Outcome, ReportResult, heartbeat, mark_running, report, report_progress
from jobs.rescue import rescue_expired
from jobs.verbs import (
    ActionResult,
    Note,
    approve,
    cancel_job,
    cancel_task,
    reject,
    retry_job,
    retry_jobs,
    retry_task,
    retry_tasks,
)

__all__ = [
    "ActionResult", "Note", "Outcome", "ReportResult", "approve", "cancel_job", "cancel_task", "heartbeat",
    "mark_running", "reject", "report", "report_progress", "rescue_expired", "retry_job", "retry_jobs", "retry_task",
    "retry_tasks", "start_due_jobs", "start_jobs",
]
