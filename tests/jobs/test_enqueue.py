"""Creating jobs (jobs/enqueue.py): both insert paths write the same job, and a fan-out job with no
host to run on is refused before anything is written (Python API: NoHostsError; HTTP API: 422)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from events.models import Event
from events.timeline import unfold
from jobs import api, enqueue
from jobs.models import Job, JobStep, Task
from nodes.models import Host, Node
from tests.api_helpers import client_for, user_with_token
from workflows.api import create_workflow
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db

# Columns that differ between any two jobs, however they were written.
JOB_VARYING = {"id", "order_seq", "created_at", "updated_at", "started_at", "scheduled_at", "external_id"}
TASK_VARYING = {"id", "job_id", "order_seq", "created_at", "updated_at", "next_attempt_at"}


def _one_statement_calls(monkeypatch) -> list[int]:
    """Count the one-statement starts (enqueue.insert_and_start), so a test knows which path it took."""
    calls: list[int] = []
    real = enqueue.insert_and_start

    def counting(**kwargs: Any):
        calls.append(1)
        return real(**kwargs)

    monkeypatch.setattr(enqueue, "insert_and_start", counting)
    return calls


def _written(job: Job) -> dict[str, Any]:
    """Return what starting ``job`` wrote: its row, its tasks, its step rows and its events, without ids and times."""
    row = {k: v for k, v in Job.objects.filter(pk=job.pk).values().get().items() if k not in JOB_VARYING}
    tasks = sorted(({k: v for k, v in t.items() if k not in TASK_VARYING}
                    for t in Task.objects.filter(job_id=job.pk).values()), key=lambda t: t["task_key"])
    steps = sorted(({k: v for k, v in s.items() if k not in {"id", "job_id"}}
                    for s in JobStep.objects.filter(job_id=job.pk).values()), key=lambda s: s["position"])
    # Compared as the timeline shows them: the one-statement start records the job's creation in
    # one row, the batch insert in two (created queued, then admitted), and both show the same lines.
    events = sorted(json.dumps([e.type, e.level, e.source, e.message, e.data], sort_keys=True)
                    for row in Event.objects.filter(job_id=job.pk) for e in unfold(row))
    return {"job": row, "tasks": tasks, "steps": steps, "events": events}


@pytest.mark.parametrize("target", ["service", "workflow"])
def test_both_insert_paths_write_the_same_job_tasks_steps_and_events(make_service, monkeypatch, target):
    make_service("same-a", params_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    make_service("same-b", base_priority=3)
    create_workflow(name="same", steps=[
        {"key": "first", "service": "same-a", "depends_on": [], "default_params": {"n": 1}},
        {"key": "second", "service": "same-b", "depends_on": ["first"]},
    ])
    calls = _one_statement_calls(monkeypatch)
    options: dict[str, Any] = dict(priority=7, options={"note": "x"}, correlation_id="corr-1", source_ref="ref-1",
                                   dedupe_key=None)
    if target == "service":
        options.update(service="same-a", params={"n": 5})
    else:
        options.update(workflow="same", step_params={"second": {"m": 2}})

    one = api.start(api.JobSpec(external_id="one", **options))
    assert calls == [1], "a due job with no cap, approval or fan-out takes the one-statement start"
    # A scheduled time (already passed) sends the same job through the batch insert, then the
    # caller's transaction instantiates it as the builder would.
    other = api.start(api.JobSpec(external_id="other", scheduled_at=timezone.now() - timedelta(seconds=1), **options))
    assert calls == [1], "a job with a scheduled time takes the batch insert"

    first, second = _written(one), _written(other)
    assert first["job"]["status"] == "waiting" and first["job"]["current_task_key"] in {"first", "same-a"}
    assert first == second
    # The job object start() returns (built without reading the row back) says what the row says.
    stored = Job.objects.get(pk=one.pk)
    for name in ("status", "current_task_key", "priority", "options", "step_params", "order_seq", "created_at",
                 "started_at", "scheduled_at", "approval_state", "source", "source_ref", "correlation_id"):
        assert getattr(one, name) == getattr(stored, name), name


def test_both_insert_paths_are_built_from_one_column_list():
    columns = [column for column, _ in enqueue.JOB_COLUMNS]
    for sql in (enqueue.INSERT_JOBS_SQL, enqueue.START_NOW_SQL):
        head = sql[sql.index("INSERT INTO accs_job ("):]
        listed = [c.strip() for c in head[len("INSERT INTO accs_job ("):head.index(")")].split(",")]
        assert listed == columns
    with pytest.raises(ValueError, match="no job column"):
        enqueue.insert_job_sql(lambda name: name, stauts="'queued'")


# --------------------------------------------------------------------------------------------
# A fan-out workflow with no host to run on
# --------------------------------------------------------------------------------------------

@pytest.fixture
def fan(make_service):
    make_service("fan-ping")
    create_workflow(name="fan", steps=[{"key": "ping", "service": "fan-ping", "depends_on": [], "fan_out": "hosts"}])
    Node.objects.get_or_create(name="fan-node")
    return [Host.objects.create(name=f"fan-h{i}", node_id="fan-node", labels={"rack": "a"}) for i in range(2)]


def _nothing_written() -> None:
    assert not Job.objects.exists() and not Task.objects.exists() and not Event.objects.filter(job__isnull=False)


@pytest.mark.parametrize("options", [{}, {"hosts": []}, {"host_selector": {}}, {"hosts": [], "host_selector": {}}])
def test_a_fan_out_workflow_started_without_hosts_raises_and_writes_nothing(fan, options):
    with pytest.raises(api.NoHostsError) as raised:
        api.start_workflow("fan", options=options)
    assert isinstance(raised.value, DefinitionError)
    message = "; ".join(str(p) for p in raised.value.problems)
    assert "step 'ping' fans out over hosts" in message and "options.hosts" in message, message
    with pytest.raises(api.NoHostsError):
        api.validate(api.JobSpec(workflow="fan", options=options))
    with pytest.raises(api.NoHostsError):
        api.start_many([api.JobSpec(workflow="fan", options={"hosts": ["fan-h0"]}),
                        api.JobSpec(workflow="fan", options=options)])
    _nothing_written()


def test_a_host_selector_matching_no_host_is_refused_when_the_job_starts_now(fan):
    with pytest.raises(api.NoHostsError) as raised:
        api.start_workflow("fan", options={"host_selector": {"rack": "b"}})
    assert 'options.host_selector: {"rack": "b"} matches no host' in str(raised.value.problems[0])
    with pytest.raises(api.NoHostsError):
        api.validate(api.JobSpec(workflow="fan", options={"host_selector": {"rack": "b"}}))
    _nothing_written()

    job = api.start_workflow("fan", options={"host_selector": {"rack": "a"}})
    assert sorted(Task.objects.filter(job=job).values_list("task_key", flat=True)) == ["ping@fan-h0", "ping@fan-h1"]


def test_a_later_job_gets_its_hosts_when_the_builder_admits_it(fan):
    """A scheduled job's selector is read at admission: hosts may register before it is due."""
    later = timezone.now() + timedelta(hours=1)
    job = api.start_workflow("fan", options={"host_selector": {"rack": "b"}}, scheduled_at=later)
    assert Job.objects.get(pk=job.pk).status == "queued"
    Host.objects.create(name="fan-h9", node_id="fan-node", labels={"rack": "b"})
    assert api.transitions.start_due_jobs(now=later + timedelta(seconds=1)) == [job.id]
    assert list(Task.objects.filter(job=job).values_list("task_key", flat=True)) == ["ping@fan-h9"]


def test_the_http_api_answers_422_for_a_fan_out_workflow_without_hosts(fan, default_tenant):
    _, token = user_with_token("root", superuser=True)
    client = client_for(token)
    for body in ({"workflow": "fan"}, {"workflow": "fan", "options": {"hosts": []}},
                 {"workflow": "fan", "options": {"host_selector": {"rack": "b"}}}):
        response = client.post("/api/v1/jobs", body, content_type="application/json")
        assert response.status_code == 422, (body, response.status_code, response.content)
        detail = response.json()["detail"]
        assert "fans out over hosts" in detail or "matches no host" in detail, detail
    _nothing_written()
    created = client.post("/api/v1/jobs", {"workflow": "fan", "options": {"hosts": ["fan-h1"]}},
                          content_type="application/json")
    assert created.status_code == 201, created.content
