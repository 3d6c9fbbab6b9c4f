"""The operator's job page and lists: live refresh from data.json, task progress / attempt / node /
elapsed time, the timeline's filters and millisecond times, artifact downloads and attempt logs
(both tenant-checked), and the jobs / tasks / events lists' columns and searches."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from accs_site.admin_kit import uuid_prefix_range
from events.artifacts import record_artifact, upload_attempt_log
from events.models import Artifact, Event
from jobs import api, transitions
from jobs.ids import short_id
from jobs.models import Attempt, Job, Task
from tests.engine_helpers import claim_for
from tests.ops_helpers import failed_service_job, make_user, pipeline_scene
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db


def job_url(job: Job) -> str:
    return reverse("admin:jobs_job_change", args=[job.pk])


def data_url(job: Job) -> str:
    return reverse("ops:job_data", args=[job.pk])


def db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT now()")
        return cur.fetchone()[0]


def statement_now():
    """The database's clock now: inside the test's transaction, ``now()`` stays at its start."""
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


def running_job(tenant, make_service, *, key: str = "encode", progress: float | None = None) -> tuple[Job, Task]:
    """Return a one-task job whose task an agent on node-t is running (optionally with progress)."""
    service = make_service(key, max_attempts=3)
    job = api.start_service(key, tenant=tenant)
    (claimed,) = claim_for(service)
    transitions.mark_running([(claimed.id, claimed.attempt, 4242)], agent_id="agent-t", source="agent:test")
    if progress is not None:
        assert transitions.report_progress([(claimed.id, claimed.attempt, progress)], source="agent:test") == 1
    return Job.objects.get(pk=job.pk), Task.objects.get(pk=claimed.id)


def task_row(body: str, task_key: str) -> str:
    match = re.search(rf'<tr [^>]*data-task-key="{re.escape(task_key)}".*?</tr>', body, re.S)
    assert match, f"no row for task {task_key}"
    return match.group(0)


# --------------------------------------------------------------------------------------------
# Live refresh
# --------------------------------------------------------------------------------------------

def test_active_job_page_refreshes_from_data_json_with_the_live_sections(client, root, tenants, make_service):
    job, task = running_job(tenants.acme, make_service, progress=0.4)
    page = client.get(job_url(job)).content.decode()
    assert f'data-live-url="{data_url(job)}"' in page and 'data-active="1"' in page and 'ops/live_refresh.js' in page

    transitions.report_progress([(task.pk, task.attempt, 0.7)], source="agent:test")
    payload = client.get(data_url(job)).json()
    assert payload["active"] is True and payload["status"] == "running"
    row = task_row(payload["html"], task.task_key)
    assert 'data-progress="0.700"' in row and 'style="width:70.0%"' in row, "the new progress, not the page's"
    assert 'id="accs-tasks"' in payload["html"] and 'id="accs-timeline"' in payload["html"]
    # Buttons in the swapped-in sections return to the job page, not to data.json.
    assert f'name="next" value="{job_url(job)}"' in payload["html"]


def test_final_job_page_does_not_refresh_and_its_data_json_says_so(client, root, tenants):
    job = failed_service_job(tenants.acme)
    page = client.get(job_url(job)).content.decode()
    assert 'data-active="0"' in page
    assert 'live_refresh.js' not in page and f'data-live-url="{data_url(job)}"' not in page
    assert "this page no longer refreshes" in page
    payload = client.get(data_url(job)).json()
    assert payload["active"] is False and payload["status"] == "error"


def test_data_json_is_404_for_another_tenants_job_and_for_a_missing_job(client, tenants, make_service):
    theirs, _ = running_job(tenants.globex, make_service, key="theirs")
    mine, _ = running_job(tenants.acme, make_service, key="mine")
    client.force_login(make_user("alice", tenants={tenants.acme: "admin"}))
    assert client.get(data_url(theirs)).status_code == 404
    assert client.get(reverse("ops:job_data", args=["00000000-0000-0000-0000-000000000000"])).status_code == 404
    assert client.get(data_url(mine)).status_code == 200


def test_data_json_needs_a_staff_login(client, tenants, make_service):
    job, _ = running_job(tenants.acme, make_service)
    response = client.get(data_url(job))
    assert response.status_code == 302 and "/login/" in response["Location"]


# --------------------------------------------------------------------------------------------
# Task rows
# --------------------------------------------------------------------------------------------

def test_task_row_shows_progress_attempt_node_and_elapsed_time(client, root, tenants, make_service):
    job, task = running_job(tenants.acme, make_service, progress=0.25)
    # Started 42 seconds ago by the database's clock. The page reads that clock when its statement
    # runs (Django's Now() is the statement's time), which on a busy machine can be a while later:
    # the elapsed time shown lies between 42 s and 42 s plus the time the page took.
    before = statement_now()
    Task.objects.filter(pk=task.pk).update(started_at=before - timedelta(seconds=42))
    row = task_row(client.get(job_url(job)).content.decode(), task.task_key)
    took = (statement_now() - before).total_seconds()
    assert 'data-progress="0.250"' in row and "25 %" in row
    assert re.search(r'<td class="num accs-attempt-no" title="attempt 1 of at most 3 in all [^"]*">'
                     r'attempt 1 \(first of 3\)</td>', row)
    assert '<td class="accs-node">node-t</td>' in row
    elapsed = re.search(r'class="num accs-elapsed"[^>]*>([^<]+)<', row).group(1)
    shown = re.fullmatch(r"(\d+) s", elapsed)
    assert shown and 42 <= int(shown.group(1)) <= 42 + math.ceil(took), (elapsed, took)


def test_finished_task_shows_its_duration_and_a_full_bar(client, root, tenants):
    job = pipeline_scene(tenants).failed
    fetch = Task.objects.get(job=job, task_key="fetch")
    Task.objects.filter(pk=fetch.pk).update(started_at=fetch.finished_at - timedelta(minutes=7))
    body = client.get(job_url(job)).content.decode()
    row = task_row(body, "fetch")
    assert re.search(r'class="num accs-elapsed"[^>]*>7 min<', row), row
    assert 'data-progress="1.000"' in row, "a done task is drawn full"
    failed = task_row(body, Task.objects.get(job=job, status="error").task_key)
    assert re.search(r'<td class="num accs-attempt-no" title="attempt 2 of at most 2 in all [^"]*">'
                     r'attempt 2 \(retry 1 of 1\)</td>', failed)


# --------------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------------

def test_timeline_type_filter_keeps_that_type_and_keeps_the_level_filter(client, root, tenants):
    job = failed_service_job(tenants.acme)
    Event.objects.create(job_id=job.pk, type="app_event", level="warn", source="app", message="custom thing")
    Event.objects.create(job_id=job.pk, type="app_event", level="info", source="app", message="quiet thing")
    everything = client.get(job_url(job)).content.decode()
    types = set(re.findall(r'class="accs-event" data-level="\w+" data-type="(\w+)"', everything))
    assert {"status", "app_event"} <= types

    body = client.get(job_url(job) + "?type=app_event").content.decode()
    assert set(re.findall(r'class="accs-event" data-level="\w+" data-type="(\w+)"', body)) == {"app_event"}
    assert body.count('class="accs-event"') == 2
    # The level links keep the type filter, and both together narrow further.
    warn_link = re.search(r'<a href="([^"]+)" data-level="warn"', body).group(1).replace("&amp;", "&")
    assert "type=app_event" in warn_link and "level=warn" in warn_link
    both = client.get(warn_link.split("#")[0]).content.decode()
    assert re.findall(r'class="accs-event" data-level="(\w+)" data-type="(\w+)"', both) == [("warn", "app_event")]
    # An unknown type is ignored rather than hiding everything.
    assert client.get(job_url(job) + "?type=nonsense").content.decode().count('class="accs-event"') == \
        everything.count('class="accs-event"')


def test_timeline_and_events_list_show_milliseconds(client, root, tenants):
    job = failed_service_job(tenants.acme)
    ts = db_now().replace(hour=11, minute=4, second=39, microsecond=123456)
    Event.objects.create(job_id=job.pk, ts=ts, type="app_event", source="app", message="stamped")
    body = client.get(job_url(job)).content.decode()
    assert re.search(r'class="accs-time"[^>]*><time [^>]*>\d{4}-\d\d-\d\d 11:04:39\.123 UTC<', body), \
        "the timeline shows milliseconds, the date and the zone"
    assert re.findall(r'class="accs-time"[^>]*><time [^>]*>(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC)<', body), \
        "every event time has ms"
    events = client.get(reverse("admin:events_event_changelist") + f"?q={job.pk}").content.decode()
    assert f"{ts:%Y-%m-%d} 11:04:39.123" in events


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------

def test_artifacts_are_listed_and_download_for_the_tenant_but_404_for_another(client, tenants, s3):
    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    data = b"host,frames\nstudio-1,240\n"
    artifact = record_artifact(job_id=job.pk, task_id=task.pk, attempt=1, kind="output", name="reports/frames.csv",
                               data=data)
    other_job = failed_service_job(tenants.globex, key="globex-sync")
    other = record_artifact(job_id=other_job.pk, task_id=Task.objects.get(job=other_job).pk, attempt=1,
                            kind="output", name="secret.txt", data=b"not yours")
    url = reverse("ops:job_artifact", args=[job.pk, artifact.pk])

    client.force_login(make_user("alice", tenants={tenants.acme: "viewer"}))
    body = client.get(job_url(job)).content.decode()
    row = re.search(r'<tr class="accs-artifact".*?</tr>', body, re.S).group(0)
    assert 'data-name="reports/frames.csv"' in row and ">output<" in row and "25\xa0bytes" in row
    assert artifact.checksum in row and f'href="{url}"' in row
    response = client.get(url)
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == data
    assert response["Content-Type"] == "text/csv"
    assert response["Content-Disposition"] == 'attachment; filename="frames.csv"'
    # Another job's artifact through this job's URL does not exist.
    assert client.get(reverse("ops:job_artifact", args=[job.pk, other.pk])).status_code == 404

    client.force_login(make_user("bob", tenants={tenants.globex: "admin"}))
    assert client.get(url).status_code == 404, "another tenant's admin: the same answer as a missing artifact"
    assert client.get(reverse("ops:job_artifact", args=[job.pk, 999_999])).status_code == 404

    client.force_login(make_user("root", superuser=True))
    assert b"".join(client.get(url).streaming_content) == data


def test_download_of_a_changed_object_does_not_complete(client, root, tenants, s3):
    job = failed_service_job(tenants.acme)
    artifact = record_artifact(job_id=job.pk, task_id=Task.objects.get(job=job).pk, attempt=1, kind="output",
                               name="out.bin", data=b"original bytes")
    s3.put(artifact.key, b"tampered bytes")
    response = client.get(reverse("ops:job_artifact", args=[job.pk, artifact.pk]))
    assert response.status_code == 200  # the headers go out before the last chunk is checked
    with pytest.raises(Exception, match="checksum mismatch"):
        b"".join(response.streaming_content)


# --------------------------------------------------------------------------------------------
# Attempt logs
# --------------------------------------------------------------------------------------------

def log_records(n: int) -> list[dict]:
    levels = ("info", "info", "warn", "error")
    return [{"ts": f"2025-03-01T11:04:{i % 60:02d}.{i % 1000:03d}000+00:00", "level": levels[i % 4],
             "message": f"line {i}"} for i in range(n)]


def test_attempt_log_page_shows_the_tail_with_level_filter(client, tenants, s3):
    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    attempt = Attempt.objects.get(task=task, attempt_no=1)
    upload_attempt_log(job_id=job.pk, task_id=task.pk, task_key=task.task_key, attempt=1, records=log_records(700))
    url = reverse("ops:attempt_log", args=[job.pk, attempt.pk])
    client.force_login(make_user("alice", tenants={tenants.acme: "viewer"}))

    body = client.get(url).content.decode()
    messages = re.findall(r'class="accs-log-message">([^<]*)<', body)
    assert len(messages) == 500 and messages[0] == "line 200" and messages[-1] == "line 699", "the last 500 lines"
    assert re.search(r'class="accs-time"[^>]*><time [^>]*>\d{4}-\d\d-\d\d 11:04:39\.699 UTC<', body), \
        "times to the millisecond"
    assert f'href="{job_url(job)}"' in body, "a link back to the job page"

    tail = client.get(url + "?tail=10").content.decode()
    assert re.findall(r'class="accs-log-message">([^<]*)<', tail) == [f"line {i}" for i in range(690, 700)]

    warn = client.get(url + "?level=warn&tail=1000").content.decode()
    assert set(re.findall(r'<tr class="accs-log-line" data-level="(\w+)"', warn)) == {"warn", "error"}
    assert len(re.findall(r'class="accs-log-message"', warn)) == 350
    errors = client.get(url + "?level=error&tail=3").content.decode()
    assert re.findall(r'class="accs-log-message">([^<]*)<', errors) == ["line 691", "line 695", "line 699"]

    # The job page links each attempt to its log.
    assert f'href="{url}"' in client.get(job_url(job)).content.decode()

    client.force_login(make_user("bob", tenants={tenants.globex: "admin"}))
    assert client.get(url).status_code == 404


def test_attempt_log_page_says_when_there_is_no_log_or_no_storage(client, root, tenants):
    job = failed_service_job(tenants.acme)
    task = Task.objects.get(job=job)
    attempt = Attempt.objects.get(task=task, attempt_no=1)
    url = reverse("ops:attempt_log", args=[job.pk, attempt.pk])
    body = client.get(url).content.decode()
    assert "This attempt has no log artifact" in body and 'id="accs-log"' not in body

    # A log was recorded by a server with storage; this one has none configured.
    Artifact.objects.create(job=job, task=task, attempt=1, kind="log", bucket="b",
                            key=f"logs/{job.pk}/{task.task_key}/attempt-1.jsonl", size_bytes=10,
                            content_type="application/x-ndjson", checksum="sha256:00")
    body = client.get(url).content.decode()
    assert "Artifact storage is not configured" in body


# --------------------------------------------------------------------------------------------
# Lists and searches
# --------------------------------------------------------------------------------------------

def test_uuid_prefix_becomes_a_key_range():
    lo, hi = uuid_prefix_range("1B2c-3d")
    assert str(lo) == "1b2c3d00-0000-0000-0000-000000000000"
    assert str(hi) == "1b2c3dff-ffff-ffff-ffff-ffffffffffff"
    assert uuid_prefix_range("1b2") is None, "too short to be useful"
    assert uuid_prefix_range("render") is None, "not hex"


def test_jobs_list_shows_target_age_and_duration(client, root, tenants, make_service):
    job = pipeline_scene(tenants).failed
    Job.objects.filter(pk=job.pk).update(started_at=job.finished_at - timedelta(minutes=12))
    running, _ = running_job(tenants.acme, make_service, key="encode")
    body = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    rows = {m.group(1): m.group(0) for m in re.finditer(r'<tr>.*?>([0-9a-f]{10})</a>.*?</tr>', body, re.S)}
    failed_row, running_row = rows[short_id(job.pk)], rows[short_id(running.pk)]
    assert "publish v1" in failed_row and "service encode" in running_row
    assert re.search(r'class="field-duration">12 min<', failed_row), failed_row
    assert re.search(r'class="field-duration">[\d.]+ (ms|s) so far<', running_row), running_row
    assert re.search(r'class="field-age"><span class="accs-when-ago"><time class="accs-when" datetime="[^"]+">'
                     r'[^<]+ UTC</time> <small>· [\d.]+ (ms|s) ago</small></span>', running_row), running_row


def test_tasks_list_shows_the_jobs_workflow(client, root, tenants):
    job = pipeline_scene(tenants).failed
    body = client.get(reverse("admin:jobs_task_changelist") + f"?q={job.pk}").content.decode()
    assert body.count('<td class="field-workflow">publish</td>') == 7


def search(client, model: str, term: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        body = client.get(reverse(f"admin:jobs_{model}_changelist"), {"q": term}).content.decode()
    return body, [q["sql"] for q in queries.captured_queries]


def test_jobs_search_by_id_prefix_external_id_workflow_and_service(client, root, tenants, make_service):
    scene = pipeline_scene(tenants)
    make_service("ingest")
    create_workflow(name="nightly", steps=[{"key": "ingest", "service": "ingest", "depends_on": []}])
    nightly = api.start_workflow("nightly", tenant=tenants.acme, external_id="ticket-4711")
    ingest = api.start_service("ingest", tenant=tenants.globex)
    shown = lambda body: set(re.findall(r'>([0-9a-f]{10})</a></th>', body))  # noqa: E731

    prefix = str(nightly.pk)[:6]
    body, sqls = search(client, "job", prefix)
    assert short_id(nightly.pk) in shown(body)
    listing = [s for s in sqls if 'FROM "accs_job"' in s and "ORDER BY" in s][-1]
    assert '"accs_job"."id" >= ' in listing and '"accs_job"."id" <= ' in listing
    assert "LIKE" not in listing.upper() and "::text" not in listing

    assert shown(search(client, "job", "ticket-4711")[0]) == {short_id(nightly.pk)}
    assert shown(search(client, "job", "ticket-47")[0]) == set(), "external ids match exactly"
    assert shown(search(client, "job", "nightly")[0]) == {short_id(nightly.pk)}
    assert shown(search(client, "job", "ingest")[0]) == {short_id(ingest.pk)}
    publish = shown(search(client, "job", "publish")[0])
    assert publish == {short_id(scene.failed.pk)}


def test_id_prefix_range_is_served_by_the_primary_key_index(tenants, make_service):
    """The list's own query shape (newest first, one page) on a table with statistics."""
    make_service("ingest")
    ids = api.start_many([api.JobSpec(service="ingest", tenant=tenants.acme.slug) for _ in range(3000)])
    # The first 12 hex digits of an id are its millisecond: 14 digits pick the first job's millisecond.
    lo, hi = uuid_prefix_range(str(ids[0])[:16])
    with connection.cursor() as cur:
        cur.execute("ANALYZE accs_job")
    plan = Job.objects.filter(pk__gte=lo, pk__lte=hi).order_by("-created_at")[:100].explain()
    assert "accs_job_pkey" in plan, plan


def test_tasks_search_by_task_key_service_and_id_prefixes(client, root, tenants):
    scene = pipeline_scene(tenants)
    renders = Task.objects.filter(job=scene.failed, step_key="render")
    one = renders.first()
    task_keys = lambda body: set(re.findall(r'<th class="field-task_key"><a [^>]*>([^<]+)</a>', body))  # noqa: E731

    assert task_keys(search(client, "task", one.task_key)[0]) == {one.task_key}
    assert task_keys(search(client, "task", "render")[0]) == {t.task_key for t in renders}, "by service key"
    by_job, sqls = search(client, "task", str(scene.failed.pk)[:7])
    assert task_keys(by_job) >= {"fetch", "package", "notify"}, "a job id prefix finds the job's tasks"
    listing = [s for s in sqls if 'FROM "accs_task"' in s and "ORDER BY" in s][-1]
    assert '"accs_task"."job_id" >= ' in listing and "LIKE" not in listing.upper()
    by_task = task_keys(search(client, "task", str(one.pk)[:8])[0])
    assert one.task_key in by_task
    assert task_keys(search(client, "task", "zzzz")[0]) == set()
