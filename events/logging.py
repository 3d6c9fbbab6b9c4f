"""JSON logging and the EventBridge (EVT2).

``JsonFormatter`` prints one JSON object per line on stdout (daemons, executors), keeping the
job/task context fields. ``EventBridgeHandler`` also writes records that carry a ``job_id`` (and
optionally ``task_id``) to the timeline, so a daemon's log line about a task shows on that task's
page. Use it through the standard ``logging`` API:

    log.warning("disk almost full", extra={"job_id": job.id, "task_id": task.id})
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone

LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
          logging.CRITICAL: "error"}


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object per line, keeping job/task context fields."""

    CONTEXT = ("job_id", "task_id", "service", "node", "attempt", "agent_id")

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in self.CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class EventBridgeHandler(logging.Handler):
    """Write log records that carry a ``job_id`` to the timeline as ``log`` events."""

    _local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        job_id = getattr(record, "job_id", None)
        if job_id is None or getattr(self._local, "busy", False):
            return
        self._local.busy = True  # a database error logged while writing must not recurse
        try:
            from events.timeline import log_event

            log_event(LEVELS.get(record.levelno, "info"), "log", record.getMessage()[:2000],
                      {"logger": record.name, **({"exc": self.format(record)} if record.exc_info else {})},
                      job_id=job_id, job_task_id=getattr(record, "task_id", None),
                      attempt=getattr(record, "attempt", None),
                      source=getattr(record, "source", None) or f"log:{record.name}")
        except Exception:  # noqa: BLE001 - logging must never break the caller
            self.handleError(record)
        finally:
            self._local.busy = False
