"""JSON logging (placeholder formatter; the EventBridge handler lands with the engine)."""

import json
import logging
from datetime import datetime, timezone


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
