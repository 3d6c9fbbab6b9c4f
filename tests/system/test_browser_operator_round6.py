"""The operators' fourth round, its last items, in a real browser (headless Chromium against a live server):
Django's own date columns in the one time format, a few tab stops to the jobs list's first row, a redrive
that reports each batch as it commits, and agents' deploys on the system timeline.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

import re

import pytest

from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WHEN = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def logged_in(browser, live_server) -> str:
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    return live_server.url


def tab_stops_to_first_row(browser, *, limit: int = 60) -> list[str]:
    """Press Tab from the top of the page until the first row of the results has the focus; return what
    each press focused on the way (the last is inside the first row)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    first_row = css(browser, "#result_list tbody tr")[0]
    stops: list[str] = []
    for _ in range(limit):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        here = browser.switch_to.active_element
        stops.append((here.get_attribute("id") or "") + " " + here.tag_name + " " + (here.text or
                     here.get_attribute("name") or "")[:30])
        if browser.execute_script("return arguments[0].contains(document.activeElement)", first_row):
            return stops
    raise AssertionError(f"no tab stop in the first row after {limit} presses: {stops}")


def test_a_few_tab_stops_lead_from_the_top_of_the_jobs_list_to_its_first_row(browser, live_server, shots):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    pipeline_scene(two_tenants())
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/job/")
    wait(browser, lambda d: css(d, "#result_list tbody tr"), "the jobs list")
    # The top of the list: where the admin's own "Skip to main content" lands.
    css(browser, "a.skip-to-content-link")[0].send_keys(Keys.ENTER)
    wait(browser, lambda d: d.switch_to.active_element.get_attribute("id") == "content-start", "the list's top")
    stops = tab_stops_to_first_row(browser)
    assert len(stops) <= 7, "\n".join(stops)  # sixteen before: each tool, the search button, each header

    # The tools and the column headers are one stop each; the arrow keys reach the rest.
    tools = css(browser, "#content ul.object-tools a")
    assert [a.get_attribute("tabindex") for a in tools].count("0") == 1
    tools[0].send_keys(Keys.ARROW_RIGHT)
    assert browser.switch_to.active_element == tools[1]
    headers = css(browser, "#result_list thead a")
    headers[0].send_keys(Keys.ARROW_RIGHT)
    assert browser.switch_to.active_element == headers[1]
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    wait(browser, lambda d: "o=" in d.current_url, "Enter on a header sorts by it")
    full_page_screenshot(browser, shots / "tab_stops_jobs_list.png", max_height=1200)


def three_looks(browser, url: str, ready: str, what: str, shot) -> None:
    """Open ``url`` light, dark and on a 390 px phone (dark), each waiting for ``ready``; screenshot each
    (``shot(look)`` names the file) and check the phone's page does not overflow sideways."""
    for look in ("light", "dark", "phone"):
        if look == "phone":
            browser.set_window_size(390, 844)
        browser.execute_script(f"localStorage.setItem('theme', '{'light' if look == 'light' else 'dark'}')")
        browser.get(url)
        wait(browser, lambda d: css(d, ready), what)
        if look == "phone":
            wide = browser.execute_script("return document.documentElement.scrollWidth")
            assert wide <= browser.execute_script("return document.documentElement.clientWidth") + 1, (url, wide)
        full_page_screenshot(browser, shot(look), max_height=1600)
    browser.set_window_size(1440, 1000)


def test_djangos_own_date_columns_and_ages_follow_the_display_zone(browser, live_server, shots):
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import Trigger
    from tests.ops_helpers import system_scene
    from workflows.models import Service

    tenants = two_tenants()
    pipeline_scene(tenants)
    system_scene(now=timezone.now())
    Trigger.objects.create(tenant=tenants.acme, label="nightly",
                           trigger_type="schedule", cron_expr="0 2 * * *", timezone="Europe/Oslo",
                           service=Service.objects.first(), next_run_at=timezone.now() + timedelta(hours=3),
                           last_fired_at=timezone.now() - timedelta(hours=21))
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/job/")
    browser.execute_script("localStorage.setItem('accs.tz', 'Asia/Tokyo')")
    lists = {"jobs": "/admin/jobs/job/", "triggers": "/admin/jobs/trigger/", "nodes": "/admin/nodes/node/",
             "outages": "/admin/jobs/outage/", "leader_terms": "/admin/jobs/leaderterm/"}
    for name, path in lists.items():
        browser.get(base + path)
        wait(browser, lambda d: css(d, "#result_list tbody tr"), name)
        times = css(browser, "#result_list time.accs-when")
        assert times, f"the {name} list's moments are <time> elements"
        shown = [t.text for t in times]
        assert all(re.fullmatch(WHEN + " GMT\\+9", s) for s in shown), (name, shown[:4])
        if name == "triggers":
            ages = [c.text for c in css(browser, "#result_list .field-last_fired")]
            assert ages and ages[0].endswith("· 21 h 0 min ago"), ages
    three_looks(browser, base + "/admin/jobs/trigger/", "#result_list time.accs-when", "the triggers",
                lambda look: shots / f"time_format_triggers_{look}.png")


def test_a_redrive_shows_each_batch_as_it_commits_then_the_summary(browser, live_server, shots, monkeypatch):
    from jobs import admin as jobs_admin
    from tests.ops_helpers import failed_service_job

    monkeypatch.setattr(jobs_admin, "REDRIVE_BATCH", 2)
    tenants = two_tenants()
    for i in range(5):
        failed_service_job(tenants.acme, key=f"flaky-{i}")
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/task/redrive/")
    wait(browser, lambda d: css(d, 'input[name="preview"]'), "the redrive form")
    click(browser, 'input[name="preview"]')
    wait(browser, lambda d: css(d, "#accs-redrive-confirm"), "the count")
    click(browser, "#accs-redrive-confirm")
    wait(browser, lambda d: css(d, "#accs-redrive-summary"), "the summary")
    lines = [li.text for li in css(browser, "#accs-redrive-batches li.accs-redrive-batch")]
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 2", "batch 3"], lines
    assert "5 taken in so far, 5 redriven" in lines[-1], lines
    assert browser.execute_script("return document.getElementById('accs-redrive-bar').value") == 5
    assert css(browser, "#accs-redrive-summary")[0].text.startswith("Redrive: 5 matched, 5 redriven, 0 skipped")
    page = browser.current_url
    assert css(browser, "#accs-redrive-back")[0].get_attribute("href").endswith("/admin/jobs/task/")
    full_page_screenshot(browser, shots / "redrive_progress_light.png", max_height=1200)
    for look in ("dark", "phone"):
        if look == "phone":
            browser.set_window_size(390, 844)
        browser.execute_script("localStorage.setItem('theme', 'dark')")
        browser.execute_script("document.documentElement.dataset.theme = 'dark'")
        full_page_screenshot(browser, shots / f"redrive_progress_{look}.png", max_height=1200)
    assert page == browser.current_url


def test_a_nodes_deploy_is_dated_on_the_dashboards_system_timeline(browser, live_server, shots):
    from nodes.api import register_node

    register_node("edge-7", labels={}, services=[], agent_id="h:1:a", version="0.2.0")
    register_node("edge-7", labels={}, services=[], agent_id="h:2:b", version="0.3.0")
    base = logged_in(browser, live_server)
    row = '#accs-system-timeline tr[data-kind="deploy"]'
    three_looks(browser, f"{base}/admin/dashboard/?refresh=60", row, "the node's deploy on the system timeline",
                lambda look: shots / f"node_deploy_timeline_{look}.png")
    deploy = css(browser, row)[0]
    assert "node edge-7 runs ACCS 0.3.0 (was 0.2.0)" in deploy.text, deploy.text
    link = deploy.find_element("css selector", "a")
    assert link.get_attribute("href").endswith("/admin/nodes/node/edge-7/change/")
