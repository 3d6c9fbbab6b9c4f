"""Small helpers for the raw SQL of the engine."""

from __future__ import annotations

import json
from typing import Any


def from_json(value: Any) -> Any:
    """Decode a json/jsonb column read through Django's cursor (which returns it as text)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value

