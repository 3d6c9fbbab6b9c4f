"""Callables for the benchmarks (executor ``python``)."""

from __future__ import annotations

import time
from typing import Any


def noop(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    return {}


def stamp(params: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
    """Return the pick-up latency: now minus the enqueue time the job carries."""
    return {"latency_ms": (time.time() - float(params["t0"])) * 1000}
