"""Wire/JSON shapes of the timeline and artifacts."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from events.models import ArtifactKind, Level


class TaskEvent(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int | None = None
    job_id: UUID | None
    task_id: UUID | None
    attempt: int | None = None
    ts: datetime
    source: str
    level: Level
    type: str
    message: str
    data: dict[str, Any]


class TaskArtifact(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    job_id: UUID
    task_id: UUID | None
    attempt: int | None = None
    kind: ArtifactKind
    bucket: str
    key: str
    size_bytes: int
    content_type: str
    checksum: str
    created_at: datetime
