"""The admin shows where a definition lives, keeps definitions from code read-only and lets those made in
the admin be edited as before."""

from __future__ import annotations

import pytest
from django.urls import reverse

from workflows.api import create_workflow
from workflows.models import Service, Workflow

pytestmark = pytest.mark.django_db

STEPS = [{"key": "a", "service": "svc", "depends_on": [], "default_params": {}}]


@pytest.fixture
def in_code(make_service):
    service = make_service("svc")
    Service.objects.filter(pk=service.pk).update(defined_in="shop.pipelines:12")
    workflow = create_workflow(name="flow", steps=STEPS)
    Workflow.objects.filter(pk=workflow.pk).update(defined_in="shop.pipelines:20")
    return Service.objects.get(pk=service.pk), Workflow.objects.get(pk=workflow.pk)


def service_form(service: Service, **changes) -> dict:
    data = {"key": service.key, "description": "edited", "is_active": "on", "executor": service.executor,
            "executor_config": '{"callable": "tests.callables:noop"}', "params_schema": "{}",
            "timeout_seconds": 60, "max_attempts": 1, "backoff_cap_seconds": 10, "cpu_weight": 1,
            "max_concurrent": 0, "base_priority": 0, "block_during": "", "priority_adjust_during": "{}",
            "required_labels": "{}", "rate_limit": 0, "rate_period_seconds": 60, "rate_key": "",
            "rate_key_limit": 0, "concurrency_key": "", "concurrency_key_limit": 0}
    return {**data, **changes}


def test_service_from_code_shows_its_place_and_cannot_be_changed_or_deleted(client, root, in_code):
    service, _ = in_code
    url = reverse("admin:workflows_service_change", args=[service.pk])
    page = client.get(url)
    assert page.status_code == 200
    assert "in code: shop.pipelines:12" in page.content.decode()
    assert page.context["has_change_permission"] is False, "a read-only page"
    assert client.post(url, service_form(service)).status_code == 403
    assert client.post(reverse("admin:workflows_service_delete", args=[service.pk]), {"post": "yes"}).status_code == 403
    service.refresh_from_db()
    assert service.description == ""
    listing = client.get(reverse("admin:workflows_service_changelist")).content.decode()
    assert "in code: shop.pipelines:12" in listing


def test_workflow_from_code_says_so_and_is_read_only(client, root, in_code):
    _, workflow = in_code
    url = reverse("admin:workflows_workflow_change", args=[workflow.pk])
    page = client.get(url).content.decode()
    assert 'id="accs-defined-in-code"' in page and "Defined in code: shop.pipelines:20" in page
    posted = client.post(url, {"name": "flow", "version": 1, "description": "x", "is_active": "on",
                               "max_active_jobs": 0, "steps": "[]"})
    assert posted.status_code == 403
    workflow.refresh_from_db()
    assert workflow.steps == STEPS


def test_service_made_in_the_admin_is_still_editable(client, root, make_service):
    service = make_service("hand-made")
    url = reverse("admin:workflows_service_change", args=[service.pk])
    page = client.get(url)
    assert page.context["has_change_permission"] is True and "in the admin" in page.content.decode()
    response = client.post(url, service_form(service))
    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else response
    service.refresh_from_db()
    assert service.description == "edited" and service.defined_in == ""


def test_the_http_api_refuses_to_change_a_definition_from_code_naming_its_file(in_code):
    """The API is the admin's twin: a PATCH or a new version would be undone by the next sync."""
    from tests.api_helpers import client_for, user_with_token

    service, workflow = in_code
    http = client_for(user_with_token("root", superuser=True)[1])
    answers = [
        http.patch("/api/v1/services/svc", {"description": "x"}, content_type="application/json"),
        http.patch("/api/v1/workflows/flow/1", {"is_active": False}, content_type="application/json"),
        http.post("/api/v1/workflows", {"name": "flow", "steps": [{"key": "z", "service": "svc"}]},
                  content_type="application/json"),
    ]
    for answer in answers:
        assert answer.status_code == 409 and "defined in code (shop.pipelines:" in answer.json()["detail"], answer
    assert (Service.objects.get(pk=service.pk).description, Workflow.objects.filter(name="flow").count(),
            Workflow.objects.get(pk=workflow.pk).is_active) == ("", 1, True)
    # A definition made in the admin is changed as before.
    Service.objects.filter(pk=service.pk).update(defined_in="")
    assert http.patch("/api/v1/services/svc", {"description": "x"}, content_type="application/json").status_code == 200
