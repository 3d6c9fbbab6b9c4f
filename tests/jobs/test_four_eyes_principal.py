"""Who did it is who did it: a trigger's job is the event sender's, a schedule's is nobody's, and
four eyes bars the sender, the trigger's creator and its last editor from approving it.

Through the HTTP API (tokens and the admin's session) and the admin's action, as an attacker
would: the sender of an event approving the job it started was the bypass.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api, triggers
from jobs.models import Job, JobSource
from tests.api_helpers import client_for, user_with_token

pytestmark = pytest.mark.django_db

JSON = "application/json"


@pytest.fixture
def team(make_service, default_tenant) -> dict[str, Any]:
    """An approval-gated service and four tenant admins with tokens: the trigger's creator (bob),
    its editor (dave), the event's sender (alice) and an uninvolved approver (carol)."""
    make_service("reboot", requires_approval=True)
    people: dict[str, Any] = {}
    for name in ("alice", "bob", "carol", "dave"):
        user, token = user_with_token(name, tenants={default_tenant: "admin"})
        people[name] = (user, client_for(token))
    return people


def _event_trigger(team: dict[str, Any], tenant, *, created_by: str = "bob"):
    return triggers.create_trigger(tenant=tenant, created_by=team[created_by][0], label="reboot on alarm",
                                   trigger_type="event", event_name="alarm", service="reboot",
                                   dedupe_window_seconds=0)


def _send(http: Client, name: str = "alarm") -> Job:
    sent = http.post(f"/api/v1/events/{name}", {"context": {}}, content_type=JSON)
    assert sent.status_code == 201 and sent.json()["errors"] == [], sent.content
    (job_id,) = sent.json()["jobs"]
    return Job.objects.get(pk=job_id)


def _approve(http: Client, job: Job) -> tuple[int, str]:
    answer = http.post(f"/api/v1/jobs/{job.id}/approve")
    return answer.status_code, answer.json().get("detail", answer.json().get("message", ""))


def test_the_sender_of_an_event_may_not_approve_the_job_it_started(team, default_tenant):
    _event_trigger(team, default_tenant)
    job = _send(team["alice"][1])
    assert (job.source, job.created_by, job.approval_state) == (JobSource.EVENT, team["alice"][0], "pending")
    status, detail = _approve(team["alice"][1], job)
    assert status == 403 and "alice started this job and may not approve it" in detail
    status, detail = _approve(team["bob"][1], job)
    assert status == 403 and "bob created or last changed the trigger" in detail
    assert _approve(team["carol"][1], job)[0] == 200
    job.refresh_from_db()
    assert (job.approval_state, job.approved_by) == ("approved", "carol")


def test_editing_another_admins_trigger_bars_the_editor_and_keeps_the_creator_barred(team, default_tenant):
    trigger = _event_trigger(team, default_tenant)
    edited = team["dave"][1].patch(f"/api/v1/jobs/triggers/{trigger.id}", {"priority": 5}, content_type=JSON)
    assert edited.status_code == 200, edited.content
    job = _send(team["alice"][1])
    for name in ("alice", "bob", "dave"):
        assert _approve(team[name][1], job)[0] == 403, f"{name} should be barred"
    assert _approve(team["carol"][1], job)[0] == 200


def test_the_admin_action_is_refused_to_the_trigger_editor_too(team, default_tenant):
    trigger = _event_trigger(team, default_tenant)
    dave = team["dave"][0]
    dave.is_staff = True
    dave.save()
    browser = Client()
    browser.force_login(dave)
    triggers.update_trigger(trigger, by=dave, label="reboot on alarm (edited)")
    job = _send(team["alice"][1])
    browser.post(f"/admin/jobs/job/{job.id}/act/approve/")
    job.refresh_from_db()
    assert job.approval_state == "pending", "the trigger's editor approved its job through the admin"


def test_an_event_sent_from_the_admin_session_is_the_session_users(team, default_tenant):
    _event_trigger(team, default_tenant)
    alice = team["alice"][0]
    alice.is_staff = True
    alice.save()
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    browser.get("/admin/")
    token = browser.cookies["csrftoken"].value
    sent = browser.post("/api/v1/events/alarm", {"context": {}}, content_type=JSON, headers={"X-CSRFToken": token})
    assert sent.status_code == 201, sent.content
    job = Job.objects.get(pk=sent.json()["jobs"][0])
    assert job.created_by == alice
    assert browser.post(f"/api/v1/jobs/{job.id}/approve", headers={"X-CSRFToken": token}).status_code == 403


def test_a_schedules_job_is_nobodys_and_its_creator_and_editor_may_not_approve_it(team, default_tenant):
    now = timezone.now().replace(second=0, microsecond=0)
    trigger = triggers.create_trigger(tenant=default_tenant, created_by=team["bob"][0], label="nightly",
                                      trigger_type="schedule", cron_expr="* * * * *", timezone="UTC",
                                      service="reboot", now=now)
    triggers.update_trigger(trigger, by=team["dave"][0], priority=3, now=now)
    assert triggers.fire_due_schedules(now=trigger.next_run_at + timedelta(seconds=1)) == 1
    job = Job.objects.get(source_ref=f"trigger:{trigger.id}")
    assert (job.source, job.created_by) == (JobSource.SCHEDULE, None)
    for name in ("bob", "dave"):
        assert _approve(team[name][1], job)[0] == 403, f"{name} configured the schedule; may not approve"
    assert _approve(team["alice"][1], job)[0] == 200


def test_run_now_is_the_operators_job(team, default_tenant):
    trigger = triggers.create_trigger(tenant=default_tenant, created_by=team["bob"][0], label="nightly",
                                      trigger_type="schedule", cron_expr="0 2 * * *", timezone="UTC",
                                      service="reboot")
    assert triggers.run_now(trigger.id, by="carol").changed
    job = Job.objects.get(source_ref=f"trigger:{trigger.id}")
    assert job.created_by == team["carol"][0]
    assert not api.approve(job.id, by="carol").changed
    assert not api.approve(job.id, by="bob").changed
    assert api.approve(job.id, by="alice").changed


ROLES = ("creator", "editor", "sender")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cast=st.fixed_dictionaries({role: st.sampled_from(["alice", "bob", "carol", "dave", None]) for role in ROLES}),
       approver=st.sampled_from(["alice", "bob", "carol", "dave"]))
def test_whoever_created_edited_or_sent_may_not_approve_and_anyone_else_may(team, default_tenant, cast, approver):
    users = {name: user for name, (user, _) in team.items()}
    with transaction.atomic():
        trigger = triggers.create_trigger(tenant=default_tenant, created_by=users.get(cast["creator"]),
                                          label="generated", trigger_type="event", event_name="generated",
                                          service="reboot", dedupe_window_seconds=0)
        if cast["editor"]:
            triggers.update_trigger(trigger, by=users[cast["editor"]], priority=1)
        (job,) = api.emit_event("generated", {}, tenant=default_tenant, sent_by=users.get(cast["sender"])).jobs
        barred = {name for name in cast.values() if name}
        result = api.approve(job.id, by=approver)
        assert result.changed == (approver not in barred), (cast, approver, result.message)
        assert result.forbidden == (approver in barred)
        transaction.set_rollback(True)
