"""The operators' fourth round, its last items, in a real browser (headless Chromium against a live server):
Django's own date columns in the one time format, a few tab stops to the jobs list's first row, a redrive
that reports each batch as it commits, and agents' deploys on the system timeline.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

import pytest

from tests.browser import css, full_page_screenshot, log_in, wait
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
