"""The operators' fourth round in a real browser (headless Chromium against a live server): one theme that
reads in light and dark (the admin's toggle and the browser's preference), a node whose heartbeats stopped
named suspect within seconds with the services only it serves, every stuck line linked to its cause.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh the screenshots docs/operators.md links.
"""

from __future__ import annotations

import re

import pytest

from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.ops_helpers import make_user, pipeline_scene, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# WCAG contrast of an element's text (or an SVG shape's fill) against the first opaque background behind it.
CONTRAST_JS = """
const [el, prop] = arguments;
const parse = s => (s.match(/[\\d.]+/g) || []).map(Number);
const lum = c => { const a = c.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92
                                                      : Math.pow((v + 0.055) / 1.055, 2.4); });
                   return 0.2126 * a[0] + 0.7152 * a[1] + 0.0722 * a[2]; };
let ground = [255, 255, 255];
for (let n = el.parentElement; n; n = n.parentElement) {
  const c = parse(getComputedStyle(n).backgroundColor);
  if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) { ground = c; break; }
}
const ink = parse(getComputedStyle(el)[prop]);
const [hi, lo] = [lum(ink), lum(ground)].sort((a, b) => b - a);
return [(hi + 0.05) / (lo + 0.05), lum(ground)];
"""


def contrast(browser, element, prop: str = "color") -> tuple[float, float]:
    """Return (contrast ratio of the element's ``prop`` colour to its background, the background's luminance)."""
    ratio, ground = browser.execute_script(CONTRAST_JS, element, prop)
    return float(ratio), float(ground)


def luminance(browser, element, prop: str) -> float:
    """Return the brightness (0 black … 1 white) of an element's ``prop`` colour."""
    return float(browser.execute_script(
        "const c = (getComputedStyle(arguments[0])[arguments[1]].match(/[\\d.]+/g) || []).map(Number);"
        "return (0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]) / 255;", element, prop))


def logged_in(browser, live_server) -> str:
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")
    return live_server.url


def assert_readable(browser, *, theme: str) -> None:
    """The dashboard's stuck box, its charts and (on the job page) the DAG read in ``theme``."""
    lines = css(browser, "#accs-stuck li")
    assert lines, "a stuck line to read"
    for el in [*lines, css(browser, "#accs-stuck h2")[0]]:
        ratio, _ground = contrast(browser, el)
        assert ratio >= 4.5, f"{theme}: stuck text {el.text[:40]!r} has contrast {ratio:.1f} (< 4.5)"
    _ratio, ground = contrast(browser, lines[0])
    assert (ground < 0.2) == (theme == "dark"), f"{theme}: the stuck box's ground has luminance {ground:.2f}"
    chart = css(browser, "svg.accs-chart > rect:first-child")[0]
    ground = luminance(browser, chart, "fill")
    assert (ground < 0.3) == (theme == "dark"), f"{theme}: a chart's ground has brightness {ground:.2f}"


def test_stuck_box_charts_and_dag_read_in_light_and_dark(browser, live_server, shots):
    scene = pipeline_scene(two_tenants())  # 'notify' is stuck (no agent serves it), attempts for the charts
    base = logged_in(browser, live_server)

    for theme in ("light", "dark"):
        browser.execute_script(f"localStorage.setItem('theme', '{theme}')")  # the admin's theme toggle
        browser.get(f"{base}/admin/dashboard/?refresh=60")
        wait(browser, lambda d: css(d, "#accs-stuck li"), "the stuck panel")
        assert browser.execute_script("return document.documentElement.dataset.theme") == theme
        assert_readable(browser, theme=theme)
        if theme == "dark":
            full_page_screenshot(browser, shots / "dashboard_dark.png")

    # "auto" follows the browser: a dark preference darkens the job page's DAG and keeps its legend legible.
    browser.execute_script("localStorage.setItem('theme', 'auto')")
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    browser.get(f"{base}/admin/jobs/job/{scene.failed.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "svg.accs-dag"), "the DAG picture")
    wrap = css(browser, ".accs-dag-wrap")[0]
    assert luminance(browser, wrap, "backgroundColor") < 0.3, "the DAG's panel is dark"
    legend = [t for t in css(browser, "svg.accs-dag > text") if t.text]
    assert legend, "the DAG's legend"
    for text in legend:
        ratio, _ground = contrast(browser, text, "fill")
        assert ratio >= 4.5, f"legend {text.text!r} has contrast {ratio:.1f} on the dark panel"
    full_page_screenshot(browser, shots / "job_page_dark.png")

    browser.get(f"{base}/admin/dashboard/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-stuck li"), "the stuck panel")
    assert_readable(browser, theme="dark")
    browser.set_window_size(390, 844)
    full_page_screenshot(browser, shots / "dashboard_phone_dark.png")


def test_a_silent_node_is_suspect_in_seconds_and_the_stuck_line_names_and_links_it(browser, live_server):
    from datetime import timedelta

    from django.utils import timezone

    from jobs import api
    from nodes.api import stale_after_seconds
    from nodes.models import Node
    from tests.ops_helpers import _service

    tenants = two_tenants()
    _service("render")
    for _ in range(2):
        api.start_service("render", tenant=tenants.acme)
    assert stale_after_seconds() < 25 < 600, "suspect in seconds, long before ACC_NODE_LOST_AFTER_SEC"
    # The agent on render-1 was killed 25 s ago: still "online" (lost only after 10 min), but silent.
    Node.objects.create(name="render-1", services=["render"], awake_state="awake",
                        last_seen=timezone.now() - timedelta(seconds=25))
    Node.objects.create(name="other-1", services=["fetch"], awake_state="awake", last_seen=timezone.now())
    base = logged_in(browser, live_server)

    browser.get(f"{base}/admin/dashboard/?refresh=60")
    line = 'li[data-reason="suspect"][data-service="render"]'
    wait(browser, lambda d: css(d, line), "a stuck line for the suspect node")
    text = css(browser, line)[0].text
    # How long ago depends on how long the page took on a loaded machine: at least the 25 s written.
    seen = re.search(r"2 tasks of 'render' wait: the only node serving it, render-1, has not been seen for (\d+) s",
                     text)
    assert seen and int(seen.group(1)) >= 25, text
    row = css(browser, 'tr[data-node="render-1"]')[0]
    assert row.get_attribute("data-stale") == "1" and "suspect" in row.text, row.text
    assert css(browser, 'tr[data-node="other-1"]')[0].get_attribute("data-stale") == "0"

    links = {a.text: a.get_attribute("href") for a in css(browser, f"{line} .accs-stuck-links a")}
    assert set(links) == {"node render-1", "the tasks"}, links
    browser.get(links["the tasks"])
    wait(browser, lambda d: css(d, "#changelist"), "the tasks list")
    assert len(css(browser, "#result_list tbody tr")) == 2, "the link lists the tasks the line counts"
    browser.get(links["node render-1"])
    wait(browser, lambda d: css(d, "#content h2, #content h1"), "the node page")
    assert "/admin/nodes/node/render-1/change/" in browser.current_url


def test_a_governor_stuck_line_links_its_condition(browser, live_server):
    from jobs import api
    from nodes.api import register_node
    from tests.ops_helpers import _service

    _service("encode", block_during=["live_session"])
    api.start_service("encode", tenant=two_tenants().acme)
    register_node("enc-1", labels={}, services=["encode"], agent_id="h:enc-1:1")
    api.raise_condition("live_session", reason="studio A is live", by="alice")
    base = logged_in(browser, live_server)

    browser.get(f"{base}/admin/dashboard/?refresh=60")
    line = 'li[data-reason="governor"][data-service="encode"]'
    wait(browser, lambda d: css(d, line), "the governor's stuck line")
    links = {a.text: a.get_attribute("href") for a in css(browser, f"{line} .accs-stuck-links a")}
    assert set(links) == {"condition live_session", "the tasks"}, links
    browser.get(links["condition live_session"])
    wait(browser, lambda d: css(d, "#changelist"), "the conditions list")
    assert [r.text.split()[0] for r in css(browser, "#result_list tbody tr th, #result_list tbody tr td.field-name")
            if r.text][:1] == ["live_session"]


def test_the_creator_sees_why_not_to_approve_and_the_pending_list_shows_requester_and_params(browser, live_server,
                                                                                              shots):
    from jobs import api
    from tests.ops_helpers import _service

    tenants = two_tenants()
    alice = make_user("alice", tenants={tenants.acme: "admin"})
    make_user("bob", tenants={tenants.acme: "admin"})
    _service("deploy", requires_approval=True)
    job = api.start_service("deploy", tenant=tenants.acme, created_by=alice,
                            params={"release": "v7", "api_token": "s3cr3t-value"})
    base = live_server.url

    log_in(browser, base, "alice")
    browser.get(f"{base}/admin/jobs/job/{job.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-approve-barred"), "the four-eyes note for the job's creator")
    assert "You started this job: another approver must approve it" in css(browser, "#accs-approve-barred")[0].text
    assert not css(browser, "#accs-job-approve"), "no Approve button its creator could not use"
    assert css(browser, "#accs-job-reject"), "the creator may still reject (withdraw) it"

    browser.get(f"{base}/admin/jobs/job/?approval_state__exact=pending")
    wait(browser, lambda d: css(d, "#result_list"), "the pending-approval list")
    row = css(browser, "#result_list tbody tr")[0]
    assert row.find_element("css selector", "td.field-requested_by").text == "alice"
    params = row.find_element("css selector", "td.field-params_shown").text
    assert '"release": "v7"' in params and '"api_token": "***"' in params and "s3cr3t" not in browser.page_source
    full_page_screenshot(browser, shots / "pending_approval.png")

    browser.delete_all_cookies()
    log_in(browser, base, "bob")
    browser.get(f"{base}/admin/jobs/job/{job.pk}/change/?refresh=60")
    wait(browser, lambda d: css(d, "#accs-job-approve"), "the Approve button for another approver")
    assert not css(browser, "#accs-approve-barred")
    click(browser, "#accs-job-approve")
    wait(browser, lambda d: css(d, ".messagelist .success"), "the approval's message")
    job.refresh_from_db()
    assert job.approval_state == "approved" and job.approved_by == "bob"
