"""A paused tenant against real agent processes: three agents race for two tenants' queued tasks; the paused
tenant's are never claimed while the other's all run, its task already running finishes, and once resumed
its tasks run too."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import api
from jobs.models import Attempt, Task
from tests.daemons import wait_for
from workflows import governor

pytestmark = pytest.mark.django_db(transaction=True)

SCHEMA = {"type": "object", "properties": {"release": {"type": "string"}, "limit": {"type": "number"}}}


def _statuses(tenant) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in Task.objects.filter(tenant=tenant).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


def test_agents_never_claim_a_paused_tenants_tasks_and_take_them_once_resumed(make_service, daemons, tenants,
                                                                                tmp_path: Path):
    make_service("work", executor_config={"callable": "tests.callables:until_released"}, params_schema=SCHEMA)
    hold, done = tmp_path / "hold", tmp_path / "done"
    done.touch()  # the bulk tasks finish at once; the long one runs until the test releases it
    long_job = api.start_service("work", tenant=tenants.acme, params={"release": str(hold)})
    daemons.builder()  # admits the jobs started below and finishes them
    daemons.agents_together(["pause-a", "pause-b", "pause-c"], "work", "--max-concurrent", "4")
    wait_for(lambda: Task.objects.filter(job=long_job, status="running").exists(), timeout=60,
             message="acme's long task to run")

    governor.pause_tenant(tenants.acme, reason="invoice dispute", by="alice")
    api.start_many([api.JobSpec(service="work", tenant=tenant, params={"release": str(done)})
                    for _ in range(30) for tenant in (tenants.acme, tenants.globex)])

    wait_for(lambda: _statuses(tenants.globex) == {"done": 30}, timeout=120,
             message=f"globex's 30 tasks to run while acme is paused ({_statuses(tenants.globex)})")
    assert _statuses(tenants.acme) == {"queued": 30, "running": 1}, _statuses(tenants.acme)
    bulk = Task.objects.filter(tenant=tenants.acme).exclude(job=long_job)
    assert not Attempt.objects.filter(task__in=bulk).exists(), "no agent ever claimed a paused tenant's task"

    hold.touch()
    wait_for(lambda: Task.objects.filter(job=long_job, status="done").exists(), timeout=60,
             message="acme's task that ran before the pause to finish")
    assert _statuses(tenants.acme) == {"queued": 30, "done": 1}, "still paused: the queue stays"

    assert governor.resume_tenant(tenants.acme, by="bob")
    wait_for(lambda: _statuses(tenants.acme) == {"done": 31}, timeout=120,
             message=f"acme's tasks to run once resumed ({_statuses(tenants.acme)})")
