"""Headless Chromium for the operators' screens: helpers for the ``browser`` fixture (tests/conftest.py).

Debian's ``chromium-headless-shell`` (or, without it, ``chromium`` in its headless mode) and
``chromium-driver`` (``make test`` installs them when it can), driven by selenium against a live
server on 127.0.0.1. Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the README's
screenshots; by default they go to the test's temporary directory.

The ``browser`` and ``shots`` fixtures live in tests/conftest.py; test modules import only these helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ops_helpers import PASSWORD

CHROMIUM = "/usr/bin/chromium"
# Chromium's headless shell: the same engine (Blink, V8, the compositor) without the full browser's
# window and profile layers, made for automated tests. The 39 browser tests' Chromium took 70 CPU-s in
# it against 145 in the full browser's headless mode, and it starts in 0.4 s instead of about 1 s.
HEADLESS_SHELL = "/usr/lib/chromium/chromium-headless-shell"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 15  # seconds: the longest any page may take to show what a step waits for
WINDOW = (1440, 1000)


def chromium_binary() -> str | None:
    """The Chromium the browser tests drive: the headless shell where it is installed, else the full
    browser; None when neither is."""
    return next((path for path in (HEADLESS_SHELL, CHROMIUM) if Path(path).exists()), None)


def start_chromium(profile: Path):
    """Start headless Chromium (:func:`chromium_binary`) with its profile in ``profile``, no background
    network, at 1440 × 1000."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_binary() or CHROMIUM
    if options.binary_location == HEADLESS_SHELL:
        options.set_capability("browserName", "chrome-headless-shell")  # what chromedriver drives it as
    else:
        options.add_argument("--headless=new")
    for arg in ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT * 2)
    return driver


def reset(driver, *, origins: list[str]) -> bool:
    """Put a used browser back as a fresh one is; False when it cannot be (then it is replaced).

    Closes every window but one and any open dialog; leaves the page (its self-refreshing sections
    stop); clears cookies, the cache and the stored data (localStorage, sessionStorage, IndexedDB...) of
    ``origins`` and of every page still open (a live server keeps its port from test to test); undoes
    the emulated media, the device metrics and the download folder a test may have set; and sizes the
    window back to 1440 × 1000.
    """
    from selenium.common.exceptions import WebDriverException

    try:
        seen = set(origins)
        handles = driver.window_handles
        for handle in handles:
            driver.switch_to.window(handle)
            try:
                driver.switch_to.alert.dismiss()
            except WebDriverException:
                pass
            seen.add(driver.execute_script("return location.origin"))
            if handle != handles[0]:
                driver.close()
        driver.switch_to.window(handles[0])
        driver.get("about:blank")
        for origin in seen:
            if origin and origin.startswith("http"):
                driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": origin.rstrip("/"),
                                                                      "storageTypes": "all"})
        driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
        driver.execute_cdp_cmd("Network.clearBrowserCache", {})
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "", "features": []})
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "default"})
        driver.set_window_size(*WINDOW)
        driver.set_page_load_timeout(WAIT * 2)
        return True
    except WebDriverException:
        return False


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


def read(driver, selector: str) -> list[dict]:
    """Return each element matching ``selector`` as read in one script: its attributes, its text and its
    top (``y``). One snapshot of the page, so a self-refreshing section replacing the elements between two
    reads cannot leave a stale reference (as reading them one by one through the driver can)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => Object.assign("
        "Object.fromEntries(Array.from(e.attributes).map(a => [a.name, a.value])),"
        " {text: e.innerText, y: e.getBoundingClientRect().top + window.scrollY}))", selector)


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
