"""Wire/JSON shapes of jobs and tasks (the job and task fields clients read, with ACCS's additions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from jobs.models import ApprovalState, JobSource, JobStatus, TaskStatus


class Job(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: UUID
    tenant_id: UUID
    workflow_id: UUID | None
    service_id: int | None
    status: JobStatus
    progress: float
    current_task_key: str
    priority: int
    order_seq: int
    options: dict[str, Any]
    step_params: dict[str, Any]
    scheduled_at: datetime
    error_code: str
    error_message: str
    source: JobSource
    source_ref: str
    external_id: str | None
    dedupe_key: str | None
    correlation_id: str
    approval_state: ApprovalState
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime


class JobTask(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: UUID
    job_id: UUID
    task_key: str
    step_key: str
    service_id: int
    host_id: int | None
    status: TaskStatus
    depends_on: list[str]
    attempt: int
    max_attempts: int
    next_attempt_at: datetime
    priority: int
    order_seq: int
    timeout_seconds: int
    progress: float | None
    params: dict[str, Any]
    results: dict[str, Any] | list[Any] | None
    assigned_node: str
    claimed_by: str
    node: str
    claimed_at: datetime | None
    lease_expires_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    error_code: str
    error_message: str
