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
