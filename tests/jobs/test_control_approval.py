"""Approval: jobs of services that require approval wait; every path that could run or retry
them before approval is tried and refused; approve makes them runnable; reject cancels them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs import api, transitions, triggers
from jobs.models import Job, Task
from tests.api_helpers import client_for, user_with_token
from tests.engine_helpers import claim_for, run_ok
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db

FAR_FUTURE = timedelta(days=365)


@pytest.fixture
def reboot(make_service):
    return make_service("reboot", requires_approval=True)


@pytest.fixture
def admin(default_tenant):
    user, token = user_with_token("root", superuser=True)
    return user, client_for(token)


def assert_not_run(job: Job) -> None:
    job.refresh_from_db()
    assert job.started_at is None and job.status in ("queued", "canceled"), (job.status, job.started_at)
    assert not Task.objects.filter(job=job).exists(), "no task exists, so no agent can claim one"


def test_every_path_refuses_to_run_an_unapproved_job(reboot, make_service, default_tenant, admin):
    _, http = admin
    make_service("notify")
    create_workflow(name="maint", steps=[{"key": "notify", "service": "notify"},
                                         {"key": "reboot", "service": "reboot", "depends_on": ["notify"]}])
    triggers.create_trigger(tenant=default_tenant, label="on alarm", trigger_type="event", event_name="alarm",
                            service="reboot")
    jobs = [
        api.start_service("reboot"),
        api.start_workflow("maint"),  # one step needing approval holds the whole job
        Job.objects.get(pk=api.start_many([api.JobSpec(service="reboot")])[0]),
        api.emit_event("alarm", {}).jobs[0],
    ]
    http_job = http.post("/api/v1/jobs", {"service": "reboot"}, content_type="application/json").json()
    jobs.append(Job.objects.get(pk=http_job["id"]))
    assert {(j.approval_state, j.status) for j in jobs} == {("pending", "queued")}

    # The builder does not instantiate them, however late it looks.
    assert transitions.start_due_jobs(now=timezone.now() + FAR_FUTURE) == []
    # Agents find nothing to claim.
    assert claim_for(reboot, now=timezone.now() + FAR_FUTURE) == []
    for job in jobs:
        # Python API: retry refuses; approve is the only way forward.
        assert not api.retry(job.id, by="x").changed
        # HTTP: retry is a conflict, and so is rejecting-then-approving below.
        assert http.post(f"/api/v1/jobs/{job.id}/retry").status_code == 409
        assert_not_run(job)

    # Canceling an unapproved job and retrying it does not sneak it past approval: the retry puts
    # it back to waiting for approval (it is not stuck), and only an approval lets it run.
    canceled = jobs[0]
    assert api.cancel(canceled.id, by="x").changed
    refused = api.approve(canceled.id, by="x")
    assert not refused.changed and "retry it first" in refused.message, "a canceled job cannot be approved into running"
    result = api.retry(canceled.id, by="x")
    assert result.changed and "waiting for approval" in result.message
    assert http.post(f"/api/v1/jobs/{canceled.id}/retry").status_code == 409  # queued again: nothing to retry
    assert transitions.start_due_jobs(now=timezone.now() + FAR_FUTURE) == []
    assert_not_run(canceled)
    assert Job.objects.get(pk=canceled.id).approval_state == "pending"

    # The admin: its form cannot edit state, and its retry button and bulk action go through
    # the same transition, which refuses.
    http.force_login(admin[0])
    response = http.post(f"/admin/jobs/job/{jobs[1].id}/change/", {"status": "running", "approval_state": "approved"})
    assert response.status_code == 403
    http.post(f"/admin/jobs/job/{canceled.id}/act/retry/")
    http.post("/admin/jobs/job/", {"action": "retry_jobs", "_selected_action": [str(j.id) for j in jobs]})
    assert transitions.start_due_jobs(now=timezone.now() + FAR_FUTURE) == []
    for job in jobs:
        assert_not_run(job)
        assert job.approval_state == "pending"


def test_instantiating_an_unapproved_job_directly_is_refused(reboot):
    job = api.start_service("reboot")
    assert transitions.start_jobs([job.id]) == []


def test_rejected_job_is_canceled_and_can_never_run(reboot, admin):
    _, http = admin
    job = api.start_service("reboot")
    response = http.post(f"/api/v1/jobs/{job.id}/reject", {"reason": "not during business hours"},
                         content_type="application/json")
    assert response.status_code == 200, response.content
    job.refresh_from_db()
    assert (job.status, job.approval_state, job.error_code) == ("canceled", "rejected", "rejected")
    assert job.error_message == "not during business hours"
    assert http.post(f"/api/v1/jobs/{job.id}/approve").status_code == 409
    assert http.post(f"/api/v1/jobs/{job.id}/reject", content_type="application/json").status_code == 409
    assert not api.approve(job.id).changed and not api.retry(job.id).changed
    assert transitions.start_due_jobs(now=timezone.now() + FAR_FUTURE) == []
    assert claim_for(reboot) == []
    assert_not_run(job)


def test_approved_job_is_started_by_the_builder_and_runs(reboot, admin):
    _, http = admin
    job = api.start_service("reboot")
    response = http.post(f"/api/v1/jobs/{job.id}/approve")
    assert response.status_code == 200 and response.json()["job"]["approval_state"] == "approved"
    assert http.post(f"/api/v1/jobs/{job.id}/approve").status_code == 409, "approving twice changes nothing"
    assert transitions.start_due_jobs() == [job.id]
    run_ok(claim_for(reboot))
    job.refresh_from_db()
    assert (job.status, job.approved_by) == ("done", "root")


def test_the_user_who_started_a_job_may_not_approve_it_another_approver_may(reboot, default_tenant):
    starter, starter_token = user_with_token("alice", tenants={default_tenant: "admin"})
    _, other_token = user_with_token("bob", tenants={default_tenant: "admin"})
    starter_http, other_http = client_for(starter_token), client_for(other_token)
    created = starter_http.post("/api/v1/jobs", {"service": "reboot"}, content_type="application/json")
    assert created.status_code == 201, created.content
    job = Job.objects.get(pk=created.json()["id"])
    assert job.created_by == starter

    # Every path names its operator: the HTTP API (403, saying why), the Python API, the admin.
    refused = starter_http.post(f"/api/v1/jobs/{job.id}/approve")
    assert refused.status_code == 403, refused.content
    assert "alice started this job and may not approve it" in refused.json()["detail"]
    result = api.approve(job.id, by="alice")
    assert (result.changed, result.forbidden) == (False, True)
    starter.is_staff = True
    starter.save()
    admin_client = Client()
    admin_client.force_login(starter)
    admin_client.post(f"/admin/jobs/job/{job.id}/act/approve/")
    job.refresh_from_db()
    assert job.approval_state == "pending" and transitions.start_due_jobs() == []

    approved = other_http.post(f"/api/v1/jobs/{job.id}/approve")
    assert approved.status_code == 200, approved.content
    job.refresh_from_db()
    assert (job.approval_state, job.approved_by) == ("approved", "bob")


def test_a_site_may_let_creators_approve_their_own_jobs(reboot, default_tenant, monkeypatch):
    from accs_site.conf import reload

    _, token = user_with_token("carol", tenants={default_tenant: "admin"})
    http = client_for(token)
    job_id = http.post("/api/v1/jobs", {"service": "reboot"}, content_type="application/json").json()["id"]
    monkeypatch.setenv("ACC_ALLOW_SELF_APPROVAL", "true")
    reload()
    try:
        assert http.post(f"/api/v1/jobs/{job_id}/approve").status_code == 200
    finally:
        monkeypatch.delenv("ACC_ALLOW_SELF_APPROVAL")
        reload()
