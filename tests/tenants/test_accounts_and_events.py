"""Scripted tenants, memberships and tokens (with expiry), events over HTTP, and the API's answers
to a reused external_id, a foreign tenant and literal braces in argv."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone

from jobs import triggers
from jobs.models import Job
from tenants.models import ApiToken, Tenant, TenantMembership
from tests.api_helpers import client_for, user_with_token
from workflows.api import save_service
from workflows.validation import DefinitionError

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture
def acme():
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def globex():
    return Tenant.objects.create(slug="globex", name="Globex")


@pytest.fixture
def sync_service(make_service):
    return make_service("sync", params_schema={"type": "object", "properties": {"id": {"type": "string"}}})


def test_a_deployment_scripts_tenants_members_and_tokens():
    get_user_model().objects.create_user("ops", "ops@example.test", None)
    assert "created tenant acme" in run("accs_tenant", "create", "acme", "--name", "Acme", "--timezone", "Europe/Oslo")
    assert "updated tenant acme" in run("accs_tenant", "create", "acme", "--max-in-flight", "5")
    assert "acme" in run("accs_tenant", "list")
    with pytest.raises(CommandError, match="unknown time zone"):
        run("accs_tenant", "create", "bad", "--timezone", "Mars/Base")

    assert "ops is viewer of acme" in run("accs_member", "add", "ops", "acme", "--role", "viewer")
    assert TenantMembership.objects.get(user__username="ops").role == "viewer"
    assert get_user_model().objects.get(username="ops").is_staff
    assert "acme" in run("accs_member", "list", "--tenant", "acme")
    with pytest.raises(CommandError, match="no tenant 'nope'"):
        run("accs_member", "add", "ops", "nope")

    raw = run("accs_token", "create", "ops", "ci", "--expires-in", "1h").strip()
    assert raw.startswith("accs_")
    assert client_for(raw).get("/api/v1/jobs").status_code == 200
    assert "active" in run("accs_token", "list", "--user", "ops")
    assert "revoked 1 token(s)" in run("accs_token", "revoke", "--prefix", raw[:12])
    assert client_for(raw).get("/api/v1/jobs").status_code == 401
    assert "removed" in run("accs_member", "remove", "ops", "acme")


def test_an_expired_token_is_refused():
    user = get_user_model().objects.create_superuser("root", "root@example.test", None)
    raw = run("accs_token", "create", "root", "short", "--expires-at", "2999-01-01T00:00:00Z").strip()
    assert client_for(raw).get("/api/v1/jobs").status_code == 200
    ApiToken.objects.filter(user=user).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert client_for(raw).get("/api/v1/jobs").status_code == 401
    assert "expired" in run("accs_token", "list")
    with pytest.raises(CommandError, match="duration"):
        run("accs_token", "create", "root", "x", "--expires-in", "soon")


def test_same_external_id_with_another_body_is_409_naming_the_job(acme, sync_service):
    _, token = user_with_token("alice", tenants={acme: "admin"})
    client = client_for(token)
    body = {"service": "sync", "params": {"id": "a"}, "external_id": "hook-1"}
    first = client.post("/api/v1/jobs", body, content_type="application/json")
    assert first.status_code == 201
    again = client.post("/api/v1/jobs", body, content_type="application/json")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    changed = client.post("/api/v1/jobs", {**body, "params": {"id": "b"}, "priority": 3},
                          content_type="application/json")
    assert changed.status_code == 409
    assert changed.json()["job_id"] == first.json()["id"]
    assert first.json()["id"] in changed.json()["detail"] and "params, priority" in changed.json()["detail"]
    assert Job.objects.count() == 1


def test_naming_a_tenant_that_is_not_yours_is_403(acme, globex):
    _, token = user_with_token("alice", tenants={acme: "admin"})
    client = client_for(token)
    assert client.get("/api/v1/jobs?tenant=acme").status_code == 200
    for path in ("/api/v1/jobs?tenant=globex", "/api/v1/jobs?tenant=nosuch", "/api/v1/jobs/summary?tenant=globex",
                 "/api/v1/jobs/triggers?tenant=globex"):
        answer = client.get(path)
        assert answer.status_code == 403, path
        assert "may not read tenant" in answer.json()["detail"]


def test_event_over_http_fires_triggers_once_per_event_id(acme, globex, sync_service):
    triggers.create_trigger(tenant=acme, label="on push", trigger_type="event", event_name="repo.pushed",
                            service="sync", payload_template={"id": "{{event.repo}}"}, dedupe_window_seconds=0)
    _, token = user_with_token("alice", tenants={acme: "admin"})
    client = client_for(token)
    body = {"context": {"repo": "r1"}, "event_id": "delivery-1"}
    first = client.post("/api/v1/events/repo.pushed", body, content_type="application/json")
    assert first.status_code == 201, first.json()
    assert first.json()["replayed"] is False and len(first.json()["jobs"]) == 1
    job = Job.objects.get(pk=first.json()["jobs"][0])
    assert job.tenant == acme and job.step_params == {"sync": {"id": "r1"}}

    again = client.post("/api/v1/events/repo.pushed", body, content_type="application/json")
    assert again.status_code == 200 and again.json()["replayed"] is True
    assert again.json()["jobs"] == first.json()["jobs"]
    assert Job.objects.count() == 1

    reused = client.post("/api/v1/events/repo.pushed", {**body, "context": {"repo": "r2"}},
                         content_type="application/json")
    assert reused.status_code == 409 and "delivery-1" in reused.json()["detail"]
    without_id = client.post("/api/v1/events/repo.pushed", {"context": {"repo": "r3"}}, content_type="application/json")
    assert without_id.status_code == 201 and Job.objects.count() == 2

    assert client.post("/api/v1/events/repo.pushed", {**body, "tenant": "globex"},
                       content_type="application/json").status_code == 403
    assert client.post("/api/v1/events/repo.pushed", {"context": [1]},
                       content_type="application/json").status_code == 422
    assert client.post("/api/v1/events/" + "x" * 201, {}, content_type="application/json").status_code == 422
    _, viewer = user_with_token("victor", tenants={acme: "viewer"})
    assert client_for(viewer).post("/api/v1/events/repo.pushed", {}, content_type="application/json").status_code == 403


def test_argv_with_literal_braces_says_how_to_write_them():
    with pytest.raises(DefinitionError) as caught:
        save_service(key="jsonarg", executor="command", executor_config={"argv": ["tool", '{"mode": "fast"}']},
                     params_schema={"type": "object"})
    assert 'doubled ({{ for {, }} for })' in str(caught.value.problems[0])
    service = save_service(key="jsonarg", executor="command", executor_config={"argv": ["tool", '{{"mode": "fast"}}']},
                           params_schema={"type": "object"})
    assert service.pk
