"""The job page and attempt logs in a real browser (headless Chromium against a live server): the
progress bar moving without a reload, the page stopping its refresh when the job ends, a download
(and none for another tenant's admin),
and an attempt's log filtered by level.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the README's screenshots (``job_page.png``,
``attempt_log.png``); by default they go to the test's temporary directory.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from events.artifacts import record_artifact, upload_attempt_log
from jobs import transitions
from jobs.models import Attempt, Job, Task
from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


# The page swaps its sections in every second, so a row is read in one script call: an element
# found by one call may already be replaced by the next.
READ_ROW = """
const row = document.querySelector(`tr.accs-task[data-task-key="${arguments[0]}"]`);
if (!row) return null;
const text = (sel) => (row.querySelector(sel) || {}).textContent?.trim() ?? "";
const bar = row.querySelector(".accs-progress");
return {progress: bar ? bar.dataset.progress : "", width: bar ? bar.firstElementChild.style.width : "",
        attempt: text(".accs-attempt-no"), node: text(".accs-node"), elapsed: text(".accs-elapsed")};
"""


def task_row(driver, task_key: str) -> dict:
    return driver.execute_script(READ_ROW, task_key) or {}


def progress_of(driver, task_key: str) -> str:
    return task_row(driver, task_key).get("progress", "")


def test_job_page_progress_moves_without_reload_and_the_download_link_downloads(browser, live_server, shots,
                                                                                  tmp_path, s3):
    scene = pipeline_scene(two_tenants())
    make_user("root", superuser=True)
    task = Task.objects.get(job=scene.running)
    transitions.mark_running([(task.pk, task.attempt, 4242)], agent_id="agent-t", source="agent:test")
    transitions.report_progress([(task.pk, task.attempt, 0.35)], source="agent:test")
    report = b"frame,ms\n1,40\n2,38\n"
    record_artifact(job_id=scene.running.pk, task_id=task.pk, attempt=task.attempt, kind="output",
                    name="timings.csv", data=report)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    base = live_server.url
    log_in(browser, base, "root")
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})

    browser.get(f"{base}{reverse('admin:jobs_job_change', args=[scene.running.pk])}?refresh=1")
    wait(browser, lambda d: progress_of(d, task.task_key) == "0.350", "the task's progress bar at 35 %")
    row = task_row(browser, task.task_key)
    assert row["attempt"] == f"attempt {task.attempt} (first of {task.max_attempts})" and row["node"] == "node-t"
    assert row["elapsed"] not in ("", "—"), row
    browser.execute_script("window.accsNotReloaded = true")

    # The agent reports more progress; the page picks it up from data.json, without a reload.
    transitions.report_progress([(task.pk, task.attempt, 0.8)], source="agent:test")
    wait(browser, lambda d: progress_of(d, task.task_key) == "0.800", "the progress bar moving to 80 %")
    assert browser.execute_script("return window.accsNotReloaded === true"), "the page was not reloaded"
    assert task_row(browser, task.task_key)["width"] == "80%"
    full_page_screenshot(browser, shots / "job_page.png", max_height=1900)

    # The download link streams the file through Django.
    click(browser, "#accs-pause")  # hold the sections still while clicking into them
    browser.execute_script(
        'document.querySelector(\'tr.accs-artifact[data-name="timings.csv"] a.accs-download\').click()')
    target = downloads / "timings.csv"
    wait(browser, lambda d: target.exists() and target.read_bytes() == report, "timings.csv in the download folder")
    click(browser, "#accs-pause")

    # The task finishes: the page shows the final state once more, then stops refreshing.
    transitions.report([transitions.Outcome(task_id=task.pk, attempt=task.attempt, status="succeeded", results={})],
                       agent_id="agent-t", source="agent:test")
    assert Job.objects.get(pk=scene.running.pk).status == "done"
    wait(browser, lambda d: css(d, "#accs-job")[0].get_attribute("data-active") == "0", "the refresh stopping")
    assert css(browser, "#accs-job")[0].get_attribute("data-status") == "done"
    assert progress_of(browser, task.task_key) == "1.000"
    assert "refresh stopped" in css(browser, "#accs-refresh")[0].text
    assert browser.execute_script("return window.accsNotReloaded === true")


def test_attempt_log_page_shows_lines_and_filters_by_level(browser, live_server, shots, s3):
    tenants = two_tenants()
    scene = pipeline_scene(tenants)
    make_user("alice", tenants={tenants.acme: "viewer"})
    failed = Task.objects.get(job=scene.failed, status="error")
    attempt = Attempt.objects.get(task=failed, attempt_no=failed.attempt)
    records = [
        {"ts": "2025-03-01T11:04:39.123000+00:00", "level": "info", "message": f"{failed.task_key}: 240 frames"},
        {"ts": "2025-03-01T11:04:40.007000+00:00", "level": "info", "message": "frame 1/240 done in 38 ms"},
        {"ts": "2025-03-01T11:04:52.514000+00:00", "level": "warn", "message": "memory at 91 % of the limit"},
        {"ts": "2025-03-01T11:04:55.901000+00:00", "level": "error",
         "message": "render crashed: exit 137 (out of memory)"},
        {"ts": "2025-03-01T11:04:55.950000+00:00", "level": "info", "message": "attempt 2 ended: failed"},
    ]
    upload_attempt_log(job_id=scene.failed.pk, task_id=failed.pk, task_key=failed.task_key, attempt=attempt.attempt_no,
                       records=records)
    base = live_server.url
    log_in(browser, base, "alice")

    # From the job page's attempts table to the log.
    browser.get(f"{base}{reverse('admin:jobs_job_change', args=[scene.failed.pk])}")
    wait(browser, lambda d: css(d, "svg.accs-dag"), "the job page")
    log_url = reverse("ops:attempt_log", args=[scene.failed.pk, attempt.pk])
    click(browser, f'#accs-attempts a[href="{log_url}"]')
    wait(browser, lambda d: css(d, "tr.accs-log-line"), "the log's lines")
    lines = css(browser, "tr.accs-log-line")
    assert [r.get_attribute("data-level") for r in lines] == ["info", "info", "warn", "error", "info"]
    assert lines[0].find_element("css selector", ".accs-time").text.endswith(" 11:04:39.123 UTC")
    assert "out of memory" in lines[3].text
    full_page_screenshot(browser, shots / "attempt_log.png", max_height=900)

    click(browser, '#accs-log-level a[data-level="warn"]')
    wait(browser, lambda d: "level=warn" in d.current_url, "the ≥ warn filter")
    assert [r.get_attribute("data-level") for r in css(browser, "tr.accs-log-line")] == ["warn", "error"]
    click(browser, "#accs-back")
    wait(browser, lambda d: css(d, "svg.accs-dag"), "back on the job page")


def test_another_tenants_admin_gets_no_download_and_no_page(browser, live_server, tmp_path, s3):
    tenants = two_tenants()
    scene = pipeline_scene(tenants)
    assert scene.running.tenant_id == tenants.acme.pk
    make_user("gina", tenants={tenants.globex: "admin"})
    task = Task.objects.get(job=scene.running)
    artifact = record_artifact(job_id=scene.running.pk, task_id=task.pk, attempt=task.attempt, kind="output",
                               name="secret.csv", data=b"acme only\n")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    base = live_server.url
    log_in(browser, base, "gina")
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})

    browser.get(base + reverse("ops:job_artifact", args=[scene.running.pk, artifact.pk]))
    wait(browser, lambda d: "not found" in d.find_element("tag name", "body").text.lower(), "a not-found page")
    browser.get(base + reverse("admin:jobs_job_change", args=[scene.running.pk]))
    wait(browser, lambda d: css(d, ".messagelist"), "the admin's message after the redirect")
    assert "doesn’t exist" in css(browser, ".messagelist")[0].text, "the job is as good as missing for her"
    assert "secret.csv" not in browser.page_source
    assert list(downloads.iterdir()) == [], "nothing was downloaded"
