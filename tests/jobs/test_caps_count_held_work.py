"""Caps count what holds capacity: a job keeps its slot while any task of it is held.

``max_active_jobs`` and a tenant's ``max_in_flight`` are decided at admission
(:mod:`jobs.admission`). A job that ended ``canceled`` or ``error`` while a task of it still
runs still takes one slot until that task ends, whatever the job's own status.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api, transitions
from jobs.models import Job, Task
from tenants.models import Tenant
from tests.engine_helpers import claim_for, racing_builders, run_fail, run_ok
from workflows.api import create_workflow
from workflows.models import Service, Workflow

pytestmark = pytest.mark.django_db


def _capped(cap: str, svc: Service, *, name: str) -> Tenant | None:
    """A two-step workflow (two parallel roots) under one cap of one slot; return the tenant to start in."""
    steps = [{"key": "a", "service": svc.key, "depends_on": []}, {"key": "b", "service": svc.key, "depends_on": []}]
    create_workflow(name=name, steps=steps, max_active_jobs=1 if cap == "workflow" else 0)
    if cap == "tenant":
        return Tenant.objects.create(slug=f"t-{name}", name=name, max_in_flight=1)
    return None


def _start(name: str, tenant: Tenant | None) -> Job:
    return api.start_workflow(name, tenant=tenant) if tenant else api.start_workflow(name)


def _end_job_while_a_task_runs(how: str, job: Job, svc: Service):
    """Claim both tasks of ``job``, end the job (``canceled`` or ``error``), return the task still held."""
    held = claim_for(svc)
    assert {t.job_id for t in held} == {job.id} and len(held) == 2, held
    first, second = held
    if how == "canceled":
        assert transitions.cancel_job(job.id, by="op").changed
        run_ok([first])
    else:
        run_fail([first])
    job.refresh_from_db()
    assert job.status == how, job.status
    assert Task.objects.get(pk=second.id).status in ("starting", "running")
    return second


@pytest.mark.parametrize("cap", ["workflow", "tenant"])
@pytest.mark.parametrize("how", ["canceled", "error"])
def test_an_ended_job_keeps_its_slot_while_a_task_of_it_runs(make_service, cap, how):
    svc = make_service(f"held-{cap}-{how}", max_attempts=1)
    name = f"one-{cap}-{how}"
    tenant = _capped(cap, svc, name=name)
    first = _start(name, tenant)
    assert transitions.start_due_jobs() == [first.id]
    still_running = _end_job_while_a_task_runs(how, first, svc)
    second = _start(name, tenant)
    assert transitions.start_due_jobs() == [], "the ended job's running task still holds the one slot"
    second.refresh_from_db()
    assert second.status == "queued"
    run_ok([still_running])
    assert Task.objects.get(pk=still_running.id).status not in ("starting", "running")
    assert transitions.start_due_jobs() == [second.id], "the slot is free once the last held task ended"


def test_builders_racing_never_admit_past_a_held_task_of_a_canceled_job(make_service, transactional_db):
    svc = make_service("held-race", max_attempts=1)
    _capped("workflow", svc, name="held-race")
    first = api.start_workflow("held-race")
    assert transitions.start_due_jobs() == [first.id]
    _end_job_while_a_task_runs("canceled", first, svc)
    for _ in range(6):
        api.start_workflow("held-race")
    admitted = racing_builders(rounds=4, limit=2)
    assert admitted == [], "no builder may admit while the canceled job's task runs"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(min_value=1, max_value=3), held=st.integers(min_value=0, max_value=3),
       queued=st.integers(min_value=1, max_value=4))
def test_admission_never_exceeds_the_cap_counting_held_tasks_of_ended_jobs(make_service, cap, held, queued):
    """Generated: ``held`` canceled jobs with a running task each, then ``queued`` new jobs, cap ``cap``."""
    Job.objects.all().delete()
    svc = Service.objects.filter(key="held-gen").first() or make_service("held-gen", max_attempts=1)
    Workflow.objects.filter(name="held-gen").delete()
    create_workflow(name="held-gen", steps=[{"key": "s", "service": svc.key, "depends_on": []}],
                    max_active_jobs=cap)
    for _ in range(min(held, cap)):
        job = api.start_workflow("held-gen")
        assert transitions.start_due_jobs() == [job.id]
        claim_for(svc, 1)
        assert transitions.cancel_job(job.id, by="op").changed
    holding = Task.objects.filter(status__in=("starting", "running")).values("job_id").distinct().count()
    for _ in range(queued):
        api.start_workflow("held-gen")
    transitions.start_due_jobs()
    admitted = Job.objects.filter(status__in=("waiting", "running")).count()
    assert holding + admitted <= cap, (holding, admitted, cap)
    assert holding + admitted == min(cap, holding + queued), "admission fills the room that is left"
