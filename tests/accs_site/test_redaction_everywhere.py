"""Secrets stay secret: no answer of the API, no admin page shows the value of a secret-named param.

The endpoints are not listed by hand: every GET of the OpenAPI document, every admin list and
change page of every registered model and every page of the operators' URLs is requested, as a
tenant viewer and as a tenant admin, over HTTP from a running server; a new endpoint is walked
the day it is added (a path parameter the walk cannot fill fails the test, naming it).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import requests
from django.contrib import admin
from django.urls import reverse
from hypothesis import given, settings, strategies as st

from accs_site.redaction import MASK, is_secret_name, keep_secrets, redact_params
from jobs import api, triggers
from jobs.models import Task, Trigger
from tenants.auth import create_token
from tenants.models import Tenant
from tests.ops_helpers import make_user, signed_in_session

SECRETS = {
    "top": "hunter2-top-5f1e0b", "nested": "nested-key-9ac3d1", "listed": "listed-tok-77b1aa",
    "number": 918273645, "template": "tpl-secret-3d0c55", "under": "under-cred-41d9e2",
    "output": "output-tok-e3a9f7",
}
# A step's output, which its dependents receive and the pages and API show: redacted as params are.
RESULTS = {"deploy_id": "visible-output-1", "session_token": SECRETS["output"]}
PARAMS: dict[str, Any] = {
    "password": SECRETS["top"],
    "target": {"host": "db-1", "api_key": SECRETS["nested"], "pin": {"client_secret": SECRETS["number"]}},
    "steps": [{"name": "one", "auth_token": SECRETS["listed"]}],
    "credentials": {"user": "svc", "value": SECRETS["under"]},  # everything under a secret name
    "plain": "visible-value",
}
TEMPLATE = {"password": SECRETS["template"], "target": "{{event.target}}"}


def assert_no_secret(body: str, where: str) -> None:
    for name, value in SECRETS.items():
        assert str(value) not in body, f"{where} shows the secret {name!r}"


@pytest.fixture
def world(make_service, default_tenant) -> dict[str, Any]:
    """A tenant with a job and a trigger carrying secrets; a staff viewer and a staff tenant admin."""
    make_service("deploy")
    acme = Tenant.objects.create(slug="acme", name="Acme")
    viewer = make_user("vera", tenants={acme: "viewer"})
    tenant_admin = make_user("alice", tenants={acme: "admin"})
    job = api.start_service("deploy", tenant=acme, params=PARAMS)
    trigger = triggers.create_trigger(tenant=acme, created_by=tenant_admin, label="on push", trigger_type="event",
                                      event_name="push", service="deploy", payload_template=TEMPLATE)
    Task.objects.filter(job=job).update(results=RESULTS)
    return {"acme": acme, "job": job, "trigger": trigger, "task": Task.objects.filter(job=job).first(),
            "people": {"viewer": viewer, "tenant admin": tenant_admin}}


def _filled(path: str, world: dict[str, Any]) -> str:
    fillers = {"job_id": world["job"].id, "trigger_id": world["trigger"].id, "task_id": world["task"].id,
               "key": "deploy", "name": "none", "version": 1}
    missing = [name for name in re.findall(r"{(\w+)}", path) if name not in fillers]
    assert not missing, f"{path}: add a value for {missing} to the walk, so its answers are checked too"
    return re.sub(r"{(\w+)}", lambda m: str(fillers[m.group(1)]), path)


def _api_get_paths() -> list[str]:
    from accs_site.api_v1 import api as ninja_api

    return [path for path, operations in ninja_api.get_openapi_schema()["paths"].items() if "get" in operations]


@pytest.mark.django_db(transaction=True)
def test_no_api_answer_shows_a_secret_param_to_a_viewer_or_a_tenant_admin(world, live_server_url):
    paths = _api_get_paths()
    assert "/api/v1/jobs/{job_id}" in paths and "/api/v1/jobs/triggers" in paths
    for who, user in world["people"].items():
        _, raw = create_token(user, f"{who} token")
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {raw}"
        for path in paths:
            url = _filled(path, world)
            response = http.get(f"{live_server_url}{url}", timeout=30)
            assert response.status_code < 500, (url, response.text[:500])
            assert_no_secret(response.text, f"GET {url} as the {who}")
        # The walk saw the params (redacted, keeping their shape), not an empty answer.
        job = http.get(f"{live_server_url}/api/v1/jobs/{world['job'].id}", timeout=30).json()
        assert job["tasks"][0]["params"]["password"] == MASK
        assert job["tasks"][0]["params"]["target"] == {"host": "db-1", "api_key": MASK, "pin": {"client_secret": MASK}}
        assert job["tasks"][0]["params"]["plain"] == "visible-value"
        assert job["tasks"][0]["results"] == {"deploy_id": "visible-output-1", "session_token": MASK}
        assert job["step_params"]["deploy"]["credentials"] == {"user": MASK, "value": MASK}
        listed = http.get(f"{live_server_url}/api/v1/jobs/triggers", timeout=30).json()["items"]
        assert listed[0]["payload_template"] == {"password": MASK, "target": "{{event.target}}"}


@pytest.mark.django_db(transaction=True)
def test_answers_to_writes_show_no_secret_and_a_trigger_saved_as_read_keeps_its_secret(world, live_server_url):
    _, raw = create_token(world["people"]["tenant admin"], "writer")
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {raw}"
    created = http.post(f"{live_server_url}/api/v1/jobs", json={"service": "deploy", "params": PARAMS}, timeout=30)
    assert created.status_code == 201, created.text
    assert_no_secret(created.text, "the answer to POST /api/v1/jobs")
    canceled = http.post(f"{live_server_url}/api/v1/jobs/{created.json()['id']}/cancel", timeout=30)
    assert canceled.status_code == 200 and "***" in canceled.text
    assert_no_secret(canceled.text, "the answer to a cancel")
    # What a GET shows, PATCHed back, leaves the stored secret as it was.
    url = f"{live_server_url}/api/v1/jobs/triggers/{world['trigger'].id}"
    shown = http.get(url, timeout=30).json()["payload_template"]
    patched = http.patch(url, json={"payload_template": {**shown, "extra": "1"}}, timeout=30)
    assert patched.status_code == 200, patched.text
    assert_no_secret(patched.text, "the answer to a trigger PATCH")
    assert Trigger.objects.get(pk=world["trigger"].id).payload_template == {**TEMPLATE, "extra": "1"}


def _admin_urls(world: dict[str, Any]) -> list[str]:
    """Every admin list and change page (first objects of each registered model) and every
    operators' page whose parameters the world can fill (artifact and attempt pages have none)."""
    from ops import urls as ops_urls

    urls = [reverse("admin:index")]
    for pattern in ops_urls.urlpatterns:
        wanted = set(pattern.pattern.converters)
        if wanted <= {"job_id"}:
            urls.append("/admin/" + str(pattern.pattern).replace("<uuid:job_id>", str(world["job"].id)))
    for model in admin.site._registry:
        info = (model._meta.app_label, model._meta.model_name)
        urls.append(reverse("admin:%s_%s_changelist" % info))
        for pk in model._default_manager.order_by().values_list("pk", flat=True)[:3]:
            urls.append(reverse("admin:%s_%s_change" % info, args=[pk]))
    return urls


@pytest.mark.django_db(transaction=True)
def test_no_admin_page_shows_a_secret_param_to_a_viewer_or_a_tenant_admin(world, live_server_url):
    urls = _admin_urls(world)
    job_page = reverse("admin:jobs_job_change", args=[world["job"].id])
    task_page = reverse("admin:jobs_task_change", args=[world["task"].id])
    trigger_page = reverse("admin:jobs_trigger_change", args=[world["trigger"].id])
    assert {job_page, task_page, trigger_page} <= set(urls)
    for who, user in world["people"].items():
        http = signed_in_session(live_server_url, user.username)
        for url in urls:
            response = http.get(f"{live_server_url}{url}", timeout=60)
            assert response.status_code < 500, (url, response.text[-800:])
            assert_no_secret(response.text, f"{url} as the {who}")
        for url in (job_page, task_page, trigger_page):
            shown = http.get(f"{live_server_url}{url}", timeout=60)
            assert shown.status_code == 200 and "***" in shown.text, f"{url} should show the params, redacted"
        for url in (job_page, task_page):
            shown = http.get(f"{live_server_url}{url}", timeout=60).text
            assert "visible-output-1" in shown, f"{url} should show the step's output"


@pytest.mark.django_db(transaction=True)
def test_a_trigger_saved_in_the_admin_as_shown_keeps_its_secret(world, live_server_url):
    http = signed_in_session(live_server_url, "alice")
    url = f"{live_server_url}{reverse('admin:jobs_trigger_change', args=[world['trigger'].id])}"
    page = http.get(url, timeout=30).text
    shown = json.loads(re.search(r'name="payload_template"[^>]*>(.*?)</textarea>', page, re.S).group(1)
                       .replace("&quot;", '"'))
    assert shown == {"password": MASK, "target": "{{event.target}}"}
    form = {"tenant": str(world["acme"].id), "label": "on push, renamed", "is_enabled": "on", "trigger_type": "event",
            "event_name": "push", "missed_run_policy": "run_once", "service": str(world["trigger"].service_id),
            "payload_template": json.dumps(shown), "priority": "0", "dedupe_window_seconds": "300",
            "csrfmiddlewaretoken": http.cookies["csrftoken"], "_save": "Save"}
    saved = http.post(url, data=form, headers={"Referer": url}, timeout=30)
    assert saved.status_code == 200 and "errornote" not in saved.text, saved.text[-1500:]
    stored = Trigger.objects.get(pk=world["trigger"].id)
    assert (stored.label, stored.payload_template) == ("on push, renamed", TEMPLATE)


# --------------------------------------------------------------------------------------------
# The redaction itself, on generated params
# --------------------------------------------------------------------------------------------

SECRET_WORDS = st.sampled_from(["password", "DB_PASSWORD", "token", "apiKey", "api-key", "client_secret",
                                "Credentials", "privateKey", "passphrase"])
PLAIN_WORDS = st.sampled_from(["host", "path", "count", "name", "region", "tags", "level"])
LEAVES = st.one_of(st.text(min_size=3, max_size=12), st.integers(), st.floats(allow_nan=False), st.booleans(),
                   st.none())
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(SECRET_WORDS, PLAIN_WORDS), inner, max_size=3)),
    max_leaves=20)


def _leaves(value: Any, *, secret: bool = False, path: tuple = ()) -> list[tuple[tuple, Any, bool]]:
    if isinstance(value, dict):
        return [leaf for key, item in value.items()
                for leaf in _leaves(item, secret=secret or is_secret_name(key), path=(*path, key))]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, secret=secret, path=(*path, i))]
    return [(path, value, secret)]


@settings(max_examples=300, deadline=None)
@given(params=st.dictionaries(st.one_of(SECRET_WORDS, PLAIN_WORDS), VALUES, max_size=5))
def test_every_value_under_a_secret_name_at_any_depth_is_masked_and_nothing_else(params):
    shown = redact_params(params)
    for (path, value, secret), (shown_path, shown_value, _) in zip(_leaves(params), _leaves(shown), strict=True):
        assert path == shown_path, "the shape is kept"
        if secret and value is not None:
            assert shown_value == MASK, path
        else:
            assert shown_value == value, path
    # Saving what was shown puts every secret back.
    assert keep_secrets(shown, params) == params


@pytest.mark.django_db
def test_the_timeline_keeps_an_events_context_with_its_secrets_masked(world):
    from events.models import Event

    api.emit_event("push", {"target": "db-2", "token": SECRETS["under"]}, tenant=world["acme"])
    stored = Event.objects.filter(type="app_event").values_list("data", flat=True).get()
    assert stored["context"] == {"target": "db-2", "token": MASK}


# --------------------------------------------------------------------------------------------
# Workflow definitions: a step's secret default params
# --------------------------------------------------------------------------------------------

STEP_SECRET = "step-pw-8e21c4"


@pytest.mark.django_db
def test_a_workflows_secret_default_params_are_masked_and_survive_a_save_of_what_was_shown(make_service):
    """Even a superuser reads ``***``: the API's answers and the admin's page and diffs. PATCH, POST
    of a new version and the admin's save, sent back what they showed, keep the stored secret."""
    from django.test import Client

    from tests.api_helpers import client_for, user_with_token
    from workflows.models import Workflow

    make_service("deploy")
    root_user, token = user_with_token("root", superuser=True)
    http = client_for(token)
    steps = [{"key": "a", "service": "deploy", "default_params": {"db_password": STEP_SECRET, "host": "h"}},
             {"key": "b", "service": "deploy", "depends_on": ["a"], "default_params": {"host": "other"}}]
    created = http.post("/api/v1/workflows", {"name": "ship", "steps": steps}, content_type="application/json")
    assert created.status_code == 201 and STEP_SECRET not in created.content.decode()
    for url in ("/api/v1/workflows", "/api/v1/workflows/ship/1"):
        body = http.get(url).content.decode()
        assert STEP_SECRET not in body and '"db_password": "***"' in body, (url, body[:400])
    shown = http.get("/api/v1/workflows/ship/1").json()["steps"]
    # Reordered and edited, sent back: the secret follows its step key, not its position.
    edited = {**shown[0], "default_params": {**shown[0]["default_params"], "host": "h2"}}
    patched = http.patch("/api/v1/workflows/ship/1", {"steps": [shown[1], edited]}, content_type="application/json")
    assert patched.status_code == 200, patched.content
    stored = {s["key"]: s for s in Workflow.objects.get(name="ship", version=1).steps}
    assert stored["a"]["default_params"] == {"db_password": STEP_SECRET, "host": "h2"}
    assert "db_password" not in stored["b"]["default_params"]
    assert http.post("/api/v1/workflows", {"name": "ship", "steps": shown},
                     content_type="application/json").status_code == 201
    assert Workflow.objects.get(name="ship", version=2).steps[0]["default_params"]["db_password"] == STEP_SECRET

    browser = Client()
    browser.force_login(root_user)
    page = browser.get(reverse("admin:workflows_workflow_change", args=[Workflow.objects.get(version=2).pk]))
    assert page.status_code == 200 and STEP_SECRET not in page.content.decode()
    form = page.context["adminform"].form
    data = {name: form[name].value() for name in ("name", "version", "description", "max_active_jobs")}
    data.update(steps=form["steps"].value(), is_active="on", _save="Save")
    saved = browser.post(reverse("admin:workflows_workflow_change", args=[Workflow.objects.get(version=2).pk]), data)
    assert saved.status_code == 302, saved.context["adminform"].form.errors
    assert Workflow.objects.get(name="ship", version=2).steps[0]["default_params"]["db_password"] == STEP_SECRET
