"""Wire/JSON shape of a node."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from nodes.models import AwakeState, NodeState, WakeMethod


class Node(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    labels: dict[str, Any]
    state: NodeState
    last_seen: datetime | None
    awake_state: AwakeState
    wake_method: WakeMethod
    mac: str
    provider_ref: str
    script: str
    max_concurrency: dict[str, int]
    slot_cap: int
    cpu_budget: int
