"""Operators' pages, third round: versions jobs use stay fixed, cards match their lists, confirmed
actions, the admin's history of operator actions, job progress and attempts, the quiet timeline."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from jobs import api
from tests.ops_helpers import root, tenants  # noqa: F401  (fixtures)
from workflows.models import Workflow

pytestmark = pytest.mark.django_db


def workflow_post(wf: Workflow, **changes) -> dict[str, str]:
    """The workflow form as the page posts it, with ``changes`` applied."""
    data = {"name": wf.name, "version": wf.version, "description": wf.description,
            "max_active_jobs": wf.max_active_jobs, "steps": json.dumps(wf.steps)}
    if wf.is_active:
        data["is_active"] = "on"
    data.update(changes)
    return data


# --------------------------------------------------------------------------------------------
# A workflow version that jobs use keeps its steps; an edit is saved as the next version
# --------------------------------------------------------------------------------------------

def test_admin_refuses_to_change_steps_of_a_version_jobs_use_and_saves_it_as_the_next(
        client, root, make_service, default_tenant):
    make_service("a")
    make_service("b")
    steps = [{"key": "one", "service": "a", "depends_on": []}]
    wf = Workflow.objects.create(name="chain", version=1, steps=steps)
    api.start_workflow("chain", version=1)
    url = reverse("admin:workflows_workflow_change", args=[wf.pk])
    edited = steps + [{"key": "two", "service": "b", "depends_on": ["one"]}]

    refused = client.post(url, workflow_post(wf, steps=json.dumps(edited), _save="Save"))
    assert refused.status_code == 409, "the same answer as PATCH /api/v1/workflows/chain/1"
    errors = refused.context["adminform"].form.errors["steps"]
    assert any("'chain' version 1 has jobs" in e and "Save as a new version" in e for e in errors), errors
    wf.refresh_from_db()
    assert wf.steps == steps, "the refused edit changed nothing"
    body = refused.content.decode()
    assert 'id="accs-save-as-version"' in body and 'id="accs-version-frozen"' in body
    edit_diff = body[body.index('id="accs-diff-edit"'):]
    edit_diff = edit_diff[:edit_diff.index("</table>")]
    assert 'data-step="two" data-change="added"' in edit_diff

    # Fields a job does not depend on still change in place.
    described = client.post(url, workflow_post(wf, description="nightly", _save="Save"))
    assert described.status_code == 302
    wf.refresh_from_db()
    assert wf.description == "nightly" and wf.steps == steps

    saved = client.post(url, workflow_post(wf, steps=json.dumps(edited), _saveasnew="Save as a new version"))
    assert saved.status_code == 302, saved.content.decode()[:2000]
    v2 = Workflow.objects.get(name="chain", version=2)
    assert v2.steps == edited and Workflow.objects.get(name="chain", version=1).steps == steps
    page = client.get(saved["Location"])
    assert page.status_code == 200
    previous = page.content.decode()
    previous = previous[previous.index('id="accs-diff-previous"'):]
    previous = previous[:previous.index("</table>")]
    assert 'data-step="two" data-change="added"' in previous
    assert 'data-step="one"' not in previous, "an unchanged step is not listed"


def test_admin_edits_steps_of_a_version_no_job_uses(client, root, make_service):
    make_service("a")
    wf = Workflow.objects.create(name="draft", version=1, steps=[{"key": "one", "service": "a"}])
    edited = [{"key": "uno", "service": "a"}]
    response = client.post(reverse("admin:workflows_workflow_change", args=[wf.pk]),
                           workflow_post(wf, steps=json.dumps(edited), _save="Save"))
    assert response.status_code == 302
    wf.refresh_from_db()
    assert wf.steps == edited


def test_steps_diff_matches_steps_by_key_and_names_changed_fields():
    from workflows.diff import steps_diff

    before = [{"key": "a", "service": "x"}, {"key": "b", "service": "y", "depends_on": ["a"]}]
    after = [{"key": "b", "service": "z", "depends_on": ["a"]}, {"key": "a", "service": "x"}, {"key": "c"}]
    changes = {c.key: c for c in steps_diff(before, after)}
    assert set(changes) == {"b", "c"}
    assert changes["b"].change == "changed" and changes["b"].fields == [("service", '"y"', '"z"')]
    assert changes["c"].change == "added"
    assert [c.change for c in steps_diff(after, before)] == ["changed", "removed"]
    assert re.fullmatch(r"\[\]", json.dumps([c.key for c in steps_diff(before, before)]))


# --------------------------------------------------------------------------------------------
# Every dashboard figure equals the rows of the list it links to
# --------------------------------------------------------------------------------------------

def dashboard_scene(tenants) -> None:
    """Jobs and tasks in every state a dashboard figure counts, including dead letters in a job that
    carried on past its failed step (so the job ended partial, not in error)."""
    from tests.engine_helpers import claim_for, run_fail
    from tests.ops_helpers import _service, pipeline_scene
    from workflows.api import create_workflow

    pipeline_scene(tenants)
    lint = _service("lint", max_attempts=1)
    create_workflow(name="tolerant", steps=[{"key": "lint", "service": "lint", "on_failure": "continue"}])
    tolerant = api.start_workflow("tolerant", tenant=tenants.acme)
    run_fail(claim_for(lint), error="lint: 3 warnings treated as errors")
    tolerant.refresh_from_db()
    assert tolerant.status == "partial", tolerant.status
    flaky = _service("flaky-io", max_attempts=3, backoff_base_seconds=3600)
    api.start_service("flaky-io", tenant=tenants.globex)
    run_fail(claim_for(flaky), error="connection reset")  # scheduled for a retry in an hour
    _service("gated", requires_approval=True)
    api.start_service("gated", tenant=tenants.acme)


def figures_and_links(html_text: str, section: str) -> list[tuple[str, int, str]]:
    """Return (name, figure, link) for each linked figure inside the element with id ``section``."""
    import html

    part = html_text[html_text.index(f'id="{section}"'):]
    if section == "accs-cards":
        found = re.findall(r'data-card="(\w+)" href="([^"]+)">.*?<div class="value">(\d+)</div>', part[:part.index(
            'data-card="oldest"')], re.S)
        return [(name, int(n), html.unescape(href)) for name, href, n in found]
    part = part[:part.index("</table>")]
    return [(f"{section} #{i}", int(n), html.unescape(href))
            for i, (href, n) in enumerate(re.findall(r'<a href="([^"]+)">(\d+)</a>', part))]


def test_every_dashboard_figure_equals_the_rows_its_link_lists(client, root, tenants):
    dashboard_scene(tenants)
    body = client.get(reverse("ops:dashboard")).content.decode()
    cards = figures_and_links(body, "accs-cards")
    assert {name for name, _n, _l in cards} == {
        "jobs_in_flight", "jobs_queued", "awaiting_approval", "queued", "running", "retrying", "failed", "dead_letter"}
    per_tenant = figures_and_links(body, "accs-tenants")
    assert len(per_tenant) >= 10, per_tenant
    mismatches = []
    for name, figure, link in cards + per_tenant:
        listed = client.get(link)
        assert listed.status_code == 200, (name, link, listed.status_code)
        if listed.context["cl"].result_count != figure:
            mismatches.append((name, figure, listed.context["cl"].result_count, link))
    assert not mismatches, mismatches
    dead = dict((name, n) for name, n, _l in cards)["dead_letter"]
    assert dead == 3, "two failed jobs' tasks and the partial job's failed step"
