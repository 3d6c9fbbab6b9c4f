"""The job, task and node pages in a real browser (headless Chromium against a live server): a stuck
job says why and the fix, its task page says the same, a cancel asks first and the page keeps
refreshing until the running task has stopped, and the node page drains its node.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh ``job_stuck.png``, ``task_page.png`` and
``node_page.png``.
"""

from __future__ import annotations

import pytest

from jobs import api, transitions
from jobs.models import Task
from nodes.models import Node
from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.engine_helpers import claim_for, run_fail
from tests.ops_helpers import _service, make_user, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_stuck_job_and_its_task_say_why_and_the_node_page_drains(browser, live_server, shots):
    tenants = two_tenants()
    _service("transcode", block_during=["live_session"])
    stuck = api.start_service("transcode", tenant=tenants.acme, params={})
    api.raise_condition("live_session", reason="studio A is live", by="alice")
    Node.objects.create(name="node-t", services=["encode"], version="0.1.0")
    encode = _service("encode", max_attempts=2)
    failed = api.start_service("encode", tenant=tenants.acme)
    run_fail(claim_for(encode), error="exit 3: disk full on /srv")
    running = api.start_service("encode", tenant=tenants.acme)
    claims = [c for c in claim_for(encode) if c.job_id == running.pk]
    transitions.mark_running([(c.id, c.attempt, 4242) for c in claims], agent_id="agent-t", source="agent:test")
    transitions.report_progress([(c.id, c.attempt, 0.35) for c in claims], source="agent:test")
    make_user("root", superuser=True)
    base = live_server.url
    log_in(browser, base, "root")

    browser.get(f"{base}/admin/jobs/job/{stuck.pk}/change/")
    wait(browser, lambda d: css(d, '#accs-stuck li[data-reason="governor"]'), "the job's governor reason")
    reasons = {li.get_attribute("data-reason"): li.text for li in css(browser, "#accs-stuck li")}
    assert set(reasons) == {"no_agent", "governor"}, reasons
    assert "manage.py runagent --services transcode" in reasons["no_agent"]
    full_page_screenshot(browser, shots / "job_stuck.png", max_height=1300)

    click(browser, 'tr.accs-task[data-task-key="transcode"] a')
    wait(browser, lambda d: css(d, "#accs-task-summary"), "the task page")
    assert {li.get_attribute("data-reason") for li in css(browser, "#accs-stuck li")} == {"no_agent", "governor"}
    assert css(browser, "#accs-task-cancel"), "a queued task can be canceled from its page"

    task = Task.objects.get(job=running)
    browser.get(f"{base}/admin/jobs/task/{task.pk}/change/")
    wait(browser, lambda d: css(d, "#accs-task-node"), "the running task's node link")
    assert css(browser, "#accs-task-progress")[0].text == "35 %"
    assert css(browser, "#accs-task-attempt")[0].text == "attempt 1 (first of 2)"
    full_page_screenshot(browser, shots / "task_page.png", max_height=1300)
    click(browser, "#accs-task-node")

    wait(browser, lambda d: css(d, "#accs-node-running"), "the node page")
    rows = css(browser, "tr.accs-node-task")
    assert [r.get_attribute("data-task-key") for r in rows] == ["encode"] and "35 %" in rows[0].text
    assert "exit 3: disk full on /srv" in css(browser, "#accs-node-failures")[0].text
    full_page_screenshot(browser, shots / "node_page.png", max_height=1300)
    click(browser, "#accs-node-drain")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the drain's message")
    assert "node-t is draining" in css(browser, ".messagelist .success")[0].text
    assert css(browser, "#accs-node-undrain") and Node.objects.get(name="node-t").state == "draining"
    assert failed.pk != running.pk


def test_canceled_job_page_refreshes_until_its_task_stops_then_offers_retry(browser, live_server):
    tenants = two_tenants()
    svc = _service("render-long")
    job = api.start_service("render-long", tenant=tenants.acme)
    held = claim_for(svc)
    make_user("root", superuser=True)
    base = live_server.url
    log_in(browser, base, "root")

    browser.get(f"{base}/admin/jobs/job/{job.pk}/change/?refresh=1")
    wait(browser, lambda d: css(d, "#accs-job-cancel"), "the cancel button")
    click(browser, "#accs-job-cancel")
    wait(browser, lambda d: css(d, "#accs-confirm"), "the confirmation")
    click(browser, "#accs-confirm")
    wait(browser, lambda d: css(d, "#accs-job-stopping"), "the 'still stopping' note")
    assert not css(browser, "#accs-job-retry"), "no retry while the task still runs"
    assert css(browser, "#accs-job")[0].get_attribute("data-active") == "1"

    browser.execute_script("window.accsNoReload = true")
    run_fail(held, status="canceled", error="stopped on request")  # the agent stops it at its heartbeat
    wait(browser, lambda d: css(d, "#accs-job-retry"), "Retry, once the task has stopped")
    assert css(browser, "#accs-job")[0].get_attribute("data-active") == "0", "the refresh stopped"
    assert browser.execute_script("return window.accsNoReload") is True, "updated without a reload"
    assert not css(browser, "#accs-job-stopping")


def test_job_and_task_lists_fit_1440_px_and_show_the_last_error(browser, live_server, shots):
    from tests.ops_helpers import pipeline_scene

    scene = pipeline_scene(two_tenants())
    make_user("root", superuser=True)
    base = live_server.url
    log_in(browser, base, "root")
    browser.execute_script("localStorage.removeItem('django.admin.navSidebarIsOpen')")  # a first visit
    for path, shot in (("/admin/jobs/job/", "jobs_list.png"), ("/admin/jobs/task/", "tasks_list.png")):
        browser.get(base + path)
        wait(browser, lambda d: css(d, "#result_list"), f"the list at {path}")
        fits = browser.execute_script(
            "const r = document.querySelector('.results'), t = document.querySelector('#result_list');"
            "return {scroll: r.scrollWidth, client: r.clientWidth, right: t.getBoundingClientRect().right,"
            " page: document.documentElement.clientWidth};")
        assert fits["scroll"] <= fits["client"] and fits["right"] <= fits["page"], (path, fits)
        assert not css(browser, "#nav-sidebar") or not css(browser, "#nav-sidebar")[0].is_displayed(), \
            "the sidebar starts closed"
        errors = [e.text for e in css(browser, "td.field-last_error .accs-error-text")]
        assert any("out of memory" in e for e in errors), (path, errors)
        full_page_screenshot(browser, shots / shot, max_height=900)
    assert browser.get_window_size()["width"] == 1440
    assert scene.failed.status == "error"
