"""The operators' pages in a real browser: headless Chromium (Debian ``chromium`` + ``chromium-driver``)
driven by selenium against a live server on 127.0.0.1.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the README's screenshots; by default they
go to the test's temporary directory.
"""

from __future__ import annotations

import pytest

from jobs.ids import short_id
from jobs.models import Task
from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_operator_opens_dashboard_then_failed_job_and_retries_it(browser, live_server, shots):
    scene = pipeline_scene(two_tenants())
    make_user("root", superuser=True)
    failed_task = Task.objects.get(job=scene.failed, status="error")
    base = live_server.url
    log_in(browser, base, "root")

    # The dashboard: cards, tenants, nodes (one stale), governor; it refreshes itself.
    browser.get(f"{base}/admin/dashboard/?refresh=1")
    wait(browser, lambda d: css(d, "#accs-cards"), "the summary cards")
    dead = css(browser, '[data-card="dead_letter"] .value')[0].text
    assert dead == "2", "one dead letter in each tenant"
    shown = [r.get_attribute("data-tenant") for r in css(browser, "#accs-tenants tr[data-tenant]")]
    assert {"acme", "globex"} <= set(shown), shown
    assert css(browser, 'tr[data-node="edge-2"][data-stale="1"]'), "the node without heartbeat is flagged"
    wait(browser, lambda d: int(css(d, "#accs-dashboard")[0].get_attribute("data-refreshed") or 0) >= 1,
         "the dashboard refreshing itself from data.json")
    full_page_screenshot(browser, shots / "dashboard.png")

    # From the recent failures to the job page: DAG picture and timeline.
    click(browser, f'#accs-failures a[href*="{scene.failed.pk}"]')
    wait(browser, lambda d: css(d, "svg.accs-dag"), "the DAG picture on the job page")
    states = {g.get_attribute("data-step"): g.get_attribute("data-status") for g in css(browser, "svg.accs-dag g.step")}
    assert states == {"fetch": "done", "render": "error", "package": "skipped", "notify": "skipped"}
    rows = css(browser, f'tr.accs-task[data-task-key="{failed_task.task_key}"]')
    assert rows and rows[0].get_attribute("data-status") == "error"
    levels = {r.get_attribute("data-level") for r in css(browser, "tr.accs-event")}
    assert {"info", "warn", "error"} <= levels
    full_page_screenshot(browser, shots / "job.png", max_height=1700)
    click(browser, 'a[data-level="error"]')
    wait(browser, lambda d: "level=error" in d.current_url, "the error-level filter")
    assert {r.get_attribute("data-level") for r in css(browser, "tr.accs-event")} == {"error"}

    # Retry from the page: the failed task is queued again.
    click(browser, "#accs-job-retry")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the retry's success message")
    assert f"Retry: job {short_id(scene.failed.pk)} (publish v1): job back to waiting" in css(
        browser, ".messagelist .success")[0].text
    row = css(browser, f'tr.accs-task[data-task-key="{failed_task.task_key}"]')[0]
    assert row.get_attribute("data-status") == "queued"
    failed_task.refresh_from_db()
    assert failed_task.status == "queued"
    assert failed_task.max_attempts - failed_task.attempt == failed_task.service.max_attempts, "budget renewed"
    assert not css(browser, "#accs-job-retry"), "a running job offers no retry"

    # Cancel asks first (a page saying what it does), then acts and names the job.
    click(browser, "#accs-job-cancel")
    wait(browser, lambda d: css(d, "#accs-confirm"), "the cancel confirmation")
    assert "running tasks are told to stop" in css(browser, "#accs-confirm-note")[0].text
    scene.failed.refresh_from_db()
    assert scene.failed.status != "canceled", "nothing happens before the confirmation"
    click(browser, "#accs-confirm")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the cancel's success message")
    assert css(browser, ".messagelist .success")[0].text.startswith(f"Cancel: job {short_id(scene.failed.pk)}")
    scene.failed.refresh_from_db()
    assert scene.failed.status == "canceled"


def test_tenant_admin_cannot_reach_another_tenants_job_by_url(browser, live_server):
    tenants = two_tenants()
    scene = pipeline_scene(tenants)
    make_user("alice", tenants={tenants.acme: "admin"})
    base = live_server.url
    log_in(browser, base, "alice")

    browser.get(f"{base}/admin/jobs/job/{scene.other_tenant_job.pk}/change/")
    wait(browser, lambda d: css(d, ".messagelist"), "the admin's message after the redirect")
    assert browser.current_url.rstrip("/").endswith("/admin")
    assert "doesn’t exist" in css(browser, ".messagelist")[0].text
    assert not css(browser, "svg.accs-dag")

    browser.get(f"{base}/admin/jobs/job/{scene.failed.pk}/change/")
    wait(browser, lambda d: css(d, "svg.accs-dag"), "her own tenant's job page")
    browser.get(f"{base}/admin/dashboard/")
    wait(browser, lambda d: css(d, "#accs-tenants"), "the dashboard")
    assert [r.get_attribute("data-tenant") for r in css(browser, "#accs-tenants tr[data-tenant]")] == ["acme"]
    assert not css(browser, "#accs-nodes"), "nodes are infrastructure, not shown to a tenant admin"
