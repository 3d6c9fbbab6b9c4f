"""The operators' fourth round, through the test client: errors that name the task that failed (step, task,
node, host) and say an exit code once; ids that link to their pages; the approval list's requester."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from hypothesis import given, strategies as st

from jobs import api
from jobs.admin import failed_task_words
from jobs.models import Task
from ops.overview import attempt_end_words
from tests.ops_helpers import pipeline_scene, redrive_page, two_tenants

pytestmark = pytest.mark.django_db

EIGHT_HEX = re.compile(r"\b[0-9a-f]{8}\b")


def error_cells(html: str) -> list[str]:
    return re.findall(r'<td class="field-last_error">(.*?)</td>', html, re.S)


def test_a_failed_workflow_job_names_its_step_task_node_host_and_error_in_the_jobs_list(root, client):
    scene = pipeline_scene(two_tenants())
    page = client.get(reverse("admin:jobs_job_changelist"), {"status__exact": "error"}).content.decode()
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in error_cells(page)]
    titles = re.findall(r'class="accs-error-text" title="([^"]*)"', page)
    said = "step render · render@studio-4 on node-t, host studio-4: render crashed: exit 137 (out of memory)"
    assert said in titles, titles
    assert said in cells, cells
    assert not any("task(s) failed" in c for c in cells), "the job's error names the task, not a count"
    assert not any(EIGHT_HEX.search(c) for c in cells), "no id is named by its first 8 digits"
    assert scene.failed.error_message  # the stored message is unchanged; the list says it better


def test_the_jobs_list_reads_the_failed_tasks_in_its_own_query_not_per_row(root, client,
                                                                              django_assert_max_num_queries):
    tenants = two_tenants()
    pipeline_scene(tenants)
    url = reverse("admin:jobs_job_changelist")
    client.get(url)  # warm the caches (content types, sessions)
    with django_assert_max_num_queries(30) as few:
        client.get(url)
    from tests.ops_helpers import failed_service_job

    for i in range(6):
        failed_service_job(tenants.acme, key=f"flaky-{i}")
    with django_assert_max_num_queries(len(few.captured_queries)):
        page = client.get(url).content.decode()
    assert sum("flaky" in c or "exit 3: disk full" in c for c in error_cells(page)) >= 6


def test_the_dashboard_says_an_exit_code_once(root, client):
    from tests.engine_helpers import claim_for, run_fail
    from tests.ops_helpers import _service

    service = _service("resize", max_attempts=1)
    api.start_service("resize", tenant=two_tenants().acme)
    run_fail(claim_for(service), error="exit code 1: convert: no space left on device")
    data = client.get(reverse("ops:dashboard")).content.decode()
    assert "exit code 1" not in data, "the code is said by '(exit 1)' already"


@given(code=st.integers(min_value=0, max_value=255),
       rest=st.text(min_size=1, max_size=40).filter(lambda s: s == s.lstrip() and not s.startswith("exit")))
def test_attempt_end_words_say_the_exit_code_once(code, rest):
    said = attempt_end_words("failed", code, f"exit code {code}: {rest}")
    assert said == f"failed (exit {code}): {rest}"
    other = f"exit code {code + 1}: x"
    assert attempt_end_words("failed", code, other) == f"failed (exit {code}): {other}", "another code is kept"
    assert attempt_end_words("timeout", None, "took longer than 60 s") == "timeout: took longer than 60 s"


def test_failed_task_words_name_a_fanned_out_task_once_and_a_single_one_by_its_step():
    assert failed_task_words({"step": "fetch", "task": "fetch", "node": "n1", "host": None, "error": "boom"}) == \
        "step fetch on n1: boom"
    assert failed_task_words({"step": "render", "task": "render@s4", "node": "", "host": "s4", "error": ""}) == \
        "step render · render@s4 host s4: failed"


def test_events_attempts_and_artifacts_rows_link_their_job_task_and_node(root, client,
                                                                         django_assert_max_num_queries):
    scene = pipeline_scene(two_tenants())
    job_url = reverse("admin:jobs_job_change", args=[scene.failed.pk])
    task = scene.failed.tasks.get(task_key="render@studio-4")
    task_link = f'<a href="{reverse("admin:jobs_task_change", args=[task.pk])}">render@studio-4</a>'
    for name in ("event", "attempt"):
        app = "events" if name == "event" else "jobs"
        url = reverse(f"admin:{app}_{name}_changelist")
        client.get(url)
        with django_assert_max_num_queries(25):  # links read with the rows, not per row
            page = client.get(url, {"q": str(task.pk)}).content.decode()
        assert task_link in page, f"{name} rows link their task by its key"
        assert f'href="{job_url}"' in page, f"{name} rows link their job"
        assert re.search(r'<td class="field-job_link"><a href="[^"]+">[0-9a-f]{10}</a>', page), "by its short id"
    attempts = client.get(reverse("admin:jobs_attempt_changelist")).content.decode()
    assert f'href="{reverse("admin:nodes_node_change", args=["node-t"])}"' in attempts, "attempts link their node"


def test_a_redrive_returns_to_the_list_as_it_was_filtered(root, client):
    tenants = two_tenants()
    from tests.ops_helpers import failed_service_job

    failed_service_job(tenants.acme)
    service_id = Task.objects.get().service_id
    query = f"service__id__exact={service_id}&status__exact=error"
    url = reverse("admin:jobs_task_redrive") + "?" + query
    page = redrive_page(client, url, {"service": "flaky"})
    back = reverse("admin:jobs_task_changelist") + "?" + query
    assert f'href="{back.replace("&", "&amp;")}" class="button" id="accs-redrive-back"' in page


def test_recent_actions_and_history_say_retry_not_changed(root, client):
    from tests.ops_helpers import failed_service_job

    tenants = two_tenants()
    jobs = [failed_service_job(tenants.acme, key=f"flaky-{i}") for i in range(2)]
    client.post(reverse("admin:jobs_job_changelist"), {"action": "retry_jobs",
                                                       "_selected_action": [j.pk for j in jobs]})
    index = client.get(reverse("admin:index")).content.decode()
    said = re.findall(r'class="mini accs-action-said">([^<]*)<', index)
    assert len(said) == 2 and all(s.startswith("Retry: job back to waiting") for s in said), said
    assert "Changed:" not in index
    history = client.get(reverse("admin:jobs_job_history", args=[jobs[0].pk])).content.decode()
    assert "<td>Retry: job back to waiting; 1 task(s) reset</td>" in history
