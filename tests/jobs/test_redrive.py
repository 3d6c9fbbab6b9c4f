"""Bulk redrive of dead letters and failed jobs: the dry-run count, batches in their own
transactions, no task retried twice (also under racing redrives), tenant isolation in the HTTP
API and the admin, the management command."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from datetime import datetime
from io import StringIO
from uuid import UUID

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections
from django.urls import reverse

from events.models import Event
from jobs import api, redrive, transitions
from jobs.claim import NodeLimits
from jobs.models import Job, Task
from jobs.redrive import RedriveFilter
from tests.accs_site.test_cli import assert_one_line_refusal, run_command
from tests.api_helpers import client_for, user_with_token
from tests.daemons import wait_for
from tests.engine_helpers import claim_for, run_fail, run_ok
from tests.ops_helpers import Tenants, make_user, redrive_page, redrive_summary_of, two_tenants
from workflows.api import save_service

pytestmark = pytest.mark.django_db


def age(ids: list[UUID], *, hours: int) -> datetime:
    """Move the tasks' (and jobs') failure ``hours`` into the past; return a time between then and now."""
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET finished_at = finished_at - make_interval(hours => %s)"
                    " WHERE id = ANY(%s::uuid[])", [hours, [str(i) for i in ids]])
        cur.execute("UPDATE accs_job SET finished_at = finished_at - make_interval(hours => %s)"
                    " WHERE id IN (SELECT job_id FROM accs_task WHERE id = ANY(%s::uuid[]))",
                    [hours, [str(i) for i in ids]])
        cur.execute("SELECT now() - make_interval(hours => %s) / 2", [hours])
        return cur.fetchone()[0]


def dead_letters(service, tenant, *, n: int, node: str, error: str) -> list[UUID]:
    """Start ``n`` one-task jobs and let ``node`` fail each task for good (max_attempts 1)."""
    for _ in range(n):
        api.start_service(service.key, tenant=tenant)
    claimed = claim_for(service, n, limits=NodeLimits(name=node, slot_cap=20, cpu_budget=100, per_service={}))
    assert len(claimed) == n
    run_fail(claimed, error=error)
    return [t.id for t in claimed]


@dataclass
class Scene:
    tenants: Tenants
    early: list[UUID]  # resize · acme · node-a · "Disk full on /srv", finished before ``cut``
    resize_globex: list[UUID]  # resize · globex · node-b · timeout
    upload_acme: list[UUID]  # upload · acme · node-b · "DISK FULL"
    upload_globex: list[UUID]  # upload · globex · node-a · connection refused
    cut: datetime
    done: UUID

    @property
    def all(self) -> list[UUID]:
        return self.early + self.resize_globex + self.upload_acme + self.upload_globex


@pytest.fixture
def scene(db) -> Scene:
    """Ten dead letters across two services, two tenants and two nodes, plus a task that succeeded."""
    tenants = two_tenants()
    resize = save_service(key="resize", executor="python", executor_config={"callable": "tests.callables:noop"},
                          params_schema={"type": "object"}, max_attempts=1)
    upload = save_service(key="upload", executor="python", executor_config={"callable": "tests.callables:noop"},
                          params_schema={"type": "object"}, max_attempts=1)
    early = dead_letters(resize, tenants.acme, n=4, node="node-a", error="exit 3: Disk full on /srv")
    cut = age(early, hours=2)  # the early ones failed two hours ago
    resize_globex = dead_letters(resize, tenants.globex, n=3, node="node-b", error="timeout after 600 s")
    upload_acme = dead_letters(upload, tenants.acme, n=2, node="node-b", error="DISK FULL while uploading")
    upload_globex = dead_letters(upload, tenants.globex, n=1, node="node-a", error="connection refused")
    api.start_service("upload", tenant=tenants.acme)
    done = claim_for(upload, 1)
    run_ok(done)
    return Scene(tenants, early, resize_globex, upload_acme, upload_globex, cut, done[0].id)


def statuses(ids) -> set[str]:
    return set(Task.objects.filter(pk__in=ids).values_list("status", flat=True))


def redrive_events(ids=None):
    events = Event.objects.filter(type="status", data__has_key="redrive", task_id__isnull=False)
    return events.filter(task_id__in=ids) if ids is not None else events


# --------------------------------------------------------------------------------------------
# The module: dry run, redrive, batches, no double retry
# --------------------------------------------------------------------------------------------

def test_dry_run_counts_each_filter_and_writes_nothing(scene):
    events, updated = Event.objects.count(), sorted(Task.objects.values_list("updated_at", flat=True))
    acme = str(scene.tenants.acme.id)
    cases = {
        RedriveFilter(): 10,
        RedriveFilter(service="resize"): 7,
        RedriveFilter(tenant="acme"): 6,
        RedriveFilter(tenant=acme): 6,
        RedriveFilter(error_contains="disk full"): 6,
        RedriveFilter(error_contains="100%_"): 0,  # LIKE wildcards are plain text here
        RedriveFilter(node="node-b"): 5,
        RedriveFilter(service="resize", tenant="acme", error_contains="DISK"): 4,
        RedriveFilter(since=scene.cut): 6,
        RedriveFilter(until=scene.cut): 4,
        RedriveFilter(node="node-a", since=scene.cut): 1,
    }
    assert {flt: redrive.count(flt) for flt in cases} == cases
    assert redrive.count(RedriveFilter(), tenant_ids={scene.tenants.globex.id}) == 4
    assert api.redrive(RedriveFilter(service="upload"), dry_run=True).matched == 3
    assert Event.objects.count() == events
    assert sorted(Task.objects.values_list("updated_at", flat=True)) == updated
    assert statuses(scene.all) == {"error"}


def test_redrive_requeues_exactly_the_matching_dead_letters_with_attempts_reset_and_events(scene):
    flt = RedriveFilter(error_contains="disk full", node="node-b")
    result = api.redrive(flt, by="ops")
    assert (result.matched, result.redriven, result.skipped) == (2, 2, 0)
    for task in Task.objects.filter(pk__in=scene.upload_acme).select_related("service", "job"):
        assert task.status == "queued" and task.error_message == "" and task.finished_at is None
        assert task.max_attempts - task.attempt == task.service.max_attempts, "the retry budget is renewed"
        assert task.job.status == "waiting"
    events = list(redrive_events())
    assert sorted(e.task_id for e in events) == sorted(scene.upload_acme)
    for event in events:
        assert event.source == "user:ops" and "bulk redrive by ops" in event.message
        assert event.data["redrive"] == {"by": "ops", "filter": {"target": "tasks", "error_contains": "disk full",
                                                                  "node": "node-b"}}
    job_events = Event.objects.filter(type="status", task_id__isnull=True, data__has_key="redrive")
    assert job_events.count() == 2 and all("bulk redrive by ops" in e.message for e in job_events)
    assert statuses(scene.early + scene.resize_globex + scene.upload_globex) == {"error"}
    assert statuses([scene.done]) == {"done"}
    assert redrive.count(flt) == 0


def test_batch_of_three_redrives_ten_matches_in_four_transactions(scene, transactional_db):
    seen = []
    result = redrive.redrive(RedriveFilter(), by="ops", batch=3, on_batch=lambda t: seen.append(t.matched))
    assert (result.matched, result.redriven, result.batches) == (10, 10, 4)
    assert seen == [3, 6, 9, 10]
    # Each batch stamps its rows with its own transaction's time (PostgreSQL's now()).
    stamps = Task.objects.filter(pk__in=scene.all).values_list("updated_at", flat=True)
    assert len(set(stamps)) == 4
    assert statuses(scene.all) == {"queued"}


def test_limit_stops_after_that_many(scene):
    result = redrive.redrive(RedriveFilter(), by="ops", batch=3, limit=5)
    assert (result.matched, result.redriven, result.batches) == (5, 5, 2)
    assert Task.objects.filter(pk__in=scene.all, status="queued").count() == 5


def test_a_task_retried_by_someone_else_after_the_count_is_not_retried_again(scene):
    flt = RedriveFilter(tenant="acme")
    assert redrive.count(flt) == 6
    other = scene.early[0]
    assert transitions.retry_task(other, by="bob").changed
    result = redrive.redrive(flt, by="ops")
    assert (result.matched, result.redriven) == (5, 5)
    assert not redrive_events([other]).exists()
    assert Event.objects.filter(task_id=other, data__retry=True).count() == 1, "retried once, by bob"


def test_a_failure_seen_before_a_retry_and_a_new_failure_is_left_alone(scene):
    """The verbs fence a bulk retry by the finished_at it saw: a task retried (and failed again) in
    between is another failure, not the one selected."""
    age(scene.upload_globex, hours=1)  # it failed a while ago (this test runs in one transaction)
    task = Task.objects.get(pk=scene.upload_globex[0])
    seen = {task.pk: task.finished_at}
    assert transitions.retry_task(task.pk, by="bob").changed
    run_fail(claim_for(task.service, 1, limits=NodeLimits(name="node-a", slot_cap=20, cpu_budget=100,
                                                            per_service={})))
    assert statuses([task.pk]) == {"error"}
    outcome = transitions.retry_tasks(seen, by="ops", statuses={"error"})[task.pk]
    assert not outcome.changed and "finished again" in outcome.message
    assert statuses([task.pk]) == {"error"}


def test_two_racing_redrives_never_retry_a_task_twice(scene, transactional_db, db_url):
    import psycopg

    results: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(redrive.redrive(RedriveFilter(), by=threading.current_thread().name, batch=4))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    def waiting_on_locks() -> int:
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'")
            return cur.fetchone()[0]

    # A third connection holds every failed job, so both redrives select the same first batch and
    # then queue behind the same locks: the race is certain, not left to timing.
    threads = [threading.Thread(target=run, name=f"redriver-{i}") for i in (1, 2)]
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT id FROM accs_job WHERE status = 'error' ORDER BY id FOR UPDATE")
        for t in threads:
            t.start()
        wait_for(lambda: waiting_on_locks() >= 2, timeout=30, message="both redrives wait on the held jobs")
        holder.rollback()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sum(r.redriven for r in results) == 10
    assert sum(r.skipped for r in results) >= 1, "the loser of the first batch found its tasks taken"
    per_task = [e.task_id for e in redrive_events()]
    assert sorted(per_task) == sorted(scene.all), "each task redriven exactly once"
    assert statuses(scene.all) == {"queued"}


def test_failed_jobs_are_redriven_and_canceled_ones_only_when_included(scene):
    canceled = api.start_service("resize", tenant=scene.tenants.acme)
    assert api.cancel(canceled.id, by="ops").changed
    assert redrive.count(RedriveFilter(jobs=True)) == 10
    assert redrive.count(RedriveFilter(jobs=True, include=frozenset({"canceled"}))) == 11
    assert redrive.count(RedriveFilter(jobs=True, error_contains="timeout")) == 3, "matched by a failed task's error"
    assert redrive.count(RedriveFilter(jobs=True, service="upload", node="node-a")) == 1
    result = redrive.redrive(RedriveFilter(jobs=True, tenant="acme", include=frozenset({"canceled"})), by="ops",
                             batch=2)
    assert (result.matched, result.redriven, result.batches) == (7, 7, 4)
    acme_jobs = Job.objects.filter(tenant=scene.tenants.acme).exclude(tasks__status="done")
    assert set(acme_jobs.values_list("status", flat=True)) == {"waiting"}
    assert set(Job.objects.filter(tenant=scene.tenants.globex).values_list("status", flat=True)) == {"error"}
    assert Event.objects.filter(job_id=canceled.id, data__redrive__filter__include=["canceled"]).exists()


@pytest.mark.parametrize(("flt", "where"), [
    (RedriveFilter(service="nope"), "service: no service 'nope'"),
    (RedriveFilter(tenant="nope"), "tenant: no tenant 'nope'"),
    (RedriveFilter(since=datetime(2025, 2, 1).astimezone(), until=datetime(2025, 1, 1).astimezone()),
     "until: must be later than since"),
    (RedriveFilter(include=frozenset({"canceled"})), "include: partial and canceled apply to jobs only"),
])
def test_a_bad_filter_names_its_field_and_writes_nothing(scene, flt, where):
    from workflows.validation import DefinitionError

    with pytest.raises(DefinitionError, match=where):
        redrive.redrive(flt, by="ops")
    assert statuses(scene.all) == {"error"}


# --------------------------------------------------------------------------------------------
# HTTP API
# --------------------------------------------------------------------------------------------

URL = "/api/v1/jobs/redrive"


def test_api_dry_run_by_default_then_redrive_within_the_callers_tenant_only(scene):
    _, token = user_with_token("alice", tenants={scene.tenants.acme: "admin"})
    http = client_for(token)
    dry = http.post(URL, {}, content_type="application/json")
    assert dry.status_code == 200, dry.content
    assert dry.json() | {"filter": None} == {"target": "tasks", "dry_run": True, "matched": 6, "redriven": 0,
                                             "skipped": 0, "batches": 0, "filter": None}
    assert statuses(scene.all) == {"error"}
    theirs = http.post(URL, {"tenant": "globex", "dry_run": False}, content_type="application/json")
    assert theirs.status_code == 403 and "tenant 'globex'" in theirs.json()["detail"]
    unknown = http.post(URL, {"tenant": "nope", "dry_run": False}, content_type="application/json")
    assert unknown.status_code == 403, "no such tenant and not yours answer alike"
    done = http.post(URL, {"dry_run": False, "batch": 4}, content_type="application/json")
    assert done.json()["redriven"] == 6 and done.json()["batches"] == 2
    assert statuses(scene.early + scene.upload_acme) == {"queued"}
    assert statuses(scene.resize_globex + scene.upload_globex) == {"error"}
    assert {e.source for e in redrive_events()} == {"user:alice"}


def test_api_errors_name_the_bad_field(scene):
    _, token = user_with_token("root-api", superuser=True)
    http = client_for(token)
    cases = [
        ({"since": "yesterday"}, "since"),
        ({"service": "nope"}, "service: no service 'nope'"),
        ({"tenant": "nope"}, "tenant: no tenant 'nope'"),
        ({"since": "2025-02-01T00:00:00Z", "until": "2025-01-01T00:00:00Z"}, "until: must be later than since"),
        ({"target": "tasks", "include": ["canceled"]}, "include"),
        ({"batch": 0}, "batch"),
        ({"colour": "red"}, "colour"),
    ]
    for body, needle in cases:
        response = http.post(URL, {**body, "dry_run": False}, content_type="application/json")
        assert response.status_code == 422, (body, response.content)
        assert needle in response.json()["detail"], (body, response.json())
    assert statuses(scene.all) == {"error"}


def test_api_viewer_cannot_redrive(scene):
    _, token = user_with_token("vic", tenants={scene.tenants.acme: "viewer"})
    response = client_for(token).post(URL, {"dry_run": False}, content_type="application/json")
    assert response.status_code == 403
    assert statuses(scene.all) == {"error"}


# --------------------------------------------------------------------------------------------
# Admin
# --------------------------------------------------------------------------------------------

def test_admin_redrive_shows_the_count_then_redrives_on_confirmation(client, scene):
    client.force_login(make_user("alice", tenants={scene.tenants.acme: "admin"}))
    upload = Task.objects.get(pk=scene.upload_acme[0]).service_id
    listing = client.get(reverse("admin:jobs_task_changelist") + f"?service__id__exact={upload}").content.decode()
    url = reverse("admin:jobs_task_redrive")
    assert f'href="{url}?service__id__exact={upload}"' in listing and "Redrive all matching…" in listing
    form = client.get(f"{url}?service__id__exact={upload}").content.decode()
    assert 'value="upload"' in form, "the list's filter fills the form"
    assert "globex" not in form, "only the operator's tenants are offered"
    preview = client.post(url, {"service": "upload", "preview": "1"}).content.decode()
    assert '<p id="accs-redrive-count"><b>2</b> dead-lettered task(s) match now.</p>' in preview
    assert 'name="confirm" value="Redrive 2"' in preview
    assert statuses(scene.upload_acme) == {"error"}, "the count writes nothing"
    said = redrive_summary_of(redrive_page(client, url, {"service": "upload"}))
    assert re.fullmatch(r"Redrive: 2 matched, 2 redriven, 0 skipped \(no longer applicable\) in 1 batch of up to 500, "
                        r"\d+\.\d s", said), said
    assert statuses(scene.upload_acme) == {"queued"} and statuses(scene.upload_globex) == {"error"}
    assert 'type="datetime-local"' in form and "YYYY-MM-DD HH:MM[:SS], UTC" in form, "the dates say their format"
    # What a datetime-local input sends (no zone, minutes or seconds) is read in the server's zone.
    for sent in (scene.cut.strftime("%Y-%m-%dT%H:%M"), scene.cut.strftime("%Y-%m-%dT%H:%M:%S")):
        dated = client.post(url, {"service": "upload", "until": sent, "preview": "1"}).content.decode()
        assert 'id="accs-redrive-count"' in dated and "errorlist" not in dated, sent
    bad = client.post(url, {"service": "nope", "preview": "1"}).content.decode()
    assert "no service &#x27;nope&#x27;" in bad


def test_admin_job_redrive_and_who_may_use_it(client, scene):
    client.force_login(make_user("vic", tenants={scene.tenants.acme: "viewer"}))
    assert "Redrive all matching" not in client.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert client.post(reverse("admin:jobs_job_redrive"), {"confirm": "1"}).status_code == 403
    client.force_login(make_user("root", superuser=True))
    url = reverse("admin:jobs_job_redrive")
    preview = client.post(url, {"tenant": str(scene.tenants.globex.id), "preview": "1"}).content.decode()
    assert "<b>4</b> failed job(s) match now." in preview and 'name="include"' in preview
    said = redrive_summary_of(redrive_page(client, url, {"tenant": str(scene.tenants.globex.id)}))
    assert re.fullmatch(r"Redrive: 4 matched, 4 redriven, 0 skipped \(no longer applicable\) in 1 batch of up to 500, "
                        r"\d+\.\d s", said), said
    assert set(Job.objects.filter(tenant=scene.tenants.globex).values_list("status", flat=True)) == {"waiting"}


# --------------------------------------------------------------------------------------------
# Management command
# --------------------------------------------------------------------------------------------

def test_command_prints_the_count_then_progress_per_batch(scene):
    out = StringIO()
    call_command("accs_redrive", "--service", "resize", "--dry-run", stdout=out)
    assert out.getvalue() == "7 dead-lettered task(s) match\n"
    assert statuses(scene.all) == {"error"}
    out = StringIO()
    call_command("accs_redrive", "--service", "resize", "--since", scene.cut.isoformat(), "--batch", "2",
                 "--by", "carol", stdout=out)
    assert out.getvalue().splitlines() == [
        "3 dead-lettered task(s) match",
        "batch 1: 2 redriven, 0 skipped (2 of 3)",
        "batch 2: 3 redriven, 0 skipped (3 of 3)",
        "redrove 3 dead-lettered task(s) in 2 batch(es); 0 skipped (no longer applicable)",
    ]
    assert statuses(scene.resize_globex) == {"queued"} and statuses(scene.early) == {"error"}
    assert {e.source for e in redrive_events()} == {"user:carol"}


@pytest.mark.parametrize(("argv", "needle"), [
    (("--service", "nope"), "--service: no service 'nope'"),
    (("--tenant", "nope"), "--tenant: no tenant 'nope'"),
    (("--include", "canceled"), "--include: partial and canceled apply to jobs only"),
    (("--since", "2025-02-01", "--until", "2025-01-01"), "--until: must be later than since"),
])
def test_command_refuses_unknown_names_with_exit_code_2(scene, argv, needle):
    with pytest.raises(CommandError) as raised:
        call_command("accs_redrive", *argv, stdout=StringIO())
    assert raised.value.returncode == 2 and needle in str(raised.value)
    assert statuses(scene.all) == {"error"}


@pytest.mark.parametrize(("argv", "needle"), [
    (("--since", "yesterday"), "--since: expected an ISO 8601 time"),
    (("--batch", "0"), "--batch: must be at least 1"),
    (("--include", "done"), "--include: invalid choice"),
])
def test_command_bad_option_is_one_line_and_exit_code_2(argv, needle):
    assert_one_line_refusal(run_command("accs_redrive", *argv), needle)


def test_redrive_of_a_canceled_job_with_a_task_still_stopping_is_refused_with_the_reason_until_it_stopped(db):
    """Redriven while its canceled task still runs, the job would be canceled again by that task's report."""
    from workflows.api import create_workflow
    from workflows.models import Service

    for key in ("stop-fast", "stop-slow"):
        save_service(key=key, executor="python", executor_config={"callable": "tests.callables:noop"},
                     params_schema={"type": "object"})
    create_workflow(name="stopping", steps=[{"key": "fast", "service": "stop-fast"},
                                            {"key": "slow", "service": "stop-slow"}])
    job = api.start_workflow("stopping")
    slow = claim_for(Service.objects.get(key="stop-slow"))
    transitions.mark_running([(t.id, t.attempt, 1) for t in slow], agent_id="agent-t", source="agent:test")
    assert transitions.cancel_job(job.id, by="op").changed
    job.refresh_from_db()
    assert job.status == "canceled"
    flt = RedriveFilter(jobs=True, include=frozenset({"canceled"}))

    result = redrive.redrive(flt, by="alice")
    assert (result.matched, result.redriven, result.skipped) == (1, 0, 1)
    assert result.reasons == {"job is still stopping: 1 task(s) told to stop by its cancel are still running; "
                              "retry it once they have stopped": 1}
    job.refresh_from_db()
    assert job.status == "canceled"
    assert Task.objects.get(id=slow[0].id).status == "running"

    transitions.report([transitions.Outcome(task_id=slow[0].id, attempt=slow[0].attempt, status="canceled")],
                       agent_id="agent-t", source="agent:test")
    result = redrive.redrive(flt, by="alice")
    assert (result.matched, result.redriven, result.skipped) == (1, 1, 0)
    job.refresh_from_db()
    assert job.status == "waiting"
    assert set(Task.objects.filter(job=job).values_list("status", flat=True)) == {"queued"}


def test_admin_redrive_reports_each_batch_as_it_commits_then_sums_up(client, scene, monkeypatch):
    from jobs import admin as jobs_admin

    monkeypatch.setattr(jobs_admin, "REDRIVE_BATCH", 3)
    client.force_login(make_user("root", superuser=True))
    page = redrive_page(client, reverse("admin:jobs_task_redrive"), {})
    lines = re.findall(r'<li class="accs-redrive-batch">batch (\d+): (\d+) taken in so far, (\d+) redriven', page)
    assert [(int(b), int(n)) for b, n, _r in lines] == [(1, 3), (2, 6), (3, 9), (4, 10)], lines
    assert page.index('id="accs-redrive-summary"') > page.index("batch 4:"), "the summary comes last"
    assert redrive_summary_of(page).startswith("Redrive: 10 matched, 10 redriven, 0 skipped")
    assert 'max="10"' in page, "the progress bar counts the matches"
    assert statuses(scene.all) == {"queued"}


def test_a_redrive_whose_browser_goes_away_stops_at_a_whole_batch_and_is_logged(transactional_db, client, scene,
                                                                               monkeypatch):
    from django.contrib.admin.models import LogEntry

    from jobs import admin as jobs_admin

    monkeypatch.setattr(jobs_admin, "REDRIVE_BATCH", 4)
    client.force_login(make_user("root", superuser=True))
    answer = client.post(reverse("admin:jobs_task_redrive"), {"confirm": "1"})
    stream = iter(answer)
    sent = b""
    while b"<li class=\"accs-redrive-batch\">" not in sent:
        sent += next(stream)
    answer.close()  # what the server does when the browser is gone: it stops reading and closes the page
    after = Task.objects.filter(pk__in=scene.all).values_list("status", flat=True)
    assert sorted(after).count("queued") == 4 and sorted(after).count("error") == 6, "one whole batch, no more"
    [entry] = LogEntry.objects.all()
    assert entry.change_message.startswith("Redrive: 4 matched, 4 redriven, 0 skipped"), entry.change_message
    rest = redrive_summary_of(redrive_page(client, reverse("admin:jobs_task_redrive"), {}))
    assert rest.startswith("Redrive: 6 matched, 6 redriven"), "a second redrive takes in the rest"
