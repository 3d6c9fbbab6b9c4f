"""The operators' third round in a real browser (headless Chromium against a live server), driven as an
operator would: a workflow version that jobs use refuses a steps edit and saves it as the next version;
every dashboard figure equals the rows its link lists; Cancel asks first, then cancels, and the job's
History and the admin's Recent actions say who did it; the timeline hides a job's running ↔ waiting
moves until asked.
"""

from __future__ import annotations

import json

import pytest

from events.models import Event
from events.timeline import unfold
from jobs import api
from jobs.models import Job
from ops.jobpage import is_flapping
from tests.browser import click, css, log_in, wait
from tests.engine_helpers import claim_for, run_fail, run_ok
from tests.ops_helpers import _service, make_user, pipeline_scene, two_tenants
from workflows.api import create_workflow
from workflows.models import Workflow

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def logged_in(browser, live_server) -> str:
    """Log a superuser in and return the server's base URL."""
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    return live_server.url


def listed_rows(browser) -> int:
    """Count the rows of the admin list on the current page (an empty list has no table)."""
    wait(browser, lambda d: css(d, "#changelist"), "an admin list")
    return len(css(browser, "#result_list tbody tr"))


def test_workflow_version_jobs_use_refuses_a_steps_edit_and_saves_it_as_the_next(browser, live_server):
    _service("a")
    _service("b")
    steps = [{"key": "one", "service": "a", "depends_on": []}]
    wf = Workflow.objects.create(name="chain", version=1, steps=steps)
    api.start_workflow("chain", version=1, tenant=two_tenants().acme)
    edited = steps + [{"key": "two", "service": "b", "depends_on": ["one"]}]
    base = logged_in(browser, live_server)

    browser.get(f"{base}/admin/workflows/workflow/{wf.pk}/change/")
    wait(browser, lambda d: css(d, "#id_steps"), "the workflow form")
    assert "Jobs use" in css(browser, "#accs-version-frozen")[0].text, "the page says why the steps are fixed"
    box = css(browser, "#id_steps")[0]
    box.clear()
    box.send_keys(json.dumps(edited))
    click(browser, "input[name=_save]")

    wait(browser, lambda d: css(d, ".errorlist"), "the refusal")
    reason = " ".join(e.text for e in css(browser, ".errorlist"))
    assert "'chain' version 1 has jobs" in reason and "Save as a new version" in reason, reason
    assert not css(browser, ".messagelist .success"), "no 'changed successfully'"
    added = css(browser, '#accs-diff-edit tr[data-step="two"]')
    assert added and added[0].get_attribute("data-change") == "added", "the edit's diff names the new step"
    assert Workflow.objects.get(pk=wf.pk).steps == steps, "the refused edit changed nothing"
    assert not Workflow.objects.filter(name="chain", version=2).exists()

    # The refused form keeps the edit: the operator saves it as the next version.
    assert json.loads(css(browser, "#id_steps")[0].get_property("value")) == edited
    click(browser, "#accs-save-as-version")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the new version's message")
    v2 = Workflow.objects.get(name="chain", version=2)
    assert f"/admin/workflows/workflow/{v2.pk}/change/" in browser.current_url
    assert v2.steps == edited and Workflow.objects.get(pk=wf.pk).steps == steps
    diff = {r.get_attribute("data-step"): r.get_attribute("data-change")
            for r in css(browser, "#accs-diff-previous tr[data-step]")}
    assert diff == {"two": "added"}, diff
    assert "chain" in css(browser, "#accs-version h2 a")[0].text, "the diff links the previous version"


def dashboard_scene() -> None:
    """Jobs and tasks in every state a card counts, with dead letters in a job that ended partial."""
    tenants = two_tenants()
    pipeline_scene(tenants)
    lint = _service("lint", max_attempts=1)
    create_workflow(name="tolerant", steps=[{"key": "lint", "service": "lint", "on_failure": "continue"}])
    api.start_workflow("tolerant", tenant=tenants.acme)
    run_fail(claim_for(lint), error="lint: 3 warnings treated as errors")
    flaky = _service("flaky-io", max_attempts=3, backoff_base_seconds=3600)
    api.start_service("flaky-io", tenant=tenants.globex)
    run_fail(claim_for(flaky), error="connection reset")  # queued again, due in an hour
    _service("gated", requires_approval=True)
    api.start_service("gated", tenant=tenants.acme)


def test_every_dashboard_figure_equals_the_rows_its_link_opens(browser, live_server):
    dashboard_scene()
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/dashboard/")
    wait(browser, lambda d: css(d, "#accs-cards a.accs-card"), "the dashboard's cards")
    figures = [(f"card {a.get_attribute('data-card')}", int(a.find_element("css selector", ".value").text),
                a.get_attribute("href")) for a in css(browser, "#accs-cards a.accs-card")]
    for section in ("accs-tenants", "accs-nodes"):
        for i, a in enumerate(css(browser, f"#{section} tbody td.num a")):
            figures.append((f"{section} #{i}", int(a.text), a.get_attribute("href")))
    names = {name for name, _n, _l in figures}
    assert {"card dead_letter", "card failed", "card retrying", "card awaiting_approval"} <= names, names
    assert sum(name.startswith("accs-tenants") for name in names) >= 10
    assert any(name.startswith("accs-nodes") for name in names), "a node's running tasks link to them"
    assert dict((n, f) for n, f, _l in figures)["card dead_letter"] == 3

    seen = []
    for name, figure, link in figures:
        browser.get(link)
        seen.append((name, figure, listed_rows(browser), link))
    mismatches = [s for s in seen if s[1] != s[2]]
    assert not mismatches, mismatches
    assert any(figure > 0 for _n, figure, _r, _l in seen)


def test_cancel_asks_first_then_history_and_recent_actions_name_the_operator(browser, live_server):
    _service("render-long")
    job = api.start_service("render-long", tenant=two_tenants().acme)
    base = logged_in(browser, live_server)
    page = f"{base}/admin/jobs/job/{job.pk}/change/"

    browser.get(page)
    wait(browser, lambda d: css(d, "#accs-job-cancel"), "the cancel button")
    click(browser, "#accs-job-cancel")
    wait(browser, lambda d: css(d, "#accs-confirm"), "the confirmation")
    assert "running tasks are told to stop" in css(browser, "#content-main")[0].text
    assert Job.objects.get(pk=job.pk).status != "canceled", "nothing canceled before the confirmation"
    click(browser, "#accs-confirm-back")  # the operator thinks again
    wait(browser, lambda d: css(d, "#accs-job-cancel"), "the job page again")
    assert Job.objects.get(pk=job.pk).status != "canceled", "going back cancels nothing"
    assert not css(browser, ".messagelist .success")

    click(browser, "#accs-job-cancel")
    wait(browser, lambda d: css(d, "#accs-confirm"), "the confirmation")
    click(browser, "#accs-confirm")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the cancel's message")
    assert "job canceled" in css(browser, ".messagelist .success")[0].text
    assert "canceled" in css(browser, "#accs-summary h2")[0].text
    assert Job.objects.get(pk=job.pk).status == "canceled"

    click(browser, ".object-tools a.historylink")
    wait(browser, lambda d: css(d, "#change-history, #content-main"), "the job's history")
    rows = [r.text for r in css(browser, "#change-history tbody tr")]
    assert any("root" in r and "Cancel: job canceled" in r for r in rows), rows

    browser.get(f"{base}/admin/")
    wait(browser, lambda d: css(d, "#recent-actions-module"), "Recent actions")
    recent = [a for a in css(browser, "#recent-actions-module li a") if a.text == f"job {job.pk}"]
    assert recent, css(browser, "#recent-actions-module")[0].text
    recent[0].click()
    wait(browser, lambda d: css(d, "#accs-summary"), "the job page from Recent actions")
    assert str(job.pk) in browser.current_url


def job_moves_in_db(job: Job) -> int:
    """The job's running ↔ waiting moves on its timeline, line by line (a report folds them into its tasks' rows)."""
    return sum(1 for e in Event.objects.filter(job_id=job.pk, type="status") for line in unfold(e) if is_flapping(line))


def test_one_task_job_timeline_hides_running_waiting_moves_until_asked(browser, live_server):
    tenant = two_tenants().acme
    svc = _service("step")
    single = api.start_service("step", tenant=tenant)
    run_ok(claim_for(svc))
    create_workflow(name="pair", steps=[{"key": "a", "service": "step"},
                                        {"key": "b", "service": "step", "depends_on": ["a"]}])
    pair = api.start_workflow("pair", tenant=tenant)  # one task per step: the job waits between them
    for _ in range(2):
        run_ok(claim_for(svc))
    assert job_moves_in_db(single) == 1 and job_moves_in_db(pair) >= 2, "the job's moves around its tasks"
    base = logged_in(browser, live_server)

    def job_moves() -> list[str]:
        rows = css(browser, "#accs-timeline tr.accs-event")
        messages = [r.find_elements("css selector", "td")[-1].text for r in rows]
        return [m for m in messages if m.startswith(("job running → waiting", "job waiting → running"))]

    for job in (single, pair):
        moves = job_moves_in_db(job)
        browser.get(f"{base}/admin/jobs/job/{job.pk}/change/")
        wait(browser, lambda d: css(d, "#accs-timeline tr.accs-event"), "the timeline")
        assert job_moves() == [], "hidden by default"
        assert f"{moves} job running ↔ waiting change" in css(browser, "#accs-moves-hidden")[0].text
        shown = [r.text for r in css(browser, "#accs-timeline tr.accs-event")]
        assert any("job running → done" in r for r in shown), "the moves an operator acts on stay"

        click(browser, '#accs-moves-filter a[data-moves="all"]')
        wait(browser, lambda d: "moves=all" in d.current_url, "the filter")
        wait(browser, lambda d: css(d, "#accs-timeline tr.accs-event"), "the full timeline")
        assert len(job_moves()) == moves, (job.target_name, job_moves())
        assert not css(browser, "#accs-moves-hidden")
