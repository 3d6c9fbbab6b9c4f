"""Operators' pages, third round: versions jobs use stay fixed, cards match their lists, confirmed
actions, the admin's history of operator actions, job progress and attempts, the quiet timeline."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from jobs import api
from jobs.ids import short_id
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
    per_node = figures_and_links(body, "accs-nodes")
    assert per_node and all("node=" in link for _n, _f, link in per_node), per_node
    mismatches = []
    for name, figure, link in cards + per_tenant + per_node:
        listed = client.get(link)
        assert listed.status_code == 200, (name, link, listed.status_code)
        if listed.context["cl"].result_count != figure:
            mismatches.append((name, figure, listed.context["cl"].result_count, link))
    assert not mismatches, mismatches
    dead = dict((name, n) for name, n, _l in cards)["dead_letter"]
    assert dead == 3, "two failed jobs' tasks and the partial job's failed step"


# --------------------------------------------------------------------------------------------
# Cancel and reject ask first; a canceled job's page refreshes until its tasks have stopped
# --------------------------------------------------------------------------------------------

def job_url(job) -> str:
    return reverse("admin:jobs_job_change", args=[job.pk])


def test_cancel_asks_for_confirmation_then_page_refreshes_until_the_task_stops(client, root, tenants, make_service):
    from django.contrib.messages import get_messages

    from jobs.models import Task
    from tests.engine_helpers import claim_for, run_fail

    svc = make_service("render-long")
    job = api.start_service("render-long", tenant=tenants.acme)
    held = claim_for(svc)
    act = reverse("admin:jobs_job_act", args=[job.pk, "cancel"])

    asked = client.post(act)
    assert asked.status_code == 200 and 'id="accs-confirm"' in asked.content.decode()
    assert "running tasks are told to stop" in asked.content.decode()
    job.refresh_from_db()
    assert job.status == "running" or job.status == "waiting", "nothing happens before the confirmation"

    done = client.post(act, {"confirm": "yes"}, follow=True)
    assert [str(m) for m in get_messages(done.wsgi_request)] == [
        f"Cancel: job {short_id(job.pk)} (service render-long): job canceled (1 running task(s) told to stop)"]
    job.refresh_from_db()
    assert job.status == "canceled"
    page = done.content.decode()
    assert 'id="accs-job-stopping"' in page and 'data-active="1"' in page, "still refreshing: a task runs"
    assert 'id="accs-job-retry"' not in page, "no retry while the task still runs"
    data = client.get(reverse("ops:job_data", args=[job.pk])).json()
    assert data["active"] is True and 'id="accs-job-retry"' not in data["html"]

    run_fail(held, status="canceled", error="stopped on request")  # the agent stops it at its heartbeat
    assert Task.objects.get(job=job).status == "canceled"
    data = client.get(reverse("ops:job_data", args=[job.pk])).json()
    assert data["active"] is False, "every task stopped: the page stops refreshing"
    assert 'id="accs-job-retry"' in data["html"] and 'id="accs-job-stopping"' not in data["html"]


def test_reject_asks_for_confirmation_and_takes_a_reason(client, root, tenants, make_service):
    make_service("gated", requires_approval=True)
    job = api.start_service("gated", tenant=tenants.acme)
    act = reverse("admin:jobs_job_act", args=[job.pk, "reject"])
    asked = client.post(act)
    assert asked.status_code == 200 and 'name="reason"' in asked.content.decode()
    job.refresh_from_db()
    assert job.approval_state == "pending"
    client.post(act, {"confirm": "yes", "reason": "not during the live show"})
    job.refresh_from_db()
    assert (job.approval_state, job.status) == ("rejected", "canceled")
    assert job.error_message == "not during the live show"


def test_bulk_cancel_asks_for_confirmation_with_the_selection(client, root, tenants, make_service):
    make_service("work")
    jobs = [api.start_service("work", tenant=tenants.acme) for _ in range(2)]
    data = {"action": "cancel_jobs", "_selected_action": [str(j.pk) for j in jobs]}
    asked = client.post(reverse("admin:jobs_job_changelist"), data)
    body = asked.content.decode()
    assert asked.status_code == 200 and 'id="accs-confirm"' in body
    assert all(f'value="{j.pk}"' in body for j in jobs)
    assert {j.status for j in type(jobs[0]).objects.filter(pk__in=[j.pk for j in jobs])} != {"canceled"}
    client.post(reverse("admin:jobs_job_changelist"), {**data, "confirm": "yes", "select_across": "0", "index": "0"})
    assert set(type(jobs[0]).objects.filter(pk__in=[j.pk for j in jobs]).values_list("status", flat=True)) == {
        "canceled"}


# --------------------------------------------------------------------------------------------
# Every operator action is in Django's admin log: History and "Recent actions" say who did what
# --------------------------------------------------------------------------------------------

def log_messages(obj) -> list[tuple[str, str]]:
    from django.contrib.admin.models import LogEntry
    from django.contrib.contenttypes.models import ContentType

    entries = LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(type(obj)), object_id=str(obj.pk))
    return [(e.user.username, e.get_change_message()) for e in entries.order_by("action_time")]


def test_operator_actions_write_the_admin_log_shown_in_history_and_recent_actions(client, root, tenants,
                                                                                   make_service):
    from nodes.models import Host, Node
    from tenants.models import ApiToken
    from tests.ops_helpers import failed_service_job, redrive_page

    make_service("work")
    job = api.start_service("work", tenant=tenants.acme)
    client.post(reverse("admin:jobs_job_act", args=[job.pk, "cancel"]), {"confirm": "yes"})
    client.post(reverse("admin:jobs_job_act", args=[job.pk, "retry"]))
    assert log_messages(job) == [("root", "Cancel: job canceled (0 running task(s) told to stop)"),
                                 ("root", "Retry: job back to waiting; 1 task(s) reset")]
    history = client.get(reverse("admin:jobs_job_history", args=[job.pk])).content.decode()
    assert "Cancel: job canceled" in history and "Retry: job back to waiting" in history

    refused = client.post(reverse("admin:jobs_job_act", args=[job.pk, "approve"]))
    assert refused.status_code == 403 or log_messages(job)[-1][1].startswith("Retry"), "nothing changed: no entry"

    node = Node.objects.create(name="n1")
    host = Host.objects.create(name="h1", node=node, status="error", quarantine_reason="disk",
                               quarantined_at=job.created_at)
    client.post(reverse("admin:nodes_node_changelist"), {"action": "drain", "_selected_action": ["n1"]})
    client.post(reverse("admin:nodes_host_changelist"), {"action": "clear_quarantine", "_selected_action": [host.pk]})
    assert [m for _u, m in log_messages(node)] == ["Drain: node n1 is draining: it claims nothing new"]
    assert [m for _u, m in log_messages(host)][0].startswith("Clear quarantine: ")

    failed_service_job(tenants.acme)
    redrive_page(client, reverse("admin:jobs_task_redrive"), {"service": "flaky"})

    added = client.post(reverse("admin:tenants_apitoken_add"), {"user": root.pk, "name": "ci", "scopes": ["read"]},
                        follow=True)
    assert any("copy it now" in str(m) for m in added.context["messages"])
    token = ApiToken.objects.get(name="ci")
    assert token.digest and token.prefix.startswith("accs_") and token.scopes == ["read"]
    client.post(reverse("admin:tenants_apitoken_changelist"), {"action": "revoke_selected",
                                                            "_selected_action": [token.pk]})
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert [m for _u, m in log_messages(token)] == ["Added.", "Revoke: revoked; the API refuses it from now on"]

    recent = client.get(reverse("admin:index")).content.decode()
    recent = recent[recent.index('id="recent-actions-module"'):]
    for text in ("job " + str(job.pk), "n1", "h1", "Redrive: 1 matched, 1 redriven", "ci ("):
        assert text in recent, text


# --------------------------------------------------------------------------------------------
# Numbers that agree: job progress from its tasks, attempts against the retry budget, named tasks
# --------------------------------------------------------------------------------------------

def test_job_progress_follows_its_tasks_and_a_failed_job_is_not_full(client, root, tenants, make_service):
    from jobs import transitions
    from tests.engine_helpers import claim_for
    from tests.ops_helpers import failed_service_job

    svc = make_service("encode")
    job = api.start_service("encode", tenant=tenants.acme)
    [claimed] = claim_for(svc)
    transitions.mark_running([(claimed.id, claimed.attempt, 42)], agent_id="agent-t", source="agent:test")
    transitions.report_progress([(claimed.id, claimed.attempt, 0.35)], source="agent:test")
    page = client.get(job_url(job)).content.decode()
    assert re.search(r'id="accs-job-progress"[^>]*>35 %<', page), "the job shows its running task's progress"
    assert client.get(reverse("ops:job_data", args=[job.pk])).json()["progress"] == pytest.approx(0.35)

    failed = failed_service_job(tenants.acme)
    assert failed.progress == 1.0, "the stored figure counts the failed task as finished"
    page = client.get(job_url(failed)).content.decode()
    assert re.search(r'id="accs-job-progress"[^>]*>0 %<', page), "a failed job is not shown as complete"
    listing = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    row = r'<a href="/admin/jobs/job/([0-9a-f-]+)/change/">.*?<td class="field-progress_pct">([^<]+)</td>'
    rows = {m.group(1): m.group(2) for m in re.finditer(row, listing, re.S)}
    assert rows == {str(job.pk): "35 %", str(failed.pk): "0 %"}, rows


def test_attempts_read_against_the_retry_budget():
    from ops.jobpage import attempt_text

    assert attempt_text(attempt=0, max_attempts=3, budget=3) == "not started (up to 3 attempts)"
    assert attempt_text(attempt=1, max_attempts=3, budget=3) == "attempt 1 (first of 3)"
    assert attempt_text(attempt=3, max_attempts=3, budget=3) == "attempt 3 (retry 2 of 2)"
    # An operator's retry after three attempts renews the budget: max 6, numbering goes on.
    assert attempt_text(attempt=4, max_attempts=6, budget=3) == "attempt 4 (first of 3)"
    assert attempt_text(attempt=5, max_attempts=6, budget=3) == "attempt 5 (retry 1 of 2)"
    assert attempt_text(attempt=1, max_attempts=1, budget=1) == "attempt 1 (no retries)"
    assert attempt_text(attempt=2, max_attempts=2, budget=5) == "attempt 2 of 2", "budget changed since"


def test_task_action_message_names_the_task_and_its_job(client, root, tenants):
    from django.contrib.messages import get_messages

    from jobs.models import Task
    from tests.ops_helpers import failed_service_job

    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    done = client.post(reverse("admin:jobs_task_act", args=[task.pk, "retry"]), follow=True)
    [message] = [str(m) for m in get_messages(done.wsgi_request)]
    assert message.startswith(f"Retry: task {task.task_key} (job {short_id(job.pk)}): "), message


# --------------------------------------------------------------------------------------------
# The timeline hides a job's running ↔ waiting moves unless asked for every change
# --------------------------------------------------------------------------------------------

def test_timeline_hides_job_running_waiting_moves_by_default(client, root, tenants, make_service):
    from events.models import Event
    from events.timeline import unfold
    from tests.engine_helpers import claim_for, run_ok
    from workflows.api import create_workflow

    svc = make_service("step")
    create_workflow(name="chain3", steps=[{"key": "a", "service": "step"},
                                          {"key": "b", "service": "step", "depends_on": ["a"]},
                                          {"key": "c", "service": "step", "depends_on": ["b"]}])
    job = api.start_workflow("chain3", tenant=tenants.acme)
    for _ in range(3):
        run_ok(claim_for(svc))
    # (A report folds them into its task's row: counted line by line, as the page shows them.)
    moves = sum(1 for e in Event.objects.filter(job_id=job.pk, type="status") for line in unfold(e)
                if line.task_id is None and line.data.get("from") in ("running", "waiting")
                and line.data.get("to") in ("running", "waiting"))
    assert moves >= 2, "a one-task step's report moves its job waiting → running → waiting around each task"

    def job_moves(body: str) -> list[str]:
        timeline = body[body.index('id="accs-timeline"'):]
        return re.findall(r"<td>(job (?:running|waiting) → (?:running|waiting)[^<]*)</td>", timeline)

    body = client.get(job_url(job)).content.decode()
    assert job_moves(body) == [], "hidden by default"
    assert f"{moves} job running ↔ waiting change" in body
    assert re.search(r"<td>job running → done[^<]*</td>", body), "the moves an operator acts on stay"
    everything = client.get(job_url(job) + "?moves=all").content.decode()
    assert len(job_moves(everything)) == moves


# --------------------------------------------------------------------------------------------
# The job and task pages say why queued work is not moving, as the dashboard does
# --------------------------------------------------------------------------------------------

def stuck_items(body: str) -> dict[str, str]:
    if 'id="accs-stuck"' not in body:
        return {}
    panel = body[body.index('id="accs-stuck"'):]
    panel = panel[:panel.index("</ul>")]
    return {m.group(1): re.sub(r"<[^>]+>", "", m.group(2)).strip()
            for m in re.finditer(r'<li data-reason="(\w+)"[^>]*>(.*?)</li>', panel, re.S)}


def test_job_and_task_pages_say_why_a_queued_task_is_not_moving(client, root, tenants, make_service):
    from jobs.models import Task
    from tests.engine_helpers import claim_for, run_fail

    make_service("transcode", block_during=["live_session"])
    job = api.start_service("transcode", tenant=tenants.acme)
    api.raise_condition("live_session", reason="studio A is live", by="alice")
    task = Task.objects.get(job=job)
    dashboard = stuck_items(client.get(reverse("ops:dashboard")).content.decode())
    for page in (job_url(job), reverse("admin:jobs_task_change", args=[task.pk])):
        items = stuck_items(client.get(page).content.decode())
        assert set(items) == {"no_agent", "governor"}, (page, items)
        assert items == dashboard, "the same reasons, in the same words, as the dashboard"
        assert "start one with manage.py runagent --services transcode" in items["no_agent"]
        assert "studio A is live" in items["governor"]

    flaky = make_service("flaky-net", max_attempts=3, backoff_base_seconds=600)
    retrying = api.start_service("flaky-net", tenant=tenants.acme)
    run_fail(claim_for(flaky), error="connection reset")
    retry_page = client.get(job_url(retrying)).content.decode()
    items = stuck_items(retry_page)
    assert "task flaky-net waits out its backoff after attempt 1 failed" in items["backoff"], items
    # 600 s of backoff plus up to 10 % jitter: the words say 10 or 11 minutes (9 once a minute passed).
    assert re.search(r'class="accs-next"[^>]*>in (9|10|11) min<', retry_page), "the next attempt in words"
    assert re.search(r'class="accs-next"[^>]*>due now<', client.get(job_url(job)).content.decode()), \
        "a queued task past its time is due now, not a time in the past"
    retry_task = Task.objects.get(job=retrying)
    page = client.get(reverse("admin:jobs_task_change", args=[retry_task.pk])).content.decode()
    assert "backoff" in stuck_items(page) and 'id="accs-task-retry"' not in page
    assert "attempt 1 (first of 3)" in page

    make_service("gated", requires_approval=True)
    gated = api.start_service("gated", tenant=tenants.acme)
    items = stuck_items(client.get(job_url(gated)).content.decode())
    assert list(items) == ["approval"] and "approve or reject it" in items["approval"]


# --------------------------------------------------------------------------------------------
# The node page: what its agents run now, drain / undrain, recent failures, its tasks
# --------------------------------------------------------------------------------------------

def test_node_page_shows_running_tasks_failures_and_drains(client, root, tenants, make_service):
    from jobs import transitions
    from nodes.models import Node
    from tests.engine_helpers import claim_for, run_fail

    Node.objects.create(name="node-t", services=["encode"])
    svc = make_service("encode", max_attempts=1)
    failed = api.start_service("encode", tenant=tenants.acme)
    run_fail(claim_for(svc), error="exit 3: disk full on /srv")
    job = api.start_service("encode", tenant=tenants.acme)
    [held] = claim_for(svc)
    transitions.mark_running([(held.id, held.attempt, 42)], agent_id="agent-t", source="agent:test")
    transitions.report_progress([(held.id, held.attempt, 0.5)], source="agent:test")

    url = reverse("admin:nodes_node_change", args=["node-t"])
    body = client.get(url).content.decode()
    running = body[body.index('id="accs-node-running"'):body.index('id="accs-node-failures"')]
    assert 'data-task-key="encode"' in running and "50 %" in running and short_id(job.pk) in running
    failures = body[body.index('id="accs-node-failures"'):]
    assert "exit 3: disk full on /srv" in failures[:failures.index("</table>")]
    assert str(failed.pk) != str(job.pk)
    held_link = re.search(r'href="([^"]+)" id="accs-node-held-link"', body).group(1).replace("&amp;", "&")
    assert client.get(held_link).context["cl"].result_count == 1

    assert 'id="accs-node-drain"' in body
    client.post(reverse("admin:nodes_node_act", args=["node-t", "drain"]))
    assert Node.objects.get(name="node-t").state == "draining"
    body = client.get(url).content.decode()
    assert 'id="accs-node-undrain"' in body and 'id="accs-node-drain"' not in body
    assert [m for _u, m in log_messages(Node.objects.get(name="node-t"))] == [
        "Drain: node node-t is draining: it claims nothing new"]
    client.post(reverse("admin:nodes_node_act", args=["node-t", "undrain"]))
    assert Node.objects.get(name="node-t").state == "active"


# --------------------------------------------------------------------------------------------
# Triggers: next runs, run now, the jobs a trigger started
# --------------------------------------------------------------------------------------------

def test_trigger_page_previews_next_runs_runs_now_and_links_its_jobs(client, root, tenants, make_service):
    from jobs.models import Job, Trigger

    backup = make_service("backup")
    trigger = Trigger.objects.create(tenant=tenants.acme, label="nightly backup", trigger_type="schedule",
                                     cron_expr="0 2 * * *", timezone="Europe/Oslo", service=backup)
    page = client.get(reverse("admin:jobs_trigger_change", args=[trigger.pk])).content.decode()
    assert page.count("02:00 CE") == 5, "five next runs at 02:00 Oslo time"
    assert 'id="accs-trigger-run_now"' in page

    ran = client.post(reverse("admin:jobs_trigger_act", args=[trigger.pk, "run_now"]), follow=True)
    [message] = [str(m) for m in ran.context["messages"]]
    assert message.startswith("Run now: trigger 'nightly backup': job ") and message.endswith(" started"), message
    job = Job.objects.get(source_ref=f"trigger:{trigger.pk}")
    assert job.service.key == "backup" and job.tenant_id == tenants.acme.pk
    assert [m for _u, m in log_messages(trigger)][0].startswith("Run now: job ")

    listing = client.get(reverse("admin:jobs_trigger_changelist")).content.decode()
    link = re.search(r'<a href="([^"]+)">jobs →</a>', listing).group(1).replace("&amp;", "&")
    jobs = client.get(link).context["cl"]
    assert [j.pk for j in jobs.result_list] == [job.pk]


def test_job_search_finds_a_job_by_one_of_its_task_ids(client, root, tenants):
    from jobs.models import Task
    from tests.ops_helpers import failed_service_job

    job = failed_service_job(tenants.acme)
    other = failed_service_job(tenants.acme, key="other")
    task = Task.objects.get(job=job)
    found = client.get(reverse("admin:jobs_job_changelist"), {"q": str(task.pk)}).context["cl"].result_list
    assert [j.pk for j in found] == [job.pk] and other.pk != job.pk
    listing = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert "exit 3: disk full on /srv" in listing, "the last error is on the job's row"


# --------------------------------------------------------------------------------------------
# A running attempt's log page tails its lines from the timeline and refreshes itself
# --------------------------------------------------------------------------------------------

def test_running_attempt_log_tails_the_timeline_and_refreshes(client, root, tenants, make_service):
    from events.timeline import EventRow, write_events
    from jobs import transitions
    from jobs.models import Attempt
    from tests.engine_helpers import claim_for, run_ok

    svc = make_service("encode")
    job = api.start_service("encode", tenant=tenants.acme)
    [held] = claim_for(svc)
    transitions.mark_running([(held.id, held.attempt, 42)], agent_id="agent-t", source="agent:test")
    attempt = Attempt.objects.get(task_id=held.id, attempt_no=held.attempt)
    assert attempt.status == "running"
    write_events([EventRow(type="log", message=text, job_id=job.pk, task_id=held.id, attempt=held.attempt,
                           source="agent:test", level=level)
                  for level, text in (("info", "frame 1/3"), ("warn", "ERROR: disk almost full"),
                                      ("info", "frame 2/3"))])
    url = reverse("ops:attempt_log", args=[job.pk, attempt.pk])
    page = client.get(url).content.decode()
    assert 'id="accs-log-live"' in page and "data-live-url=" in page and 'id="accs-log-problem"' not in page
    assert page.index("frame 1/3") < page.index("ERROR: disk almost full") < page.index("frame 2/3")
    warn = client.get(url, {"level": "warn"}).content.decode()
    assert "ERROR: disk almost full" in warn and "frame 1/3" not in warn
    data = client.get(url, {"format": "json"}).json()
    assert data["active"] is True and "frame 2/3" in data["html"]

    run_ok([held])  # ended without storing a log artifact (no storage configured)
    data = client.get(url, {"format": "json"}).json()
    assert data["active"] is False
    assert 'id="accs-log-problem"' in client.get(url).content.decode()


def test_workflow_steps_are_edited_as_indented_json(client, root, make_service):
    make_service("a")
    wf = Workflow.objects.create(name="pretty", version=1, steps=[{"key": "one", "service": "a"}])
    form = client.get(reverse("admin:workflows_workflow_change", args=[wf.pk])).context["adminform"].form
    assert form["steps"].value() == '[\n  {\n    "key": "one",\n    "service": "a"\n  }\n]'
    broken = client.post(reverse("admin:workflows_workflow_change", args=[wf.pk]),
                         workflow_post(wf, steps='[{"key": "one",'))
    assert "not valid JSON at line 1" in str(broken.context["adminform"].form.errors["steps"])
    assert '[{&quot;key&quot;: &quot;one&quot;,' in broken.content.decode(), "what was typed stays to correct"


# --------------------------------------------------------------------------------------------
# The dashboard's charts
# --------------------------------------------------------------------------------------------

def test_dashboard_charts_count_attempts_and_failures_per_bar(client, root, tenants):
    from ops.charts import chart_data
    from tests.ops_helpers import pipeline_scene

    pipeline_scene(tenants)
    charts = chart_data()
    assert charts.bars == 36 and not charts.partial
    by_service = {s.service: s for s in charts.services}
    # render: four hosts, one of them failed twice; all started within the last bar or two.
    assert by_service["render"].total == 5 and sum(by_service["render"].failed) == 2
    assert charts.overall.total == sum(s.total for s in charts.services)
    body = client.get(reverse("ops:dashboard")).content.decode()
    section = body[body.index('id="accs-charts"'):]
    section = section[:section.index("</table>")]
    assert section.count('<svg xmlns="http://www.w3.org/2000/svg" class="accs-chart"') == 3 * (1 + len(by_service))
    assert '<tr data-chart="render">' in section and "attempts failed per bar, render" in section


# --------------------------------------------------------------------------------------------
# Text and JSON artifacts are shown inline
# --------------------------------------------------------------------------------------------

def test_small_text_and_json_artifacts_are_previewed_inline(client, root, tenants, s3):
    from events.artifacts import record_artifact
    from jobs.models import Task
    from tests.ops_helpers import failed_service_job, make_user

    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    report = record_artifact(job_id=job.pk, task_id=task.pk, attempt=1, kind="output", name="report.json",
                             data=b'{"frames": 3, "ok": false}', content_type="application/json")
    binary = record_artifact(job_id=job.pk, task_id=task.pk, attempt=1, kind="output", name="frame.png",
                             data=b"\x89PNG" + bytes(64), content_type="image/png")
    page = client.get(job_url(job)).content.decode()
    preview = reverse("ops:job_artifact_preview", args=[job.pk, report.pk])
    assert f'href="{preview}"' in page
    assert reverse("ops:job_artifact_preview", args=[job.pk, binary.pk]) not in page, "no view link for a PNG"
    shown = client.get(preview).content.decode()
    assert '<pre id="accs-preview">{\n  &quot;frames&quot;: 3,\n  &quot;ok&quot;: false\n}</pre>' in shown
    refused = client.get(reverse("ops:job_artifact_preview", args=[job.pk, binary.pk])).content.decode()
    assert 'id="accs-preview-problem"' in refused and "download this one" in refused
    client.force_login(make_user("bob", tenants={tenants.globex: "admin"}))
    assert client.get(preview).status_code == 404
