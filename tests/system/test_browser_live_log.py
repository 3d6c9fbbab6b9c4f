"""A running attempt's log in a real browser (headless Chromium against a live server): its lines stream
in as the agent writes them, without a reload, until the attempt ends; a text artifact opens inline,
escaped, its first part when it is big.

Set ``ACCS_SCREENSHOT_DIR=docs/screenshots`` to refresh ``attempt_log_live.png``.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from events.artifacts import record_artifact
from events.timeline import EventRow, write_events
from jobs import api, transitions
from jobs.models import Attempt
from ops.jobpage import PREVIEW_MAX_BYTES
from tests.browser import click, css, full_page_screenshot, log_in, wait
from tests.engine_helpers import claim_for, run_ok
from tests.ops_helpers import make_user, two_tenants

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LINES = "return Array.from(document.querySelectorAll('#accs-log-lines td.accs-log-message')).map(td => td.textContent)"


def log_lines(job, task_id, attempt: int, *lines: tuple[str, str]) -> None:
    """Write log lines as the agent does: ``log`` events of the task's attempt on the timeline."""
    write_events([EventRow(type="log", message=text, job_id=job.pk, task_id=task_id, attempt=attempt,
                           source="agent:test", level=level) for level, text in lines])


def test_a_running_attempts_log_streams_on_its_page_until_it_ends(browser, live_server, shots, make_service):
    tenants = two_tenants()
    svc = make_service("encode")
    job = api.start_service("encode", tenant=tenants.acme)
    [held] = claim_for(svc)
    transitions.mark_running([(held.id, held.attempt, 42)], agent_id="agent-t", source="agent:test")
    attempt = Attempt.objects.get(task_id=held.id, attempt_no=held.attempt)
    log_lines(job, held.id, held.attempt, ("info", "frame 1/3"))
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")

    browser.get(f"{live_server.url}{reverse('ops:attempt_log', args=[job.pk, attempt.pk])}?refresh=1")
    wait(browser, lambda d: css(d, "#accs-log-live"), "the running attempt's live note")
    assert browser.execute_script(LINES) == ["frame 1/3"]
    browser.execute_script("window.accsNoReload = true")

    log_lines(job, held.id, held.attempt, ("warn", "ERROR: disk almost full"), ("info", "frame <2>/3"))
    wait(browser, lambda d: d.execute_script(LINES)[-1:] == ["frame <2>/3"], "the new lines, without a reload")
    assert browser.execute_script(LINES) == ["frame 1/3", "ERROR: disk almost full", "frame <2>/3"]
    assert css(browser, '#accs-log-lines tr[data-level="warn"]'), "the warning stands out"
    full_page_screenshot(browser, shots / "attempt_log_live.png", max_height=900)

    run_ok([held])
    wait(browser, lambda d: d.find_element("id", "accs-log-lines").get_attribute("data-active") == "0",
         "the refresh stopping once the attempt ended")
    assert browser.execute_script("return window.accsNoReload") is True, "updated in place, never reloaded"


def test_a_big_text_artifact_opens_inline_escaped_its_first_part(browser, live_server, make_service, s3):
    tenants = two_tenants()
    svc = make_service("encode")
    job = api.start_service("encode", tenant=tenants.acme)
    [held] = claim_for(svc)
    run_ok([held])
    head = "<script>window.injected = true</script> line 1\n"
    body = (head + "x" * 99 + "\n") * 1 + ("y" * 99 + "\n") * (PREVIEW_MAX_BYTES // 100 + 200)
    record_artifact(job_id=job.pk, task_id=held.id, attempt=held.attempt, kind="output", name="render.log",
                    data=body.encode(), content_type="text/plain")
    make_user("root", superuser=True)
    log_in(browser, live_server.url, "root")

    browser.get(f"{live_server.url}{reverse('admin:jobs_job_change', args=[job.pk])}")
    wait(browser, lambda d: css(d, "a.accs-preview-link"), "the artifact's view link")
    click(browser, "a.accs-preview-link")
    wait(browser, lambda d: css(d, "#accs-preview"), "the inline preview")
    shown = css(browser, "#accs-preview")[0].text
    assert shown.startswith("<script>window.injected = true</script> line 1"), shown[:100]
    assert browser.execute_script("return window.injected === undefined"), "shown as text, never run"
    assert len(browser.execute_script("return document.getElementById('accs-preview').textContent")) \
        == PREVIEW_MAX_BYTES
    assert "The first 512 KB of" in css(browser, "#accs-preview-part")[0].text
