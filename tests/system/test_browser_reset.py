"""The browser tests share one Chromium per worker: after each test it must look as a fresh one does.

A test that chose the dark theme, logged in, narrowed the window to a phone's or opened a second
window must leave nothing the next test on the same live server (whose port stays) could see.
"""

from __future__ import annotations

import pytest

from tests.browser import WINDOW, log_in, reset, start_chromium
from tests.ops_helpers import make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

STATE_JS = """
const entries = store => Object.keys(store).map(k => k + '=' + store.getItem(k));
return {stored: [...entries(localStorage), ...entries(sessionStorage)].sort(),
        cookies: document.cookie.split('; ').map(c => c.split('=')[0]).sort(),
        dark: matchMedia('(prefers-color-scheme: dark)').matches};
"""


def test_a_reset_browser_keeps_nothing_of_the_test_before(browser, live_server, tmp_path):
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    browser.execute_script("localStorage.setItem('theme', 'dark'); sessionStorage.setItem('k', 'v');"
                           "document.cookie = 'seen=1; path=/';")
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    browser.set_window_size(390, 844)
    used = browser.execute_script(STATE_JS)
    assert {"theme=dark", "k=v"} <= set(used["stored"]) and "seen" in used["cookies"] and used["dark"], used
    assert browser.get_window_size()["height"] == 844
    browser.switch_to.new_window("tab")
    browser.get(live_server.url + "/admin/login/")

    assert reset(browser, origins=[live_server.url])

    assert len(browser.window_handles) == 1
    browser.get(live_server.url + "/admin/")
    assert "/admin/login/" in browser.current_url, "the session cookie outlived the reset"
    after = browser.execute_script(STATE_JS)
    fresh_browser = start_chromium(tmp_path / "fresh")
    try:
        fresh_browser.get(live_server.url + "/admin/")
        fresh = fresh_browser.execute_script(STATE_JS)
    finally:
        fresh_browser.quit()
    assert after == fresh and not fresh["dark"] and "theme=dark" not in fresh["stored"], (after, fresh)
    assert (browser.get_window_size()["width"], browser.get_window_size()["height"]) == WINDOW
