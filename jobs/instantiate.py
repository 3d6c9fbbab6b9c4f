"""Turning a job into tasks: one task per workflow step, one per host for a fan-out step (WF4).

Pure construction; :func:`jobs.transitions.start_jobs` decides which jobs and writes the rows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobs.models import TaskStatus

TASK_COPY_COLUMNS = (
    "id", "job_id", "tenant_id", "task_key", "step_key", "service_id", "host_id", "exclusive", "status",
    "depends_on", "attempt", "max_attempts", "next_attempt_at", "priority", "order_seq", "timeout_seconds",
    "params", "assigned_node", "claimed_by", "node", "error_code", "error_message", "created_at", "updated_at",
    "finished_at",
)


class InstantiationError(Exception):
    """A job cannot be turned into tasks (unknown hosts, empty fan-out...); the job fails with it."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class JobRow:
    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow_id: uuid.UUID | None
    service_id: int | None
    priority: int
    order_seq: int
    options: dict[str, Any]
    step_params: dict[str, Any]


@dataclass(frozen=True)
class ServiceInfo:
    id: int
    key: str
    base_priority: int
    max_attempts: int
    timeout_seconds: int
    exclusive: bool


@dataclass(frozen=True)
class HostInfo:
    id: int
    name: str
    node_id: str | None
    labels: dict[str, Any]


def steps_for(job: JobRow, workflow_steps: list[dict] | None, service_key: str | None) -> list[dict]:
    """Return the steps to instantiate: the workflow's, or one step for a single-service job."""
    if workflow_steps is not None:
        return workflow_steps
    return [{"key": service_key, "service": service_key, "depends_on": [], "default_params": {}}]


def select_hosts(options: dict[str, Any], hosts: list[HostInfo]) -> list[HostInfo]:
    """Pick the fan-out hosts named in job options: ``hosts`` (names) or ``host_selector`` (labels)."""
    names = options.get("hosts")
    selector = options.get("host_selector")
    if names:
        by_name = {h.name: h for h in hosts}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise InstantiationError("unknown_hosts", f"unknown hosts in options.hosts: {missing[:10]}")
        return [by_name[n] for n in dict.fromkeys(names)]
    if selector:
        return [h for h in hosts if all(str(h.labels.get(k)) == str(v) for k, v in selector.items())]
    raise InstantiationError("no_hosts", "a fan-out step needs options.hosts or options.host_selector")


def build_task_rows(job: JobRow, steps: list[dict], services: dict[str, ServiceInfo], *, hosts: list[HostInfo],
                    blocked: set[tuple[int, int]], now: datetime) -> list[tuple]:
    """Return COPY rows (``TASK_COPY_COLUMNS``) for one job."""
    rows: list[tuple] = []
    for step in steps:
        service = services[step["service"]]
        params = {**step.get("default_params", {}), **(job.step_params.get(step["key"]) or {})}
        deps = list(step.get("depends_on", []))
        targets: list[HostInfo | None] = [None]
        if step.get("fan_out") == "hosts":
            targets = select_hosts(job.options, hosts)
            if not targets:
                raise InstantiationError("no_hosts", f"step '{step['key']}': the host selector matched no host")
        for host in targets:
            is_blocked = host is not None and (host.id, service.id) in blocked
            status = TaskStatus.BLOCKED if is_blocked else (TaskStatus.WAITING if deps else TaskStatus.QUEUED)
            rows.append((
                uuid.uuid4(), job.id, job.tenant_id, step["key"] if host is None else f"{step['key']}@{host.name}",
                step["key"], service.id, host.id if host else None, service.exclusive, status, deps, 0,
                service.max_attempts, now, job.priority + service.base_priority, job.order_seq,
                service.timeout_seconds, params, (host.node_id or "") if host else "", "", "",
                "host_blocked" if is_blocked else "", f"{service.key} is blocked on {host.name}" if is_blocked else "",
                now, now, now if is_blocked else None,
            ))
    return rows
