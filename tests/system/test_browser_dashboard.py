"""The dashboard's "Why isn't it moving?" panel in a real browser: headless Chromium against a live
server. The warning for a service nobody serves shows at the top, and goes away by itself (the page
refreshes from data.json, no reload) once an agent registers its node online serving that service.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the README's dashboard screenshot.
"""

from __future__ import annotations

import pytest

from nodes.api import register_node
from tests.browser import css, full_page_screenshot, log_in, read, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WARNING = 'li[data-reason="no_agent"][data-service="notify"]'


def test_no_live_agent_warning_goes_away_by_itself_when_a_node_serving_it_comes_online(browser, live_server, shots):
    pipeline_scene(two_tenants())  # four 'notify' tasks queued, no node serves 'notify'
    make_user("root", superuser=True)
    base = live_server.url
    log_in(browser, base, "root")

    browser.get(f"{base}/admin/dashboard/?refresh=1")
    wait(browser, lambda d: css(d, WARNING), "the no-live-agent warning for 'notify'")
    # (Each read is one snapshot: the page re-renders its sections every few seconds.)
    warning = read(browser, WARNING)[0]
    assert warning["data-count"] == "4"
    assert "4 tasks queued for 'notify' and no live agent serves it" in warning["text"]
    panel, cards = read(browser, "#accs-stuck")[0], read(browser, "#accs-cards")[0]
    assert panel["y"] < cards["y"], "the warning sits above the cards"
    presences = {r["data-node"]: r["data-presence"] for r in read(browser, "tr[data-node]")}
    assert presences == {"edge-2": "online", "gpu-3": "online", "node-t": "online"}
    full_page_screenshot(browser, shots / "dashboard_stuck.png")

    # A marker that a reload would wipe: the warning must go by the page's own refresh.
    browser.execute_script("window.accsNoReload = true")
    refreshed = int(read(browser, "#accs-dashboard")[0].get("data-refreshed") or 0)
    register_node("notify-1", labels={}, services=["notify"], agent_id="h:notify-1:1")
    wait(browser, lambda d: not css(d, WARNING), "the warning to disappear after notify-1 came online")
    assert browser.execute_script("return window.accsNoReload === true"), "the page was not reloaded"
    assert int(read(browser, "#accs-dashboard")[0].get("data-refreshed") or 0) > refreshed
    row = read(browser, 'tr[data-node="notify-1"]')
    assert row and row[0]["data-presence"] == "online" and "notify" in row[0]["text"]
