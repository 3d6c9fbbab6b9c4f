"""The HTTP API beside tokens: a staff user signed in to the admin uses it from the same browser (session
cookie, CSRF token on unsafe requests), scoped to their tenants exactly as their token would be; its
OpenAPI description reads as Markdown (no Sphinx markup in Swagger)."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from jobs import api
from tenants.auth import create_token
from tests.api_helpers import client_for
from tests.ops_helpers import make_user

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs"


def signed_in(user) -> Client:
    """A browser-like client: the admin's session, and Django's CSRF check as a browser meets it."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.get("/admin/").status_code == 200  # the admin's page sets the CSRF cookie
    return client


def listed(client: Client) -> set[str]:
    answer = client.get(JOBS)
    assert answer.status_code == 200, answer.content
    return {item["id"] for item in answer.json()["items"]}


def test_a_signed_in_staff_user_uses_the_api_in_their_tenants_with_the_csrf_token(tenants, make_service):
    make_service("encode")
    acme_job = api.start_service("encode", tenant=tenants.acme)
    api.start_service("encode", tenant=tenants.globex)
    ann = make_user("ann", tenants={tenants.acme: "admin"})
    browser = signed_in(ann)

    assert listed(browser) == {str(acme_job.pk)}
    assert listed(client_for(create_token(ann, "ann-cli")[1])) == listed(browser), "the same scope as a token"

    body = json.dumps({"service": "encode"})
    refused = browser.post(JOBS, body, content_type="application/json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"], refused.content
    csrf = {"X-CSRFToken": browser.cookies["csrftoken"].value}
    created = browser.post(JOBS, body, content_type="application/json", headers=csrf)
    assert created.status_code == 201 and created.json()["tenant"] == "acme", created.content
    other = browser.post(JOBS, json.dumps({"service": "encode", "tenant": "globex"}),
                         content_type="application/json", headers=csrf)
    assert other.status_code == 403, other.content

    viewer = signed_in(make_user("vic", tenants={tenants.acme: "viewer"}))
    assert listed(viewer) == listed(browser), "a viewer reads the same tenant"
    assert viewer.post(JOBS, body, content_type="application/json",
                       headers={"X-CSRFToken": viewer.cookies["csrftoken"].value}).status_code == 403


def test_only_staff_sessions_count_and_anonymous_calls_stay_401(tenants):
    outsider = Client()
    outsider.force_login(make_user("nick", staff=False, tenants={tenants.acme: "admin"}))
    assert outsider.get(JOBS).status_code == 401, "a session outside the admin (not staff) is no API login"
    assert Client().get(JOBS).status_code == 401


def test_the_api_description_is_markdown_without_sphinx_markup(client):
    schema = client.get("/api/v1/openapi.json").json()
    text = json.dumps(schema)
    leftovers = re.findall(r"``|:(?:mod|func|class|meth|data|param)[: ]", text)
    assert not leftovers, leftovers[:5]
    assert "`Authorization: Bearer <token>` (see `tenants.auth`)" in schema["info"]["description"]
    start = schema["paths"][JOBS]["post"]["description"]
    assert "`external_id`" in start, start
    assert set(schema["components"]["securitySchemes"]) == {"BearerToken", "StaffSession"}


def test_every_admin_page_links_swagger_which_a_signed_in_admin_can_use(tenants):
    browser = signed_in(make_user("ann", tenants={tenants.acme: "admin"}))
    page = browser.get("/admin/jobs/job/").content.decode()
    assert '<a href="/api/v1/docs" id="accs-api-link"' in page, "in the user tools, on every admin page"
    docs = browser.get("/api/v1/docs")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
    assert browser.get(JOBS).status_code == 200, "what Swagger's 'Try it out' sends, with the session"
