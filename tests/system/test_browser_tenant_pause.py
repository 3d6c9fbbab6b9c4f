"""Pausing a tenant in a real browser (headless Chromium against a live server): the tenants list's action asks
a reason on the same page the service pause uses, the list and the dashboard show who paused it and why, and
the dashboard's Resume button resumes it.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

import pytest
from selenium.webdriver.support.ui import Select

from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_tenant_is_paused_from_its_list_with_a_reason_and_resumed_from_the_dashboard(browser, live_server, shots,
                                                                                          make_service):
    from jobs import api
    from workflows import governor

    tenants = two_tenants()
    make_service("resize")
    api.start_service("resize", tenant=tenants.acme)
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    base = live_server.url

    browser.get(f"{base}/admin/tenants/tenant/")
    wait(browser, lambda d: css(d, "#result_list"), "the tenants list")
    row = [r for r in css(browser, "#result_list tbody tr") if "acme" in r.text][0]
    row.find_element("css selector", "input.action-select").click()
    Select(css(browser, "select[name=action]")[0]).select_by_value("pause_tenants")
    click(browser, "button[name=index]")
    wait(browser, lambda d: css(d, "input[name=reason]"), "the reason page")
    assert "Pause acme" in css(browser, "#content-main")[0].text
    css(browser, "input[name=reason]")[0].send_keys("invoice dispute")
    css(browser, "input[name=minutes]")[0].send_keys("90")
    full_page_screenshot(browser, shots / "tenant_pause_reason.png")
    click(browser, "#content-main input[type=submit]")
    wait(browser, lambda d: css(d, ".messagelist"), "the action's message")
    assert "tenant acme paused until" in css(browser, ".messagelist")[0].text
    pause_cell = [r for r in css(browser, "#result_list tbody tr") if "acme" in r.text][0]
    assert "paused by root" in pause_cell.text and "invoice dispute" in pause_cell.text, pause_cell.text
    assert governor.active_conditions() == {governor.tenant_pause_name(tenants.acme.pk)}

    browser.get(f"{base}/admin/dashboard/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-paused-tenants"), "the paused tenants on the dashboard")
    panel = css(browser, "#accs-paused-tenants")[0].text
    assert "acme" in panel and "paused by root" in panel and "invoice dispute" in panel, panel
    stuck = css(browser, "#accs-stuck")[0].text if css(browser, "#accs-stuck") else ""
    assert "of tenant acme, which is paused" in stuck, stuck
    full_page_screenshot(browser, shots / "tenant_pause_dashboard.png")

    click(browser, '[data-resume-tenant="acme"]')
    wait(browser, lambda d: css(d, ".messagelist"), "the resume's message")
    assert "tenant acme resumed" in css(browser, ".messagelist")[0].text
    assert governor.active_conditions() == set()
    browser.get(f"{base}/admin/dashboard/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-cards"), "the dashboard")
    assert not css(browser, "#accs-paused-tenants"), "resumed: no longer listed"
