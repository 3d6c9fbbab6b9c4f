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
import time
from collections import deque
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from events.timeline import EventRow

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
    # Imported late: LOGGING builds this formatter while settings load, before Django's apps are ready.
    from accs_site.conf import SettingError, accs

    try:
        setting = accs.log_format
    except SettingError:
        setting = "auto"  # the system check reports the bad value; logging must come up regardless
    return TextFormatter() if choose_format(setting, sys.stderr) == "text" else JsonFormatter()


# While the database cannot take the timeline's lines, up to this many wait in memory; later
# ones are dropped and counted, and the count is reported once the database takes lines again.
BUFFER_LINES = 200
# After a failed write, lines only wait in memory for this long before the next try: a handler
# that tried the database on every line would slow every log call down to a connect timeout.
RETRY_SECONDS = 2.0

report_log = logging.getLogger("accs.events.logging")  # lines without job_id: never back into the timeline


class EventBridgeHandler(logging.Handler):
    """Write log records that carry a ``job_id`` to the timeline as ``log`` events.

    It never raises and never prints a traceback because the database is down: the lines wait
    in memory (:data:`BUFFER_LINES` at most, then they are dropped and counted) and are written
    with the next line once the database answers, followed by a warning, on the console and in
    the timeline, saying how many were dropped.
    """

    #: It keeps lines for the timeline only: a daemon whose ``accs`` logger has no other handler prints
    #: nothing (:func:`accs_site.daemon.ensure_daemon_logging` adds one).
    timeline_only = True

    _local = threading.local()

    def __init__(self, level: int = logging.NOTSET, *, buffer_lines: int = BUFFER_LINES,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        super().__init__(level)
        self.buffer_lines = buffer_lines
        self.retry_seconds = retry_seconds
        self.pending: deque[EventRow] = deque()  # lines waiting for the database
        self.dropped = 0
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._state = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        job_id = getattr(record, "job_id", None)
        if job_id is None or getattr(self._local, "busy", False):
            return
        self._local.busy = True  # a database error logged while writing must not recurse
        try:
            try:
                row = self._row(record, job_id)
            except Exception:  # noqa: BLE001 - a record that cannot be formatted: logging's own report
                self.handleError(record)
                return
            self._write(row)
        finally:
            self._local.busy = False

    def _row(self, record: logging.LogRecord, job_id: Any) -> EventRow:
        # Imported late: logging is configured before Django's apps (and so the timeline's models) are loaded.
        from accs_site.conf import known_secrets
        from accs_site.redaction import redact
        from events.timeline import EventRow

        secrets = known_secrets()
        return EventRow(type="log", level=LEVELS.get(record.levelno, "info"),
                        message=redact(record.getMessage(), secrets)[:2000],
                        data={"logger": record.name,
                              **({"exc": redact(self.format(record), secrets)} if record.exc_info else {})},
                        job_id=job_id, task_id=getattr(record, "task_id", None),
                        attempt=getattr(record, "attempt", None),
                        source=getattr(record, "source", None) or f"log:{record.name}")

    def _add(self, row: EventRow) -> None:
        """Keep ``row`` for later, or drop and count it when enough wait already (the caller holds ``_state``)."""
        if len(self.pending) < self.buffer_lines:
            self.pending.append(row)
        else:
            self.dropped += 1

    def _write(self, row: EventRow) -> None:
        """Write the waiting lines and this one, unless the database failed moments ago: then it waits too."""
        # Imported late, like the timeline above: logging is configured before Django's apps are.
        from django.db import connection, transaction

        # The timeline's models load with Django's apps, after logging is configured.
        from events.timeline import EventRow, write_events

        with self._state:
            if time.monotonic() < self._retry_at:
                self._add(row)
                return
            # Take the waiting lines: a thread that logs while this one writes must not write them again.
            batch = [*self.pending, row]
            self.pending.clear()
        waiting = len(batch) - 1
        try:
            # A savepoint inside the caller's transaction: a failed write must not break it.
            with transaction.atomic():
                write_events(batch)
        except Exception as exc:  # noqa: BLE001 - logging must never break the caller
            with self._state:
                # Back in front of what other threads added meanwhile, within the same bound (the oldest kept).
                kept = [*batch, *self.pending]
                self.pending = deque(kept[:self.buffer_lines])
                self.dropped += len(kept) - len(self.pending)
                self._retry_at = time.monotonic() + self.retry_seconds
                first = self._down_since is None
                if first:
                    self._down_since = time.monotonic()
            if first:
                report_log.warning("the timeline cannot take log lines (%s); up to %d wait in memory, later ones"
                                   " are dropped and counted", _first_line(exc), self.buffer_lines)
            _close_if_unusable(connection)
            return
        with self._state:
            dropped, self.dropped = self.dropped, 0
            down_since, self._down_since = self._down_since, None
        if down_since is None and not dropped:
            return
        message = (f"the timeline takes log lines again after {time.monotonic() - down_since:.0f}s: "
                   f"{waiting} waiting line(s) written, {dropped} dropped") if down_since is not None else (
                   f"{dropped} log line(s) for the timeline were dropped")
        report_log.log(logging.WARNING if dropped else logging.INFO, message)
        if dropped:
            try:
                with transaction.atomic():
                    write_events([EventRow(type="log", level="warn", source="log:accs.events.logging",
                                           message=message, data={"dropped": dropped})])
            except Exception:  # noqa: BLE001 - the console line above already says it
                pass


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _close_if_unusable(connection: Any) -> None:
    """Drop this thread's broken connection (outside a transaction), so a later line opens a new one."""
    try:
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        pass
