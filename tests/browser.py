"""Headless Chromium for the operators' screens: helpers for the ``browser`` fixture (tests/conftest.py).

Debian's ``chromium`` and ``chromium-driver`` (``make test`` installs them when it can), driven by
selenium against a live server on 127.0.0.1. Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh
the README's screenshots; by default they go to the test's temporary directory.

The ``browser`` and ``shots`` fixtures live in tests/conftest.py; test modules import only these helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ops_helpers import PASSWORD

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 15  # seconds: the longest any page may take to show what a step waits for


def wait(driver, condition, message: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(condition)
    except TimeoutException:
        pytest.fail(f"timed out after {WAIT}s waiting for: {message} (at {driver.current_url})")


def click(driver, selector: str) -> None:
    """Click the first element matching ``selector``, finding it again if a self-refreshing section
    replaced it between the find and the click (the dashboard and an active job's page re-render
    every few seconds)."""
    from selenium.common.exceptions import StaleElementReferenceException

    def clicked(d):
        found = css(d, selector)
        if not found:
            return False
        try:
            found[0].click()
        except StaleElementReferenceException:
            return False
        return True

    wait(driver, clicked, f"an element to click: {selector}")


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
