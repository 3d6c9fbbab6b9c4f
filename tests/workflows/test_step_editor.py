"""The workflow admin's step editor: indented JSON whose mistakes are named where they are, the line,
column and step of text that is not JSON, or the step and field that validation refuses, once each."""

from __future__ import annotations

import pytest
from django.urls import reverse

from workflows.models import Workflow

pytestmark = pytest.mark.django_db


def add_workflow(client, steps: str):
    response = client.post(reverse("admin:workflows_workflow_add"), {
        "name": "edited", "version": 1, "description": "", "is_active": "on", "max_active_jobs": 0, "steps": steps})
    assert response.status_code == 200, "refused, the form shown again"
    return response.context["adminform"].form.errors.get("steps", []), response.content.decode()


def test_text_that_is_not_json_is_named_by_line_column_and_step_once(client, root, make_service):
    make_service("a")
    typed = '[\n  {"key": "first", "service": "a"},\n  {"key": "second" "service": "a"}\n]'
    errors, page = add_workflow(client, typed)
    assert errors == ["not valid JSON at line 3, column 20 (in or just after step 'second'): "
                      "Expecting ',' delimiter"], errors
    assert "&quot;second&quot; &quot;service&quot;" in page, "what was typed stays, to correct it"
    assert not Workflow.objects.exists()


def test_a_bad_step_is_named_with_its_field(client, root, make_service):
    make_service("a")
    errors, _ = add_workflow(client, '[{"key": "one", "service": "a"}, {"key": "two", "service": "a", '
                                     '"depends_on": ["one"], "retries": 3}]')
    assert errors == ["step 'two': unknown fields ['retries']"], errors
