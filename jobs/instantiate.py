"""Turning a job into tasks: one task per workflow step, one per host for a fan-out step.

Pure construction; :mod:`jobs.admission` (and the one-statement start in :mod:`jobs.enqueue`) decides
which jobs and writes the rows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from accs_site.conf import accs
from jobs.ids import uuid7
from jobs.models import TaskStatus
from workflows.models import StepFailurePolicy


def params_json(params: dict[str, Any]) -> str:
    """Return a task's params as the JSON text its process reads (``ACCS_PARAMS_FILE``, ``ACCS_PARAMS``);
    ``ACC_MAX_PARAMS_BYTES`` bounds its size in bytes when a job is started."""
    return json.dumps(params)


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


def step_rows(task_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one ``accs_job_step`` row per (job, step) of the task rows: place, size, blocked hosts, policy."""
    steps: dict[tuple[str, str], dict[str, Any]] = {}
    for row in task_rows:
        key = (str(row["job_id"]), row["step_key"])
        step = steps.get(key)
        if step is None:
            step = steps[key] = {"job_id": key[0], "step_key": key[1], "position": row["position"], "total": 0,
                                 "blocked": 0, "on_failure": row["on_failure"], "always": row["always"],
                                 "max_items": row.get("max_items")}
        step["total"] += 1
        step["blocked"] += row["status"] == TaskStatus.BLOCKED
    return list(steps.values())


def build_task_rows(job: JobRow, steps: list[dict], services: dict[str, ServiceInfo], *, hosts: list[HostInfo],
                    blocked: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """Return one dict per task of the job, keyed by the columns :data:`jobs.admission.INSERT_TASKS_SQL` reads.

    A step fanning out over a parent's list gets one task now, which becomes one per item when its parents
    are done (:mod:`jobs.finalize`); its step row carries the most items it may make.
    """
    rows: list[dict[str, Any]] = []
    for position, step in enumerate(steps):
        service = services.get(step["service"])
        if service is None:
            raise InstantiationError(
                "unknown_service", f"step '{step['key']}': service {step['service']!r} no longer exists or is inactive")
        params = {**step.get("default_params", {}), **(job.step_params.get(step["key"]) or {})}
        deps = list(step.get("depends_on", []))
        targets: Sequence[HostInfo | None] = [None]
        if step.get("fan_out") == "hosts":
            targets = select_hosts(job.options, hosts)
            if not targets:
                raise InstantiationError("no_hosts", f"step '{step['key']}': the host selector matched no host")
        for host in targets:
            is_blocked = host is not None and (host.id, service.id) in blocked
            status = TaskStatus.BLOCKED if is_blocked else (TaskStatus.WAITING if deps else TaskStatus.QUEUED)
            rows.append({
                "id": uuid7(), "job_id": job.id, "tenant_id": job.tenant_id,
                "task_key": step["key"] if host is None else f"{step['key']}@{host.name}", "step_key": step["key"],
                "service_id": service.id, "host_id": host.id if host else None, "exclusive": service.exclusive,
                "status": str(status), "depends_on": deps, "max_attempts": service.max_attempts,
                "priority": job.priority + service.base_priority, "order_seq": job.order_seq,
                "timeout_seconds": service.timeout_seconds, "params": params, "position": position,
                # The step's failure policy, copied to its accs_job_step row (not a task column).
                "on_failure": step.get("on_failure") or StepFailurePolicy.FAIL_JOB, "always": bool(step.get("always")),
                "max_items": accs.max_fan_out_items if isinstance(step.get("fan_out"), dict) else None,
                "assigned_node": (host.node_id or "") if host else "",
                "error_code": "host_blocked" if is_blocked else "",
                "error_message": f"{service.key} is blocked on {host.name}" if is_blocked and host else "",
            })
    return rows
