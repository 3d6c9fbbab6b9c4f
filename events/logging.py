"""Console logging (JSON lines or readable text) and the EventBridge (records naming a job land on its timeline).

``JsonFormatter`` prints one JSON object per line (daemons, executors), keeping the job/task
context fields; ``TextFormatter`` prints the same as one readable line for a person at a
terminal. :func:`console_formatter` picks one: ``ACC_LOG_FORMAT=json`` or ``text`` decides, and
by default (``auto``) a terminal gets text and anything else (a file, a pipe, journald) JSON.
``EventBridgeHandler`` also writes records that carry a ``job_id`` (and
optionally ``task_id``) to the timeline, so a daemon's log line about a task shows on that task's
page. Use it through the standard ``logging`` API:

    log.warning("disk almost full", extra={"job_id": job.id, "task_id": task.id})
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import datetime, timezone
from typing import TextIO

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


class TextFormatter(logging.Formatter):
    """Format a record as one readable line: UTC time, level, logger, message, then the context."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}"
        context = [f"{key}={getattr(record, key)}" for key in JsonFormatter.CONTEXT
                   if getattr(record, key, None) is not None]
        if context:
            line += f"  [{' '.join(context)}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def choose_format(setting: str, stream: TextIO | None) -> str:
    """Return ``"text"`` or ``"json"``: what ``setting`` names, else text when ``stream`` is a terminal."""
    if setting in ("text", "json"):
        return setting
    try:
        return "text" if stream is not None and stream.isatty() else "json"
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return "json"


def console_formatter() -> logging.Formatter:
    """Build the console handler's formatter (``LOGGING`` names this factory); the handler writes to stderr."""
    from accs_site.conf import SettingError, accs

    try:
        setting = accs.log_format
    except SettingError:
        setting = "auto"  # the system check reports the bad value; logging must come up regardless
    return TextFormatter() if choose_format(setting, sys.stderr) == "text" else JsonFormatter()


def _redact(text: str, secrets: list[str]) -> str:
    """Replace each of the process's secret values in a line bound for the timeline with ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class EventBridgeHandler(logging.Handler):
    """Write log records that carry a ``job_id`` to the timeline as ``log`` events."""

    _local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        job_id = getattr(record, "job_id", None)
        if job_id is None or getattr(self._local, "busy", False):
            return
        self._local.busy = True  # a database error logged while writing must not recurse
        try:
            from accs_site.conf import known_secrets  # imported late, like the timeline: logging is set up first
            from events.timeline import log_event

            secrets = known_secrets()
            message = _redact(record.getMessage(), secrets)[:2000]
            log_event(LEVELS.get(record.levelno, "info"), "log", message,
                      {"logger": record.name,
                       **({"exc": _redact(self.format(record), secrets)} if record.exc_info else {})},
                      job_id=job_id, job_task_id=getattr(record, "task_id", None),
                      attempt=getattr(record, "attempt", None),
                      source=getattr(record, "source", None) or f"log:{record.name}")
        except Exception:  # noqa: BLE001 - logging must never break the caller
            self.handleError(record)
        finally:
            self._local.busy = False
