"""A job's creation with its tasks is one timeline row, whichever path starts it, and the timeline
shows it as the lines it stands for: the job's moves and one "task created" line per task."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from events.models import Event
from events.timeline import unfold
from jobs import api
from jobs.models import Task
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db


@pytest.fixture
def pair(make_service):
    make_service("first")
    make_service("second")
    create_workflow(name="pair", steps=[
        {"key": "fetch", "service": "first"},
        {"key": "store", "service": "second", "depends_on": ["fetch"]},
    ])


def test_a_job_started_at_once_writes_one_event_naming_its_tasks(pair):
    job = api.start_workflow("pair")
    (row,) = Event.objects.filter(job_id=job.pk)
    tasks = {t.task_key: t for t in Task.objects.filter(job=job)}
    assert row.task_id is None and row.type == "status" and row.source == "api:manual"
    assert row.message == "job created waiting, 2 tasks: 1 queued, 1 waiting"
    assert row.data == {"from": "created", "to": "waiting", "approval": "not_required", "tasks": [
        {"id": str(tasks["fetch"].pk), "task_key": "fetch", "to": "queued"},
        {"id": str(tasks["store"].pk), "task_key": "store", "to": "waiting"}]}
    lines = unfold(row)
    assert [(line.task_id, line.message) for line in lines] == [
        (None, "job created queued"), (None, "job queued → waiting (tasks created)"),
        (tasks["fetch"].pk, "task created queued"), (tasks["store"].pk, "task created waiting")]
    assert {(line.ts, line.source) for line in lines} == {(row.ts, row.source)}


def test_a_job_admitted_later_writes_its_creation_then_one_admission_event(pair):
    job = api.start_workflow("pair", scheduled_at=timezone.now() - timedelta(seconds=1))
    created, admitted = Event.objects.filter(job_id=job.pk).order_by("id")
    assert created.message == "job created queued" and unfold(created) == [created]
    assert admitted.message == "job queued → waiting, 2 tasks: 1 queued, 1 waiting"
    assert [t["task_key"] for t in admitted.data["tasks"]] == ["fetch", "store"]
    assert [line.message for line in unfold(admitted)] == [
        "job queued → waiting (tasks created)", "task created queued", "task created waiting"]


def test_other_events_are_shown_as_they_are(pair):
    job = api.start_workflow("pair")
    other = Event(job_id=job.pk, type="status", message="job waiting → running", data={"from": "waiting",
                                                                                       "to": "running"})
    assert unfold(other) == [other]
