"""The buttons a job or task offers are exactly where its verb applies: both read jobs.states' verb table.

For every verb and every job (or task) status and approval state — with and without tasks that a
cancel told to stop, with and without a cancel already requested — the test builds that state on a
real PostgreSQL, asks which actions the page offers, then calls the verb: it must change something
exactly when the action was offered.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from jobs import transitions
from jobs.models import ApprovalState, Job, JobStatus, Task, TaskStatus
from jobs.states import JOB_FINAL, JOB_VERBS, TASK_FINAL, TASK_HELD, TASK_VERBS, job_actions_for, task_actions_for
from ops.jobpage import tasks_stopping
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db

JOB_VERB_FNS = {"retry": transitions.retry_job, "cancel": transitions.cancel_job, "approve": transitions.approve,
                "reject": transitions.reject}
TASK_VERB_FNS = {"retry": transitions.retry_task, "cancel": transitions.cancel_task}


@pytest.fixture
def service(make_service):
    return make_service("verb-svc", max_attempts=2)


def _job(tenant, service, *, status: str, approval: str) -> Job:
    now = timezone.now()
    return Job.objects.create(tenant=tenant, service=service, status=status, approval_state=approval,
                              finished_at=now if status in JOB_FINAL else None)


def _task(job: Job, service, *, status: str, key: str = "t", cancel_requested: bool = False) -> Task:
    now = timezone.now()
    held = status in TASK_HELD
    return Task.objects.create(
        job=job, tenant_id=job.tenant_id, task_key=key, step_key=key, service=service, status=status,
        order_seq=job.order_seq or 1, attempt=1 if held or status in TASK_FINAL else 0, max_attempts=2,
        claimed_by="agent-t" if held else "", lease_expires_at=now + timedelta(minutes=5) if held else None,
        started_at=now if held else None, finished_at=now if status in TASK_FINAL else None,
        cancel_requested_at=now if cancel_requested else None)


def _job_states():
    for status, approval in itertools.product(JobStatus.values, ApprovalState.values):
        for stopping in ((False, True) if status in JOB_FINAL else (False,)):
            yield status, approval, stopping


def _task_states():
    for status, approval in itertools.product(TaskStatus.values, ApprovalState.values):
        for cancel_requested in ((False, True) if status in TASK_HELD else (False,)):
            for stopping in ((False, True) if status in TASK_FINAL else (False,)):
                yield status, approval, cancel_requested, stopping


def test_every_job_verb_applies_exactly_where_its_action_is_offered(tenants, service):
    disagree = []
    for verb, (status, approval, stopping) in itertools.product(JOB_VERBS, _job_states()):
        job = _job(tenants.acme, service, status=status, approval=approval)
        job.refresh_from_db()
        if stopping:  # a task the job's cancel told to stop, still running
            _task(job, service, status="running", cancel_requested=True)
        offered = verb in job_actions_for(job, tasks_stopping=tasks_stopping(job))
        result = JOB_VERB_FNS[verb](job.pk, by="")
        if offered != result.changed:
            disagree.append(f"{verb} on a {status} job (approval {approval}, stopping {stopping}): offered {offered},"
                            f" verb says {result.changed} ({result.message})")
    assert not disagree, "\n".join(disagree)


def test_every_task_verb_applies_exactly_where_its_action_is_offered(tenants, service):
    disagree = []
    for verb, (status, approval, cancel_requested, stopping) in itertools.product(TASK_VERBS, _task_states()):
        # A finished task's job has finished too (and may have a task its cancel told to stop); a live one's runs.
        job_status = ("canceled" if stopping else "error") if status in TASK_FINAL else "running"
        job = _job(tenants.acme, service, status=job_status, approval=approval)
        job.refresh_from_db()
        task = _task(job, service, status=status, cancel_requested=cancel_requested)
        if stopping:
            _task(job, service, status="running", key="sibling", cancel_requested=True)
        offered = verb in task_actions_for(task, approval=job.approval_state, tasks_stopping=tasks_stopping(job))
        result = TASK_VERB_FNS[verb](task.pk, by="")
        if offered != result.changed:
            disagree.append(f"{verb} on a {status} task (approval {approval}, cancel requested {cancel_requested},"
                            f" stopping {stopping}): offered {offered}, verb says {result.changed} ({result.message})")
    assert not disagree, "\n".join(disagree)


def test_a_partial_jobs_page_offers_retry_and_the_button_retries_it(client, root, tenants, make_service):
    from jobs import api
    from tests.engine_helpers import claim_for, run_fail, run_ok
    from workflows.models import Service

    for key in ("a", "b"):
        make_service(f"svc-{key}", max_attempts=1)
    create_workflow(name="half", steps=[{"key": "a", "service": "svc-a"},
                                        {"key": "b", "service": "svc-b", "on_failure": "continue"}])
    job = api.start_workflow("half", tenant=tenants.acme)
    run_ok(claim_for(Service.objects.get(key="svc-a")))
    run_fail(claim_for(Service.objects.get(key="svc-b")))
    job.refresh_from_db()
    assert job.status == "partial", job.status
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert 'id="accs-job-retry"' in page
    client.post(reverse("admin:jobs_job_act", args=[job.pk, "retry"]))
    job.refresh_from_db()
    assert job.status in ("queued", "waiting"), job.status
