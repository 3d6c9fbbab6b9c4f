"""Compare a repeated request with the job its ``external_id`` already names.

An ``external_id`` promises "this request again": a repeat with a different body is a client bug
(or two systems sharing ids), so the HTTP API answers 409 naming the job instead of silently
returning a job that does not do what the new body asks.
"""

from __future__ import annotations

from typing import Any

from jobs.models import Job


def differences(job: Job, spec: Any) -> list[str]:
    """Return the names of the fields where ``spec`` (a :class:`jobs.api.JobSpec`) asks for something else."""
    differ: list[str] = []
    if spec.workflow is not None:
        if job.workflow is None or job.workflow.name != spec.workflow:
            differ.append("workflow")
        elif spec.version is not None and job.workflow.version != spec.version:
            differ.append("version")
        if (job.step_params or {}) != (spec.step_params or {}):
            differ.append("step_params")
    else:
        if job.service is None or job.service.key != spec.service:
            differ.append("service")
        elif (job.step_params or {}).get(job.service.key, {}) != (spec.params or {}):
            differ.append("params")
    if (job.options or {}) != (spec.options or {}):
        differ.append("options")
    if job.priority != spec.priority:
        differ.append("priority")
    if spec.scheduled_at is not None and job.scheduled_at != spec.scheduled_at:
        differ.append("scheduled_at")
    if (job.dedupe_key or None) != spec.dedupe_key:
        differ.append("dedupe_key")
    if job.correlation_id != (spec.correlation_id or ""):
        differ.append("correlation_id")
    return differ
