"""A long task for the outage test: it works for a while and logs to its job's timeline every half second."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("accs.test.outage")


def work(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Work ``seconds`` (stopping early when the agent asks), logging with the job's context as it goes."""
    deadline = time.monotonic() + float(params["seconds"])
    lines = 0
    while time.monotonic() < deadline and not ctx.cancel.wait(0.5):
        lines += 1
        # Through the timeline log handler, in the agent's process: also while the database is down.
        log.info("still working (%d)", lines, extra={"job_id": ctx.task.job_id, "task_id": ctx.task.id,
                                                     "attempt": ctx.task.attempt})
    return {"lines": lines}
