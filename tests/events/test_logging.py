"""JSON logs on stdout, and records with job/task context on the timeline."""

from __future__ import annotations

import json
import logging

import pytest

from events.logging import JsonFormatter
from events.models import Event
from jobs import api

pytestmark = pytest.mark.django_db


def test_log_record_with_task_context_becomes_a_timeline_event(make_service):
    make_service("svc")
    job = api.start_service("svc")
    task = job.tasks.get()
    logging.getLogger("accs.test").warning("cooling down", extra={"job_id": job.id, "task_id": task.id, "attempt": 1})
    event = Event.objects.get(type="log", job_id=job.id)
    assert (event.level, event.message, event.task_id, event.attempt) == ("warn", "cooling down", task.id, 1)
    assert event.source == "log:accs.test"


def test_log_record_without_job_stays_off_the_timeline():
    before = Event.objects.count()
    logging.getLogger("accs.test").info("plain line")
    assert Event.objects.count() == before


def test_json_formatter_keeps_context_fields():
    record = logging.LogRecord("accs.agent", logging.INFO, __file__, 1, "claimed %d", (3,), None)
    record.job_id, record.node = "j-1", "n1"
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "claimed 3" and out["job_id"] == "j-1" and out["node"] == "n1" and out["level"] == "info"
