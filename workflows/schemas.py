"""Wire/JSON shapes of workflows: WorkflowStep, WorkflowDef."""

from __future__ import annotations

from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class WorkflowStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    service: str
    depends_on: list[str] = Field(default_factory=list)
    default_params: dict[str, Any] = Field(default_factory=dict)
    fan_out: Literal["hosts"] | None = None
    on_failure: Literal["fail_job", "continue"] | None = None
    always: StrictBool | None = None


class WorkflowDef(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: UUID | None = None
    name: str
    version: int = 1
    is_active: bool = True
    max_active_jobs: int = 0
    steps: list[WorkflowStep]
