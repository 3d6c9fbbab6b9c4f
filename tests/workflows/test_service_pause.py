"""Pausing a service: one governor condition with who, when and why, honoured by every agent's claim,
shown by the dashboard, the stuck panel and /metrics; and governor names that cannot match refused."""

from __future__ import annotations

import re

import pytest
from django.db import connections
from django.urls import reverse
from hypothesis import given, settings, strategies as st

from events.models import Event
from jobs import api
from jobs.models import Task
from nodes.agent import Agent
from workflows import governor
from workflows.models import Service
from workflows.validation import CONDITION_NAME_RE, DefinitionError, condition_names_problems

pytestmark = pytest.mark.django_db(transaction=True)


def run_agent_once(service: str) -> int:
    """Run an in-process agent serving ``service`` until it has nothing left to do; return its exit code."""
    agent = Agent(node="pause-node", services=[service], max_concurrent=2, once=True, lease_seconds=30)
    options = connections.settings["default"].setdefault("OPTIONS", {})
    saved = dict(options)
    try:
        return agent.run()
    finally:  # the agent gave this process's connections the daemons' timeouts: take them back
        options.clear()
        options.update(saved)
        connections.close_all()


def test_a_paused_service_is_not_claimed_until_resumed(make_service):
    make_service("resize")
    job = api.start_service("resize")
    governor.pause_service("resize", reason="storage migration", by="alice")
    assert governor.claim_adjustments(Service.objects.get(key="resize"), governor.active_conditions())[0]

    assert run_agent_once("resize") == 0
    assert list(Task.objects.filter(job=job).values_list("status", flat=True)) == ["queued"], "paused: not claimed"

    assert governor.resume_service("resize", by="bob") is True
    assert governor.resume_service("resize", by="bob") is False, "resuming twice changes nothing"
    assert run_agent_once("resize") == 0
    assert list(Task.objects.filter(job=job).values_list("status", flat=True)) == ["done"]
    messages = list(Event.objects.filter(type="governor").order_by("id").values_list("message", flat=True))
    assert messages == ["governor condition pause-resize raised by alice until cleared: storage migration",
                        "governor condition pause-resize cleared by bob"]


def test_a_pause_needs_a_reason_and_a_known_service(make_service):
    make_service("resize")
    with pytest.raises(DefinitionError, match="say why"):
        governor.pause_service("resize", reason="  ", by="alice")
    with pytest.raises(DefinitionError, match="unknown service 'nope'"):
        governor.pause_service("nope", reason="x", by="alice")
    assert governor.active_conditions() == set()


def test_pause_in_the_admin_shows_on_the_dashboard_the_stuck_panel_and_metrics(make_service, root, client):
    make_service("resize")
    api.start_service("resize")
    pk = Service.objects.get(key="resize").pk
    changelist = reverse("admin:workflows_service_changelist")
    asked = client.post(changelist, {"action": "pause_services", "_selected_action": [pk]})
    assert asked.status_code == 200 and b"reason" in asked.content, "the action asks why first"
    done = client.post(changelist, {"action": "pause_services", "_selected_action": [pk], "apply": "1",
                                    "reason": "storage migration"}, follow=True)
    assert "Pause: resize paused until resumed: storage migration" in done.content.decode()
    assert "paused</span> by root" in done.content.decode(), "the list shows who paused it"

    data = client.get(reverse("ops:dashboard_data")).json()
    assert [c["name"] for c in data["data"]["paused"]] == ["pause-resize"], data["data"]["paused"]
    stuck = [r for r in data["data"]["stuck"] if r["reason"] == "paused"]
    assert stuck and stuck[0]["message"] == "1 task queued for 'resize', which is paused", stuck
    assert "paused by root" in stuck[0]["detail"] and stuck[0]["detail"].endswith(": storage migration")
    page = client.get(reverse("ops:dashboard")).content.decode()
    assert 'data-paused="resize"' in page
    metrics = client.get("/metrics").content.decode()
    assert re.search(r'^accs_service_paused\{service="resize"\} 1\.0$', metrics, re.M), metrics[-2000:]

    client.post(changelist, {"action": "resume_services", "_selected_action": [pk]})
    assert governor.active_conditions() == set()
    metrics = client.get("/metrics").content.decode()
    assert re.search(r'^accs_service_paused\{service="resize"\} 0\.0$', metrics, re.M)


def test_block_during_typed_as_json_is_refused_at_its_field(root, client, make_service):
    make_service("resize")
    service = Service.objects.get(key="resize")
    url = reverse("admin:workflows_service_change", args=[service.pk])
    form = client.get(url).context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None}
    data.update({"executor_config": '{"callable": "tests.callables:noop"}', "params_schema": '{"type": "object"}',
                 "priority_adjust_during": "{}", "required_labels": "{}", "block_during": '["live_session"]'})
    answer = client.post(url, data)
    assert answer.status_code == 200, "refused, not saved"
    errors = answer.context["adminform"].form.errors
    assert "block_during" in errors, errors
    assert "'[\"live_session\"]' is not a governor condition name" in errors["block_during"][0]
    assert Service.objects.get(pk=service.pk).block_during == []
    with pytest.raises(DefinitionError, match="block_during"):
        make_service("other", block_during=["live session"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=110), max_size=4))
def test_condition_names_are_refused_exactly_when_no_condition_could_have_them(names):
    problems = condition_names_problems(names, field="block_during")
    assert bool(problems) == (not all(CONDITION_NAME_RE.match(n) for n in names))
    for problem in problems:
        assert problem.where == "block_during"
