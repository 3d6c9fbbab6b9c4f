"""The HTTP API: token auth, jobs, triggers, services and workflows, tenant isolation,
a live-server race of identical webhooks, the OpenAPI document and a property-based run against it."""

from __future__ import annotations

import io
import threading
from datetime import timedelta

import pytest
import requests
from django.core.management import call_command
from django.utils import timezone

from jobs import api
from jobs.models import Job, Task, Trigger
from tenants.auth import digest
from tenants.models import ApiToken, Tenant
from tests.api_helpers import client_for, user_with_token
from tests.engine_helpers import claim_for, run_fail
from workflows.models import Service, Workflow

pytestmark = pytest.mark.django_db

JSON = "application/json"


@pytest.fixture
def world(make_service, default_tenant):
    """Two tenants with a job each, a superuser, tenant admins of each, a viewer of acme."""
    make_service("sync", params_schema={"type": "object", "properties": {"path": {"type": "string"}},
                                        "additionalProperties": False})
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    _, root = user_with_token("root", superuser=True)
    _, alice = user_with_token("alice", tenants={acme: "admin"})
    _, bob = user_with_token("bob", tenants={globex: "admin"})
    _, vera = user_with_token("vera", tenants={acme: "viewer"})
    return {
        "acme": acme, "globex": globex,
        "root": client_for(root), "alice": client_for(alice), "bob": client_for(bob), "vera": client_for(vera),
        "acme_job": api.start_service("sync", tenant=acme), "globex_job": api.start_service("sync", tenant=globex),
        "tokens": {"root": root, "alice": alice},
    }


def post(client, url: str, data=None):
    return client.post(url, data, content_type=JSON) if data is not None else client.post(url, content_type=JSON)


# --------------------------------------------------------------------------------------------
# Authentication
# --------------------------------------------------------------------------------------------

def test_requests_without_a_valid_token_are_401_json(world, client):
    assert client.get("/api/v1/jobs").status_code == 401
    assert client_for("accs_wrong").get("/api/v1/jobs").status_code == 401
    response = client.get("/api/v1/jobs", headers={"Authorization": "Basic abc"})
    assert response.status_code == 401 and response.json() == {"detail": "Unauthorized"}
    assert client.get("/api/v1/health").json() == {"status": "ok"}


def test_each_token_is_throttled_to_its_rate_with_429_and_retry_after(world, monkeypatch):
    from accs_site.conf import reload

    monkeypatch.setenv("ACC_API_RATE_LIMIT", "5")
    monkeypatch.setenv("ACC_API_RATE_WINDOW_SEC", "3600")
    reload()
    try:
        answers = [world["alice"].get("/api/v1/jobs").status_code for _ in range(7)]
        assert answers == [200] * 5 + [429] * 2
        refused = world["alice"].get("/api/v1/jobs")
        assert "too many requests with this token: at most 5 per 3600 s" in refused.json()["detail"]
        assert 1 <= int(refused["Retry-After"]) <= 3600
        # Another token has a count of its own; the liveness probe needs none.
        assert world["bob"].get("/api/v1/jobs").status_code == 200
        assert world["alice"].get("/api/v1/health").status_code == 200
    finally:
        monkeypatch.delenv("ACC_API_RATE_LIMIT")
        monkeypatch.delenv("ACC_API_RATE_WINDOW_SEC")
        reload()


def test_only_the_digest_is_stored_and_revoked_tokens_stop_working(world):
    raw = world["tokens"]["alice"]
    token = ApiToken.objects.get(user__username="alice")
    assert token.digest == digest(raw) and raw not in (token.digest, token.prefix) and raw.startswith(token.prefix)
    assert world["alice"].get("/api/v1/jobs").status_code == 200
    assert ApiToken.objects.get(pk=token.pk).last_used_at is not None
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    assert world["alice"].get("/api/v1/jobs").status_code == 401


def test_create_api_token_command_prints_a_working_token_once(world):
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_token", "bob", "ci-webhook", stdout=out, stderr=err)
    raw = out.getvalue().strip()
    assert "not shown again" in err.getvalue() and raw not in err.getvalue()
    assert ApiToken.objects.filter(name="ci-webhook", digest=digest(raw)).exists()
    assert client_for(raw).get("/api/v1/jobs").status_code == 200
    with pytest.raises(Exception, match="no user"):
        call_command("create_api_token", "nobody", "x", stdout=io.StringIO(), stderr=io.StringIO())


# --------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------

def test_webhook_enqueue_is_201_then_200_for_the_same_external_id(world):
    body = {"service": "sync", "params": {"path": "/a"}, "external_id": "hook-7", "priority": 5}
    first = post(world["alice"], "/api/v1/jobs", body)
    assert first.status_code == 201, first.content
    again = post(world["alice"], "/api/v1/jobs", body)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    changed = post(world["alice"], "/api/v1/jobs", {**body, "priority": 9})
    assert changed.status_code == 409 and changed.json()["job_id"] == first.json()["id"]
    job = first.json()
    assert (job["tenant"], job["source"], job["priority"], job["service"]) == ("acme", "webhook", 5, "sync")


def test_a_narrow_start_is_answered_as_created_then_read_and_acted_on_as_a_queued_job(world, monkeypatch):
    """With narrow starts on (jobs.narrow) the created job has no row until widened: the answer is built
    from the start, and the detail, attempts and cancel of it find it as the queued job it is."""
    from accs_site.conf import reload
    from jobs.models import Start

    monkeypatch.setenv("ACC_NARROW_STARTS", "1")
    reload()
    try:
        created = post(world["alice"], "/api/v1/jobs", {"service": "sync", "params": {"path": "/n"}, "priority": 3})
    finally:
        monkeypatch.delenv("ACC_NARROW_STARTS")
        reload()
    assert created.status_code == 201, created.content
    job = created.json()
    assert Start.objects.filter(pk=job["id"]).exists()
    assert (job["status"], job["tenant"], job["service"], job["priority"], job["source"]) == (
        "waiting", "acme", "sync", 3, "webhook")
    detail = world["alice"].get(f"/api/v1/jobs/{job['id']}").json()
    assert {k: detail[k] for k in ("id", "status", "order_seq", "created_at")} == {
        k: job[k] for k in ("id", "status", "order_seq", "created_at")}
    assert [(t["task_key"], t["status"]) for t in detail["tasks"]] == [("sync", "queued")]
    assert post(world["alice"], f"/api/v1/jobs/{job['id']}/cancel").json()["job"]["status"] == "canceled"


def test_dedupe_conflict_is_409_naming_the_holder(world):
    first = post(world["alice"], "/api/v1/jobs", {"service": "sync", "dedupe_key": "daily"}).json()
    response = post(world["alice"], "/api/v1/jobs", {"service": "sync", "dedupe_key": "daily"})
    assert response.status_code == 409 and response.json()["job_id"] == first["id"]


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"service": "sync", "params": {"path": 3}}, 422, "path: 3 is not of type 'string'"),
    ({"service": "sync", "workflow": "x"}, 422, "exactly one of workflow or service"),
    ({"service": "nope"}, 422, "no service 'nope'"),
    ({"service": "sync", "priority": 2**31}, 422, "priority"),
    ({"service": "sync", "scheduled_at": "2026-01-01T00:00:00"}, 422, "scheduled_at"),
    ({"service": "sync", "surprise": 1}, 422, "surprise"),
    ({"service": "sync", "params": {"path": "a\u0000b"}}, 422, "NUL"),
    ({"service": "sync", "tenant": "globex"}, 403, "may not act in tenant 'globex'"),
])
def test_bad_enqueue_requests_get_clear_json_errors(world, body, status, needle):
    response = post(world["alice"], "/api/v1/jobs", body)
    assert response.status_code == status, response.content
    assert needle in response.json()["detail"]


def test_malformed_json_is_400(world):
    response = world["alice"].post("/api/v1/jobs", "{not json", content_type=JSON)
    assert response.status_code == 400 and "detail" in response.json()


def test_list_filters_and_paginates_without_counting(world):
    alice = world["alice"]
    for i in range(4):
        post(alice, "/api/v1/jobs", {"service": "sync", "external_id": f"e{i}"})
    page = alice.get("/api/v1/jobs", {"limit": 3}).json()
    assert (len(page["items"]), page["has_more"]) == (3, True)
    rest = alice.get("/api/v1/jobs", {"limit": 3, "offset": 3}).json()
    assert (len(rest["items"]), rest["has_more"]) == (2, False)
    assert {j["id"] for j in page["items"]}.isdisjoint({j["id"] for j in rest["items"]})
    assert len(alice.get("/api/v1/jobs", {"source": "webhook"}).json()["items"]) == 4
    assert len(alice.get("/api/v1/jobs", {"status": "waiting", "service": "sync"}).json()["items"]) == 5
    future = (timezone.now() + timedelta(hours=1)).isoformat()
    assert alice.get("/api/v1/jobs", {"created_after": future}).json()["items"] == []
    assert len(alice.get("/api/v1/jobs", {"created_before": future}).json()["items"]) == 5
    assert alice.get("/api/v1/jobs", {"status": "bogus"}).status_code == 422


def test_detail_attempts_cancel_retry_and_summary(world):
    alice, job = world["alice"], world["acme_job"]
    detail = alice.get(f"/api/v1/jobs/{job.id}").json()
    assert [t["task_key"] for t in detail["tasks"]] == ["sync"] and detail["tasks"][0]["status"] == "queued"
    svc = Service.objects.get(key="sync")
    svc.max_attempts = 1
    svc.save()
    Task.objects.filter(job=job).update(max_attempts=1)
    run_fail(claim_for(svc))
    attempts = alice.get(f"/api/v1/jobs/{job.id}/attempts").json()
    assert [(a["attempt_no"], a["status"], a["error_text"]) for a in attempts] == [(1, "failed", "boom")]
    retried = post(alice, f"/api/v1/jobs/{job.id}/retry")
    assert retried.status_code == 200 and retried.json()["job"]["status"] == "waiting"
    assert post(alice, f"/api/v1/jobs/{job.id}/retry").status_code == 409
    canceled = post(alice, f"/api/v1/jobs/{job.id}/cancel")
    assert canceled.json()["job"]["status"] == "canceled"
    assert post(alice, f"/api/v1/jobs/{job.id}/cancel").status_code == 409
    summary = alice.get("/api/v1/jobs/summary").json()
    assert summary["counts"]["canceled"] == 1 and summary["counts"]["queued"] == 0
    assert summary["running"] == 0 and summary["oldest_queued_age_seconds"] is None


def test_summary_reports_oldest_due_queued_job_and_pending_approvals(world, make_service):
    make_service("risky", requires_approval=True)
    api.start_service("risky", tenant=world["acme"])
    later = api.start_service("sync", tenant=world["acme"], scheduled_at=timezone.now() + timedelta(hours=1))
    Job.objects.filter(pk=world["acme_job"].pk).update(status="queued", started_at=None)  # as if not yet built
    summary = world["alice"].get("/api/v1/jobs/summary").json()
    assert summary["pending_approval"] == 1 and summary["counts"]["queued"] == 3
    assert summary["oldest_queued_age_seconds"] >= 0
    assert later.status == "queued"


# --------------------------------------------------------------------------------------------
# Tenant isolation
# --------------------------------------------------------------------------------------------

def test_tenant_admin_cannot_see_or_act_on_another_tenants_jobs(world, make_service):
    alice, other = world["alice"], world["globex_job"]
    make_service("risky", requires_approval=True)
    pending = api.start_service("risky", tenant=world["globex"])
    listed = {j["id"] for j in alice.get("/api/v1/jobs").json()["items"]}
    assert listed == {str(world["acme_job"].id)}
    assert alice.get("/api/v1/jobs", {"tenant": "globex"}).status_code == 403, "naming another tenant is refused"
    for url in (f"/api/v1/jobs/{other.id}", f"/api/v1/jobs/{other.id}/attempts"):
        assert alice.get(url).status_code == 404
    for action in ("cancel", "retry", "approve", "reject"):
        for job in (other, pending):
            response = post(alice, f"/api/v1/jobs/{job.id}/{action}")
            assert response.status_code == 404, (action, response.content)
    task = Task.objects.get(job=other)
    assert post(alice, f"/api/v1/jobs/{other.id}/tasks/{task.id}/cancel").status_code == 404
    summary = alice.get("/api/v1/jobs/summary").json()
    assert sum(summary["counts"].values()) == 1 and summary["pending_approval"] == 0
    assert alice.get("/api/v1/jobs/summary", {"tenant": "globex"}).status_code == 403
    other.refresh_from_db()
    pending.refresh_from_db()
    assert (other.status, pending.approval_state) == ("waiting", "pending"), "nothing changed"
    # The superuser sees both tenants.
    assert len(world["root"].get("/api/v1/jobs").json()["items"]) == 3
    assert world["root"].get("/api/v1/jobs/summary").json()["pending_approval"] == 1


def test_viewer_reads_but_cannot_act(world):
    vera, job = world["vera"], world["acme_job"]
    assert vera.get(f"/api/v1/jobs/{job.id}").status_code == 200
    assert post(vera, f"/api/v1/jobs/{job.id}/cancel").status_code == 403
    assert post(vera, "/api/v1/jobs", {"service": "sync"}).status_code == 403
    job.refresh_from_db()
    assert job.status == "waiting"


def test_tenant_admin_cannot_see_or_change_another_tenants_triggers(world):
    body = {"label": "on x", "trigger_type": "event", "event_name": "x", "service": "sync"}
    created = post(world["bob"], "/api/v1/jobs/triggers", body)
    assert created.status_code == 201, created.content
    tid = created.json()["id"]
    assert world["alice"].get("/api/v1/jobs/triggers").json()["items"] == []
    assert world["alice"].get(f"/api/v1/jobs/triggers/{tid}").status_code == 404
    assert world["alice"].patch(f"/api/v1/jobs/triggers/{tid}", {"label": "mine"}, content_type=JSON).status_code == 404
    assert world["alice"].delete(f"/api/v1/jobs/triggers/{tid}").status_code == 404
    assert post(world["alice"], "/api/v1/jobs/triggers", {**body, "tenant": "globex"}).status_code == 403
    assert Trigger.objects.get(pk=tid).label == "on x"


# --------------------------------------------------------------------------------------------
# Triggers
# --------------------------------------------------------------------------------------------

def test_trigger_crud_with_validation_naming_fields(world):
    alice = world["alice"]
    schedule = {"label": "Nightly", "trigger_type": "schedule", "cron_expr": "0 2 * * *", "timezone": "Europe/Budapest",
                "service": "sync", "payload_template": {"path": "/{{tenant.slug}}"}}
    created = post(alice, "/api/v1/jobs/triggers", schedule)
    assert created.status_code == 201, created.content
    trig = created.json()
    assert trig["tenant"] == "acme" and trig["next_run_at"] is not None
    bad = post(alice, "/api/v1/jobs/triggers", {**schedule, "cron_expr": "0 2 * *", "timezone": "Mars/Base"})
    assert bad.status_code == 422
    assert {p.split(":")[0] for p in bad.json()["problems"]} == {"timezone"}, "the zone is checked first"
    bad = post(alice, "/api/v1/jobs/triggers", {**schedule, "cron_expr": "0 2 * *"})
    assert bad.json()["problems"][0].startswith("cron_expr:")
    bad = post(alice, "/api/v1/jobs/triggers", {**schedule, "payload_template": {"path": "{{event.x}}"}})
    assert bad.status_code == 422 and bad.json()["problems"][0].startswith("payload_template.path:")
    changed = alice.patch(f"/api/v1/jobs/triggers/{trig['id']}", {"cron_expr": "30 3 * * *"}, content_type=JSON)
    assert changed.status_code == 200 and changed.json()["next_run_at"] != trig["next_run_at"]
    assert alice.patch(f"/api/v1/jobs/triggers/{trig['id']}", {"label": None}, content_type=JSON).status_code == 422
    listed = alice.get("/api/v1/jobs/triggers", {"trigger_type": "schedule"}).json()["items"]
    assert [t["label"] for t in listed] == ["Nightly"]
    assert alice.delete(f"/api/v1/jobs/triggers/{trig['id']}").status_code == 204
    assert not Trigger.objects.exists()


# --------------------------------------------------------------------------------------------
# Services and workflows (superusers only)
# --------------------------------------------------------------------------------------------

def test_services_and_workflows_are_superuser_only(world):
    for url in ("/api/v1/services", "/api/v1/workflows", "/api/v1/services/sync"):
        assert world["alice"].get(url).status_code == 403
    assert post(world["alice"], "/api/v1/services", {"key": "x", "executor": "python",
                                                     "executor_config": {"callable": "a.b:c"}}).status_code == 403


def test_service_and_workflow_management_validates_like_the_admin(world):
    root = world["root"]
    svc = {"key": "render", "executor": "command", "executor_config": {"argv": ["render", "{preset}"]},
           "params_schema": {"type": "object", "properties": {"preset": {"type": "string"}}}}
    assert post(root, "/api/v1/services", svc).status_code == 201
    assert post(root, "/api/v1/services", svc).status_code == 409
    bad = post(root, "/api/v1/services", {**svc, "key": "bad", "executor_config": {"argv": ["x", "{nope}"]}})
    assert bad.status_code == 422 and "executor_config.argv" in bad.json()["detail"]
    assert not Service.objects.filter(key="bad").exists()
    patched = root.patch("/api/v1/services/render", {"cpu_weight": 3, "requires_approval": True}, content_type=JSON)
    assert patched.status_code == 200 and patched.json()["cpu_weight"] == 3
    assert root.patch("/api/v1/services/render", {"cpu_weight": 9}, content_type=JSON).status_code == 422
    assert root.get("/api/v1/services/nope").status_code == 404

    cyclic = {"name": "pipe", "steps": [{"key": "a", "service": "render", "depends_on": ["b"]},
                                        {"key": "b", "service": "render", "depends_on": ["a"]}]}
    bad = post(root, "/api/v1/workflows", cyclic)
    assert bad.status_code == 422 and "dependency cycle" in bad.json()["detail"]
    good = post(root, "/api/v1/workflows", {"name": "pipe", "steps": [{"key": "a", "service": "render"}]})
    assert good.status_code == 201 and good.json()["version"] == 1
    assert post(root, "/api/v1/workflows", {"name": "pipe", "steps": [{"key": "a", "service": "render"}]}).json()[
        "version"] == 2
    off = root.patch("/api/v1/workflows/pipe/2", {"is_active": False}, content_type=JSON)
    assert off.status_code == 200 and not Workflow.objects.get(name="pipe", version=2).is_active
    api.start_workflow("pipe", version=1)
    locked = root.patch("/api/v1/workflows/pipe/1", {"steps": [{"key": "z", "service": "render"}]}, content_type=JSON)
    assert locked.status_code == 409 and "has jobs" in locked.json()["detail"]


def test_a_workflow_with_a_condition_and_an_output_schema_is_validated_like_the_admin(world):
    root = world["root"]
    Service.objects.get_or_create(key="gate-svc", defaults={"executor": "python",
                                                            "executor_config": {"callable": "tests.callables:noop"}})
    steps = [{"key": "check", "service": "gate-svc", "output_schema": {"type": "object", "required": ["ok"]}},
             {"key": "go", "service": "gate-svc", "depends_on": ["check"], "when": "$.check.ok == true"}]
    good = post(root, "/api/v1/workflows", {"name": "gated", "steps": steps})
    assert good.status_code == 201, good.content
    assert Workflow.objects.get(name="gated").steps == [{**steps[0], "depends_on": [], "default_params": {}},
                                                        {**steps[1], "default_params": {}}]
    ghost = [steps[0], {**steps[1], "when": "$.ghost.ok == true"}]
    bad = post(root, "/api/v1/workflows", {"name": "gated", "steps": ghost})
    assert bad.status_code == 422 and "step 'go': when reads ['ghost']" in bad.json()["detail"]
    assert Workflow.objects.filter(name="gated").count() == 1, "nothing written"


# --------------------------------------------------------------------------------------------
# Live server: 50 identical webhooks at once
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_identical_webhooks_create_exactly_one_job(make_service, default_tenant, live_server_url):
    make_service("deploy")
    _, token = user_with_token("hook", superuser=True)
    barrier = threading.Barrier(50)
    responses: list[tuple[int, str]] = []
    errors: list[BaseException] = []

    def fire() -> None:
        try:
            with requests.Session() as session:  # one connection per thread
                barrier.wait(timeout=30)
                r = session.post(f"{live_server_url}/api/v1/jobs", json={"service": "deploy", "external_id": "gh-1"},
                                 headers={"Authorization": f"Bearer {token}"}, timeout=60)
                responses.append((r.status_code, r.json().get("id", r.text)))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=fire) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors[:3]
    codes = sorted(code for code, _ in responses)
    assert len(responses) == 50 and codes.count(201) == 1 and codes.count(200) == 49, codes
    assert len({job_id for _, job_id in responses}) == 1
    assert Job.objects.filter(external_id="gh-1").count() == 1 and Job.objects.count() == 1


# --------------------------------------------------------------------------------------------
# The OpenAPI document and a property-based run against it
# --------------------------------------------------------------------------------------------

def test_openapi_document_is_valid_and_documents_every_error(client):
    from openapi_spec_validator import validate

    document = client.get("/api/v1/openapi.json").json()
    validate(document)
    assert document["components"]["securitySchemes"] == {
        "BearerToken": {"type": "http", "scheme": "bearer"},
        "StaffSession": {"type": "apiKey", "in": "cookie", "name": "sessionid"},  # the admin's session, beside tokens
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path.endswith(("/health", "/ready")):  # the probes take no token and no input
                continue
            assert {"401", "403", "404", "422"} <= set(operation["responses"]), (method, path)


CONFORMANCE_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                      "response_schema_conformance")


@pytest.mark.django_db(transaction=True)  # each request commits on its own, as in production
def test_property_based_run_finds_no_server_errors(make_service, default_tenant):
    """Schemathesis generates valid and invalid requests for every operation: never a 5xx, every
    status code documented, every body matching its declared schema."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode, checks as st_checks

    from accs_site.wsgi import application

    make_service("sync", params_schema={"type": "object", "properties": {"path": {"type": "string"}}})
    api.start_service("sync", external_id="seeded")
    _, token = user_with_token("fuzzer", superuser=True)
    auth = {"Authorization": f"Bearer {token}"}
    checks = [getattr(st_checks, name) for name in CONFORMANCE_CHECKS]
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in ((GenerationMode.POSITIVE, 20), (GenerationMode.NEGATIVE, 10)):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def exercise(case) -> None:
                case.validate_response(case.call(headers=auth), checks=checks, headers=auth)

            try:
                exercise()
            except Unsatisfiable:
                continue  # no invalid request exists for this operation (e.g. /health)
            except Exception as exc:  # noqa: BLE001 - collected so every operation is exercised
                failures.append(f"{operation.label} ({mode.value}): {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)


def test_ready_says_whether_the_database_can_serve_and_names_a_missing_migration(db, client, monkeypatch):
    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    from accs_site import daemon

    monkeypatch.setattr(daemon, "_schema_seen_current", False)
    ok = client.get("/api/v1/ready")
    assert ok.status_code == 200 and ok.json()["status"] == "ready", ok.content

    app, name = max(node for node in MigrationLoader(connection).graph.leaf_nodes() if node[0] == "jobs")
    with connection.cursor() as cur:  # undone with the test's transaction
        cur.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s", [app, name])
    monkeypatch.setattr(daemon, "_schema_seen_current", False)  # a process that never saw the schema current
    behind = client.get("/api/v1/ready")
    assert behind.status_code == 503 and behind["Retry-After"] == "5", behind.content
    body = behind.json()
    assert body["status"] == "not ready" and f"is missing migration {app}.{name}" in body["detail"], body
    assert client.get("/api/v1/health").status_code == 200, "liveness is not readiness"
