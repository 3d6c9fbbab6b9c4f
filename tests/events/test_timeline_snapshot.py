"""The same history, however the engine records it: a fixed script of starts, claims, progress,
a failure and its retry, a cancel and a job admitted through the general path, rendered the way
operators and clients see it (the job page's timeline, the event list searched by task id, the
API's job and attempts), with ids and times normalised, compared with a recorded snapshot.

A change to how events are stored must keep every status change visible, in order, with its time
and actor. To record the snapshot anew (only when the rendering is meant to change, in a commit of
its own that says why): ``ACCS_RECORD_SNAPSHOT=1 pytest tests/events/test_timeline_snapshot.py``.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from jobs import api, transitions
from jobs.models import Job, Task
from tests.api_helpers import client_for, user_with_token
from tests.engine_helpers import claim_for, run_fail, run_ok
from tests.ops_helpers import make_user
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db

SNAPSHOT = Path(__file__).with_name("timeline_snapshot.json")

UUID_RE = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}")
ISO_RE = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2}| UTC)?")
SHORT_ID_RE = re.compile(r"\b[0-9a-f]{10}\b")
CLOCK_RE = re.compile(r"\b\d{2}:\d{2}:\d{2}\.\d{3}\b")
#: Numbers that differ from run to run (sequences, measured durations) whatever the history.
VOLATILE_KEYS = {"order_seq", "delay_seconds"}


class Ids:
    """Name each id by the order it first appears in, so two runs compare equal."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def __call__(self, match: re.Match) -> str:
        raw = match.group(0).replace("-", "")
        if raw not in self.names and raw[-10:] in self.names:  # seen first by its short id
            self.names[raw] = self.names[raw[-10:]]
        return self.names.setdefault(raw, f"<id{len(self.names) + 1}>")

    def short(self, match: re.Match) -> str:
        """Name a short id (an id's last digits, as lists show it) as the id it ends."""
        tail = match.group(0)
        for raw, name in self.names.items():
            if raw.endswith(tail):
                return name
        return self.names.setdefault(tail, f"<id{len(self.names) + 1}>")


def normalise(value: Any, ids: Ids) -> Any:
    if isinstance(value, dict):
        return {k: ("<n>" if k in VOLATILE_KEYS and value[k] is not None else normalise(v, ids))
                for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, ids) for v in value]
    if isinstance(value, str):
        value = ISO_RE.sub("<t>", value)
        value = CLOCK_RE.sub("<t>", value)
        return SHORT_ID_RE.sub(ids.short, UUID_RE.sub(ids, value))
    return value


def cells(row_html: str) -> list[str]:
    """Return the text of each cell of a table row."""
    found = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row_html, re.S)
    return [" ".join(unescape(re.sub(r"<[^>]+>", " ", c)).split()) for c in found]


def timeline_rows(body: str) -> list[list[str]]:
    """The job page's timeline, oldest first, one list of cells per row (the time cell with its title)."""
    rows = []
    for match in re.finditer(r'<tr class="accs-event"[^>]*>(.*?)</tr>', body, re.S):
        title = re.search(r'class="accs-time" title="([^"]*)"', match.group(1))
        rows.append([title.group(1) if title else "", *cells(match.group(1))])
    return rows[::-1]


def event_list_rows(body: str) -> list[list[str]]:
    """The admin's event list: its result rows' cells, oldest first."""
    table = re.search(r'<table id="result_list".*?</table>', body, re.S)
    if table is None:
        return []
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(0).split("</thead>", 1)[-1], re.S)
    return [cells(r)[1:] for r in rows][::-1]  # the first cell is the row's checkbox


def script(make_service) -> dict[str, Job]:
    """Drive the fixed history: every kind of start and the common moves after it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    one = make_service("one", max_attempts=3, params_schema=schema)
    first = make_service("first", max_attempts=1)
    second = make_service("second")
    create_workflow(name="pair", steps=[
        {"key": "fetch", "service": "first"},
        {"key": "store", "service": "second", "depends_on": ["fetch"]},
    ])
    jobs = {
        "done": api.start_service("one", params={"n": 1}),
        "retried": api.start_workflow("pair"),
        "canceled": api.start_service("one", params={"n": 2}),
        # A past scheduled time takes the general path: inserted queued, admitted in the same call.
        "admitted": api.start_service("one", params={"n": 3}, scheduled_at=timezone.now() - timedelta(seconds=1)),
    }
    # The one-task job: claimed, running, progress, done.
    (task,) = claim_for(one, 1)
    assert task.job_id == jobs["done"].id
    transitions.mark_running([(task.id, task.attempt, 4242)], agent_id="agent-t", source="agent:test")
    assert transitions.report_progress([(task.id, task.attempt, 0.5)], source="agent:test") == 1
    run_ok([task])
    # The workflow: its first step fails for good, the operator retries the job, both steps finish.
    run_fail(claim_for(first, 1))
    assert api.retry(jobs["retried"].id, by="ops").changed
    run_ok(claim_for(first, 1))
    run_ok(claim_for(second, 1))
    # The canceled job: claimed, then canceled by an operator while it runs.
    (task,) = claim_for(one, 1)
    assert task.job_id == jobs["canceled"].id
    assert api.cancel(jobs["canceled"].id, by="ops").changed
    # The job admitted through the general path runs to the end.
    run_ok(claim_for(one, 1))
    return {name: Job.objects.get(pk=job.pk) for name, job in jobs.items()}


def render(jobs: dict[str, Job]) -> dict[str, Any]:
    admin = Client()
    admin.force_login(make_user("snap-root", superuser=True))
    _, token = user_with_token("snap-api", superuser=True)
    http = client_for(token)
    out: dict[str, Any] = {}
    for name, job in jobs.items():
        page = admin.get(reverse("admin:jobs_job_change", args=[job.pk]))
        assert page.status_code == 200
        tasks = Task.objects.filter(job=job).order_by("task_key")
        by_task = {}
        for task in tasks:
            found = admin.get(reverse("admin:events_event_changelist"), {"q": str(task.pk)})
            assert found.status_code == 200
            by_task[task.task_key] = event_list_rows(found.content.decode())
        detail = http.get(f"/api/v1/jobs/{job.pk}")
        attempts = http.get(f"/api/v1/jobs/{job.pk}/attempts")
        assert detail.status_code == attempts.status_code == 200
        out[name] = {
            "timeline": timeline_rows(page.content.decode()),
            "events_by_task": by_task,
            "api_job": detail.json(),
            "api_attempts": attempts.json(),
        }
    return out


def test_rendered_history_matches_the_recorded_snapshot(make_service, default_tenant, settings):
    settings.TIME_ZONE = "UTC"
    rendered = normalise(render(script(make_service)), Ids())
    if os.environ.get("ACCS_RECORD_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(rendered, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    recorded = json.loads(SNAPSHOT.read_text())
    for name in recorded:
        for part in recorded[name]:
            assert rendered[name][part] == recorded[name][part], f"{name}: {part} differs from the snapshot"
    assert rendered == recorded
