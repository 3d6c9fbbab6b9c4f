"""The ``simulate`` executor: an unstable network with seeded delays, errors and timeouts (demos, soak tests)."""

from __future__ import annotations

import os
import random

from jobs.claim import ClaimedTask
from jobs.transitions import Outcome
from nodes.executors.base import RunContext, _outcome


class SimulateExecutor:
    """A simulated unstable network: seeded random delay, error or timeout per attempt."""

    def run(self, task: ClaimedTask, ctx: RunContext) -> Outcome:
        config = ctx.service_config
        ctx.on_started(os.getpid())
        rng = random.Random(f"{config.get('seed', 0)}:{task.id}:{task.attempt}")
        delay = rng.uniform(config.get("min_delay_ms", 5), config.get("max_delay_ms", 50)) / 1000
        roll = rng.random()
        if roll < config.get("timeout_rate", 0):
            ctx.cancel.wait(min(task.timeout_seconds, delay * 10))
            return _outcome(task, "timeout", error=f"timeout: simulated network timeout (host {task.host})",
                            error_code="timeout")
        if ctx.cancel.wait(delay):
            return _outcome(task, "canceled", error="canceled")
        if roll < config.get("timeout_rate", 0) + config.get("error_rate", 0):
            ctx.log(f"connection to {task.host or 'target'} reset (simulated)", level="warn")
            return _outcome(task, "failed", error="simulated network error: connection reset", error_code="network")
        ctx.log(f"command acknowledged by {task.host or 'target'} after {delay * 1000:.0f} ms")
        return _outcome(task, "succeeded", results={"host": task.host, "latency_ms": round(delay * 1000, 1)})
