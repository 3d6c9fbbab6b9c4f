"""The operators' pages in a real browser: headless Chromium (Debian ``chromium`` + ``chromium-driver``)
driven by selenium against a live server on 127.0.0.1.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the README's screenshots; by default they
go to the test's temporary directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from jobs.models import Task
from tests.ops_helpers import PASSWORD, make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 15  # seconds: the longest any page may take to show what a step waits for


@pytest.fixture
def browser(tmp_path):
    """A fresh headless Chromium (own profile, no background network) for one test."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("install chromium and chromium-driver (apt-get) to run the browser tests")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", "--window-size=1440,1000",
                "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT * 2)
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path) -> Path:
    target = Path(os.environ.get("ACCS_SCREENSHOT_DIR") or tmp_path / "screenshots")
    target.mkdir(parents=True, exist_ok=True)
    return target


def wait(driver, condition, message: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(condition)
    except TimeoutException:
        pytest.fail(f"timed out after {WAIT}s waiting for: {message} (at {driver.current_url})")


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def log_in(driver, base: str, username: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/admin/login/?next=/admin/")
    driver.find_element(By.ID, "id_username").send_keys(username)
    driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait(driver, lambda d: d.current_url.rstrip("/").endswith("/admin"), f"{username} is logged in")
    # Collapse the navigation sidebar (Django remembers it in localStorage): wider pages, cleaner shots.
    driver.execute_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")


def full_page_screenshot(driver, path: Path, *, max_height: int = 2400) -> None:
    """Save a PNG of the whole page (up to ``max_height`` CSS pixels), not just the viewport."""
    import base64

    metrics = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics.get("cssContentSize") or metrics["contentSize"]
    height = min(int(size["height"]) + 16, max_height)
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": int(size["width"]), "height": height, "scale": 1},
    })
    path.write_bytes(base64.b64decode(shot["data"]))
    assert path.stat().st_size > 10_000, f"{path} looks empty"


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
    css(browser, f'#accs-failures a[href*="{scene.failed.pk}"]')[0].click()
    wait(browser, lambda d: css(d, "svg.accs-dag"), "the DAG picture on the job page")
    states = {g.get_attribute("data-step"): g.get_attribute("data-status") for g in css(browser, "svg.accs-dag g.step")}
    assert states == {"fetch": "done", "render": "error", "package": "skipped", "notify": "skipped"}
    rows = css(browser, f'tr.accs-task[data-task-key="{failed_task.task_key}"]')
    assert rows and rows[0].get_attribute("data-status") == "error"
    levels = {r.get_attribute("data-level") for r in css(browser, "tr.accs-event")}
    assert {"info", "warn", "error"} <= levels
    full_page_screenshot(browser, shots / "job.png", max_height=1700)
    css(browser, 'a[data-level="error"]')[0].click()
    wait(browser, lambda d: "level=error" in d.current_url, "the error-level filter")
    assert {r.get_attribute("data-level") for r in css(browser, "tr.accs-event")} == {"error"}

    # Retry from the page: the failed task is queued again.
    css(browser, "#accs-job-retry")[0].click()
    wait(browser, lambda d: css(d, ".messagelist .success"), "the retry's success message")
    assert "Retry: job back to running" in css(browser, ".messagelist .success")[0].text
    row = css(browser, f'tr.accs-task[data-task-key="{failed_task.task_key}"]')[0]
    assert row.get_attribute("data-status") == "queued"
    failed_task.refresh_from_db()
    assert failed_task.status == "queued"
    assert failed_task.max_attempts - failed_task.attempt == failed_task.service.max_attempts, "budget renewed"
    assert not css(browser, "#accs-job-retry"), "a running job offers no retry"


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
