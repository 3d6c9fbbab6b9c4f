"""The operators' fourth round, the rest, in a real browser (headless Chromium against a live server): a
system timeline beside the job's, an attempt stopped by an outage saying so, a log length chosen without
editing the URL, and the keyboard ("/" to search, a skip link to the first row).

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, system_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def logged_in(browser, live_server) -> str:
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    return live_server.url


def test_the_system_timeline_links_the_outage_to_its_length_and_sits_beside_the_job_timeline(browser, live_server,
                                                                                              shots):
    from django.utils import timezone

    from jobs.models import Attempt

    scene = pipeline_scene(two_tenants())
    now = timezone.now()
    system_scene(now=now)
    # The failed job ran across the outage; one of its attempts was stopped by it.
    scene.failed.created_at = now - timedelta(hours=1)
    scene.failed.save(update_fields=["created_at"])
    attempt = Attempt.objects.filter(task__job=scene.failed).order_by("id").first()
    Attempt.objects.filter(pk=attempt.pk).update(
        status="interrupted", error_text="outage: the database was unreachable, so the agent could not renew the lease")
    base = logged_in(browser, live_server)

    for theme in ("light", "dark"):
        browser.execute_script(f"localStorage.setItem('theme', '{theme}')")
        browser.get(f"{base}/admin/dashboard/?refresh=60")
        wait(browser, lambda d: css(d, '#accs-system-timeline tr[data-kind="outage"]'), "the outage on the dashboard")
        full_page_screenshot(browser, shots / f"system_timeline_dashboard_{theme}.png")
    kinds = [r.get_attribute("data-kind") for r in css(browser, "#accs-system-timeline tr.accs-system-event")]
    assert {"outage", "leader", "deploy", "pause", "resume"} <= set(kinds), kinds
    stamp = css(browser, '#accs-system-timeline tr[data-kind="outage"] time')[0].text
    assert stamp.endswith(" UTC") and len(stamp) == len("2026-11-28 12:00:00 UTC"), stamp

    browser.execute_script("localStorage.setItem('theme', 'light')")
    browser.get(f"{base}/admin/jobs/job/{scene.failed.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-system-timeline"), "the system timeline on the job page")
    sections = [s.get_attribute("id") for s in css(browser, "#accs-job .accs-section")]
    assert sections.index("accs-system-timeline") + 1 == sections.index("accs-timeline"), "beside the job's timeline"
    assert "while this job ran" in css(browser, "#accs-system-timeline h2")[0].text
    pills = [p.text for p in css(browser, "#accs-attempts .accs-pill")]
    assert "interrupted: database outage" in pills, pills
    full_page_screenshot(browser, shots / "system_timeline_job_page.png")
    browser.set_window_size(390, 844)
    full_page_screenshot(browser, shots / "system_timeline_job_page_phone.png")
    browser.set_window_size(1440, 1000)

    click(browser, '#accs-system-timeline tr[data-kind="outage"] a')
    wait(browser, lambda d: "/admin/jobs/outage/" in d.current_url, "the outage's page")
    assert "database reachable again after 50.5 s" in css(browser, "#content")[0].text

    browser.get(f"{base}/admin/jobs/attempt/")
    wait(browser, lambda d: css(d, "#result_list"), "the attempts list")
    assert "interrupted: database outage" in css(browser, "#result_list")[0].text
    assert "the agent shut down" not in css(browser, "#result_list")[0].text


def test_the_log_length_is_chosen_from_a_control_keeping_the_level(browser, live_server):
    from jobs.models import Attempt

    scene = pipeline_scene(two_tenants())
    running = Attempt.objects.get(task__job=scene.running, status="running")
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/job/{scene.running.pk}/attempts/{running.pk}/log/?level=warn")
    wait(browser, lambda d: css(d, "#accs-tail"), "the lines control")
    from selenium.webdriver.support.ui import Select

    Select(css(browser, "#accs-tail")[0]).select_by_value("100")
    wait(browser, lambda d: "tail=100" in d.current_url, "the page at 100 lines")
    assert "level=warn" in browser.current_url, browser.current_url
    assert Select(css(browser, "#accs-tail")[0]).first_selected_option.text == "100"


def test_slash_focuses_search_and_the_first_tab_stop_skips_to_the_first_row(browser, live_server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    pipeline_scene(two_tenants())
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/job/")
    wait(browser, lambda d: css(d, "#result_list tbody tr"), "the jobs list")
    ActionChains(browser).send_keys("/").perform()
    wait(browser, lambda d: d.switch_to.active_element.get_attribute("id") == "searchbar", "'/' focuses the search")
    assert css(browser, "#searchbar")[0].get_attribute("value") == "", "the '/' is not typed into it"

    browser.get(f"{base}/admin/jobs/job/")
    wait(browser, lambda d: css(d, "#accs-skip-rows"), "the skip link")
    ActionChains(browser).send_keys(Keys.TAB).perform()
    assert browser.switch_to.active_element.get_attribute("id") == "accs-skip-rows", "the first tab stop"
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    focused = browser.switch_to.active_element
    first_row_link = css(browser, "#result_list tbody tr a")[0]
    assert focused == first_row_link, focused.get_attribute("outerHTML")[:200]


def test_one_time_format_with_its_zone_and_a_remembered_display_zone(browser, live_server, shots):
    from datetime import datetime

    from selenium.webdriver.support.ui import Select

    scene = pipeline_scene(two_tenants())
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/job/{scene.failed.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-tz"), "the display-zone picker")
    times = css(browser, "#accs-job time.accs-when")
    assert len(times) > 5, "the job page's times are <time> elements"
    shape = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{3})? UTC$"
    import re

    assert all(re.match(shape, t.text) for t in times), [t.text for t in times][:8]
    assert Select(css(browser, "#accs-tz")[0]).first_selected_option.get_attribute("value") == "UTC"

    Select(css(browser, "#accs-tz")[0]).select_by_value("Asia/Tokyo")
    first = css(browser, "#accs-job time.accs-when")[0]
    wait(browser, lambda d: first.text.endswith("GMT+9"), "times rewritten in Tokyo's zone")
    moment = datetime.fromisoformat(first.get_attribute("datetime"))
    shown = datetime.strptime(first.text.rsplit(" ", 1)[0].split(".")[0], "%Y-%m-%d %H:%M:%S")
    assert (shown - moment.replace(tzinfo=None, microsecond=0)).total_seconds() == 9 * 3600, (first.text, moment)
    full_page_screenshot(browser, shots / "time_zone_job_page.png")

    # Remembered: another page (the events list, its times to the millisecond) in the same zone.
    browser.get(f"{base}/admin/events/event/")
    wait(browser, lambda d: css(d, "#result_list time.accs-when"), "the events list's times")
    assert all(t.text.endswith("GMT+9") and re.search(r"\.\d{3} GMT\+9$", t.text)
               for t in css(browser, "#result_list time.accs-when"))


def test_the_dashboard_job_page_and_jobs_list_fit_a_390_px_phone(browser, live_server, shots):
    scene = pipeline_scene(two_tenants())
    system_scene_now(scene)
    base = logged_in(browser, live_server)
    browser.set_window_size(390, 844)
    width = "return document.documentElement.clientWidth"
    pages = {"dashboard": "/admin/dashboard/?refresh=60",
             "job_page": f"/admin/jobs/job/{scene.failed.pk}/change/?refresh=60", "jobs_list": "/admin/jobs/job/"}
    for name, path in pages.items():
        for theme in ("light", "dark"):
            browser.execute_script(f"localStorage.setItem('theme', '{theme}')")
            browser.get(base + path)
            wait(browser, lambda d: css(d, "#content"), name)
            viewport = browser.execute_script(width)
            wide = browser.execute_script("return document.documentElement.scrollWidth")
            assert wide <= viewport + 1, f"{name} is {wide} px wide on a {viewport} px screen"
            full_page_screenshot(browser, shots / f"phone_{name}_{theme}.png", max_height=3200)
    browser.get(base + pages["jobs_list"])
    wait(browser, lambda d: css(d, "#result_list"), "the jobs list")
    failed_row = [r for r in css(browser, "#result_list tbody tr") if "step render" in r.text]
    assert failed_row, "the failed job's row shows its error"
    status = failed_row[0].find_element("css selector", ".field-status_badge")
    error = failed_row[0].find_element("css selector", ".field-last_error")
    for cell in (status, error):
        assert cell.is_displayed() and cell.rect["x"] >= 0 and cell.rect["x"] + cell.rect["width"] <= 391, \
            (cell.get_attribute("class"), cell.rect)


def system_scene_now(scene) -> None:
    from django.utils import timezone

    system_scene(now=timezone.now())


def test_the_redrive_form_takes_dates_from_a_picker_and_sums_up_its_batches(browser, live_server, shots):
    from tests.ops_helpers import failed_service_job

    tenants = two_tenants()
    for i in range(3):
        failed_service_job(tenants.acme, key=f"flaky-{i}")
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/task/redrive/")
    wait(browser, lambda d: css(d, "#id_since"), "the redrive form")
    since = css(browser, "#id_since")[0]
    assert since.get_attribute("type") == "datetime-local", "a date picker, not free text"
    assert "YYYY-MM-DD HH:MM[:SS], UTC" in css(browser, "#content-main")[0].text, "the format and zone are said"
    browser.execute_script("arguments[0].value = '2020-01-01T00:00'", since)
    click(browser, 'input[name="preview"]')
    wait(browser, lambda d: css(d, "#accs-redrive-count"), "the count")
    assert "In 1 batch of up to 500" in css(browser, "#accs-redrive-plan")[0].text
    full_page_screenshot(browser, shots / "redrive_form.png", max_height=1200)
    click(browser, "#accs-redrive-confirm")
    wait(browser, lambda d: css(d, "#accs-redrive-summary"), "the summary")
    said = css(browser, "#accs-redrive-summary")[0].text
    assert said.startswith("Redrive: 3 matched, 3 redriven, 0 skipped") and "in 1 batch of up to 500" in said, said


def test_a_jobs_progress_and_rates_agree_wherever_they_are_shown(browser, live_server):
    from jobs import transitions
    from jobs.models import Task
    from tests.engine_helpers import claim_for
    from tests.ops_helpers import _service

    scene = pipeline_scene(two_tenants())
    service = _service("encode", max_attempts=3)
    from jobs import api

    job = api.start_service("encode", tenant=scene.failed.tenant)
    (claimed,) = claim_for(service)
    transitions.mark_running([(claimed.id, claimed.attempt, 4242)], agent_id="agent-t", source="agent:test")
    transitions.report_progress([(claimed.id, claimed.attempt, 0.32)], source="agent:test")
    assert Task.objects.get(pk=claimed.id).progress == pytest.approx(0.32)
    base = logged_in(browser, live_server)
    browser.get(f"{base}/admin/jobs/job/{job.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-job-progress"), "the job page")
    summary = css(browser, "#accs-job-progress")[0].text
    fields = css(browser, ".field-progress_shown .readonly")[0].text
    task = css(browser, '#accs-tasks tr[data-task-key="encode"] .accs-progress-pct')[0].text
    assert summary == fields == task == "32 %", (summary, fields, task)

    browser.get(f"{base}/admin/dashboard/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-services"), "the dashboard")
    text = css(browser, "#accs-dashboard")[0].text
    assert "/min" not in text and "/h" in text, "one rate unit throughout"
