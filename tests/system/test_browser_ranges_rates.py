"""Issue 37, items 4 and 7, in a real browser (headless Chromium against a live server): which node or service
is sick (success and failure over a range, on the dashboard, a node's page and a service's page, each
linking the attempts list filtered by it); one time range for the dashboard and the lists; an action over a
whole filtered list after a count; an export of the filtered list.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

import pytest

from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def logged_in(browser, live_server) -> str:
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    return live_server.url


def shoot(browser, shots, name: str, *, url: str, ready: str) -> None:
    """Save the page light, dark and at 390 px (dark), then restore light at 1440 px (the phone layout of
    the pages themselves is checked by the phone tests; here the picture is for docs/operators.md)."""
    for theme in ("light", "dark"):
        browser.execute_script(f"localStorage.setItem('theme', '{theme}')")
        browser.get(url)
        wait(browser, lambda d: css(d, ready), ready)
        full_page_screenshot(browser, shots / f"{name}_{theme}.png")
    browser.set_window_size(390, 844)
    browser.get(url)
    wait(browser, lambda d: css(d, ready), ready)
    full_page_screenshot(browser, shots / f"{name}_phone.png")
    browser.set_window_size(1440, 1000)
    browser.execute_script("localStorage.setItem('theme', 'light')")


def test_which_node_and_service_fail_shown_over_the_range_and_linked_to_their_attempts(browser, live_server, shots):
    from jobs.models import Attempt
    from workflows.models import Service

    pipeline_scene(two_tenants())  # render failed twice on node-t (out of memory), three renders succeeded
    base = logged_in(browser, live_server)
    render = Service.objects.get(key="render")

    browser.get(f"{base}/admin/dashboard/?refresh=300&range=1h")
    wait(browser, lambda d: css(d, "#accs-rates [data-rates=node] tr[data-rate='node-t']"), "node-t's rates")
    row = css(browser, "#accs-rates [data-rates=service] tr[data-rate='render']")[0]
    assert row.find_elements("css selector", "[data-failed]")[0].text == "2"
    assert row.find_elements("css selector", "[data-success]")[0].text == "60 %"
    node_row = css(browser, "#accs-rates [data-rates=node] tr[data-rate='node-t']")[0]
    on_node = Attempt.objects.filter(node="node-t")
    failed_on_node = on_node.filter(status__in=("failed", "timeout")).count()
    assert node_row.find_elements("css selector", "[data-failed]")[0].text == str(failed_on_node)

    # The node's name opens the attempts list filtered by that node, each row linking its attempt, task and job.
    node_row.find_element("link text", "node-t").click()
    wait(browser, lambda d: "node=node-t" in d.current_url and css(d, "#result_list"), "the node's attempts")
    assert len(css(browser, "#result_list tbody tr")) == on_node.count()
    first = css(browser, "#result_list tbody tr")[0]
    hrefs = {a.get_attribute("href").split(base)[-1].split("/")[3] for a in first.find_elements("css selector", "a")}
    assert {"attempt", "task", "job"} <= hrefs, hrefs

    # And by service, from the sidebar's filter.
    browser.get(f"{base}/admin/jobs/attempt/?service={render.pk}&status__exact=failed")
    wait(browser, lambda d: css(d, "#result_list"), "the failed renders")
    assert len(css(browser, "#result_list tbody tr")) == 2

    # The node's page and the service's page carry their own rates over the same range.
    browser.get(f"{base}/admin/nodes/node/node-t/change/")
    wait(browser, lambda d: css(d, "#accs-node-rates tr[data-rate='render']"), "node-t's rates per service")
    assert "last 1 h" in css(browser, "#accs-node-rates h2")[0].text
    browser.get(f"{base}/admin/workflows/service/{render.pk}/change/")
    wait(browser, lambda d: css(d, "#accs-service-rates tr[data-rate='node-t']"), "render's rates per node")
    assert "2 failed" in css(browser, "#accs-service-rate-total")[0].text

    shoot(browser, shots, "rates_dashboard", url=f"{base}/admin/dashboard/?refresh=300", ready="#accs-rates")
    shoot(browser, shots, "rates_service", url=f"{base}/admin/workflows/service/{render.pk}/change/",
          ready="#accs-service-rates")


def test_one_time_range_for_dashboard_and_lists_bulk_over_the_filter_and_export(browser, live_server, shots):
    from selenium.webdriver.support.ui import Select

    from jobs import api
    from jobs.models import Job, JobStatus
    from tests.ops_helpers import _service

    tenants = two_tenants()
    pipeline_scene(tenants)
    batch = _service("batch")
    for _ in range(120):
        api.start_service("batch", tenant=tenants.acme)
    base = logged_in(browser, live_server)

    # The dashboard on the default range, then 15 minutes: the charts keep their bars, each 25 s wide.
    browser.get(f"{base}/admin/dashboard/?refresh=300")
    wait(browser, lambda d: css(d, "#accs-range a[data-range='15m']"), "the range picker")
    click(browser, "#accs-range a[data-range='15m']")
    wait(browser, lambda d: "Last 15 min" in css(d, "#accs-charts h2")[0].text, "the charts over 15 min")
    assert "one bar per 25 s" in css(browser, "#accs-charts h2")[0].text
    chart = css(browser, "svg.accs-chart")[0]
    assert len(chart.find_elements("css selector", "rect")) == 1 + 36, "the ground and 36 bars"

    # The jobs list opens on the same range (the session kept it), with service and workflow filters.
    browser.get(f"{base}/admin/jobs/job/")
    wait(browser, lambda d: css(d, "#changelist-filter #accs-range"), "the list's range")
    assert css(browser, "#changelist-filter #accs-range")[0].get_attribute("data-range") == "15m"
    assert css(browser, "#changelist-filter [data-filter-title=workflow]"), "a workflow filter"
    browser.get(f"{base}/admin/jobs/job/?service__id__exact={batch.pk}&status__exact=waiting")
    wait(browser, lambda d: css(d, "#result_list"), "the batch jobs")
    assert len(css(browser, "#result_list tbody tr")) == 100, "a page of 100 of the 120"
    export = css(browser, "a[data-export=csv]")[0].get_attribute("href")
    assert f"service__id__exact={batch.pk}" in export and "/export.csv" in export
    shoot(browser, shots, "jobs_list_range", url=browser.current_url, ready="#changelist-filter #accs-range")

    # Cancel every job the filter matches, not just the page: the count first, then the batches.
    click(browser, "#action-toggle")
    wait(browser, lambda d: css(d, ".actions .question a, .actions a.select-across"), "'Select all' link")
    click(browser, ".actions .question a, .actions a.select-across")
    Select(css(browser, "select[name=action]")[0]).select_by_value("cancel_jobs")
    click(browser, "button[name=index], .actions button[type=submit]")
    wait(browser, lambda d: css(d, "#accs-confirm-count"), "the confirmation with the count")
    assert css(browser, "#accs-confirm-count")[0].get_attribute("data-count") == "120"
    full_page_screenshot(browser, shots / "bulk_filter_confirm_light.png")
    click(browser, "#accs-confirm")
    wait(browser, lambda d: css(d, ".messagelist"), "the outcome")
    assert "120 changed" in css(browser, ".messagelist")[0].text
    assert Job.objects.filter(service=batch, status=JobStatus.CANCELED).count() == 120

    # A custom range: from and to in the site's zone; the dashboard says which.
    browser.get(f"{base}/admin/dashboard/?refresh=300")
    wait(browser, lambda d: css(d, "#accs-range-from"), "the custom range form")
    browser.execute_script("document.getElementById('accs-range-from').value = '2026-01-01T00:00';"
                           "document.getElementById('accs-range-to').value = '2026-01-02T00:00';")
    click(browser, "#accs-range-apply")
    wait(browser, lambda d: css(d, "#accs-range[data-range=custom]"), "the custom range")
    assert "2026-01-01 00:00 – 2026-01-02 00:00" in css(browser, "#accs-range-chosen")[0].text
    assert "one bar per 40 min" in css(browser, "#accs-charts h2")[0].text
