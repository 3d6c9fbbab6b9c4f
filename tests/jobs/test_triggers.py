"""Triggers: payload templates, cron in IANA zones across DST, event firing with a dedupe
window, schedule firing that stays once-per-due-time with several builders."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone
from hypothesis import given, settings, strategies as st

from events.models import Event
from jobs import api, triggers
from jobs.models import Job, Task, Trigger
from jobs.triggers import Schedule, ScheduleError, TemplateError, fire_due_schedules, render, template_problems
from tenants.models import Tenant
from tests.daemons import wait_for
from workflows.api import create_workflow
from workflows.validation import DefinitionError

NY = "America/New_York"
BUD = "Europe/Budapest"


def z(text: str) -> datetime:
    """Parse an ISO time with offset (or Z) into an aware UTC datetime."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


# --------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------

def test_whole_placeholder_keeps_the_json_type_and_embedded_ones_become_text():
    context = {"event": {"provider_id": "p-1", "count": 3, "flags": {"a": True}, "items": ["x", "y"]}}
    template = {"provider_id": "{{event.provider_id}}", "n": "{{ event.count }}", "flags": "{{event.flags}}",
                "path": "/data/{{event.provider_id}}/{{event.count}}", "second": "{{event.items.1}}", "const": 7}
    assert render(template, context) == {"provider_id": "p-1", "n": 3, "flags": {"a": True},
                                         "path": "/data/p-1/3", "second": "y", "const": 7}


def test_missing_context_value_is_an_error_naming_the_field_and_the_placeholder():
    with pytest.raises(TemplateError) as info:
        render({"opts": {"path": "/x/{{event.folder_path}}"}}, {"event": {"provider_id": "p"}})
    assert info.value.where == "opts.path" and info.value.placeholder == "event.folder_path"
    assert "payload_template.opts.path: {{event.folder_path}} is missing" in str(info.value)


def test_template_syntax_problems_name_the_field():
    problems = template_problems({"a": "{{event.x", "b": "{{schedule.due_at}}", "c": "{{ bad name }}",
                                  "d": ["{{event}}"]}, trigger_type="event")
    text = [str(p) for p in problems]
    assert any(t.startswith("payload_template.a: unbalanced") for t in text), text
    assert any(t.startswith("payload_template.b:") and "unknown namespace 'schedule'" in t for t in text), text
    assert any(t.startswith("payload_template.c:") for t in text), text
    assert any(t.startswith("payload_template.d[0]:") and "namespace, not a value" in t for t in text), text
    assert template_problems({"due": "{{schedule.due_local}}"}, trigger_type="schedule") == []
    problems = template_problems({"x": "{{schedule.nope}}"}, trigger_type="schedule")
    assert [p.where for p in problems] == ["payload_template.x"]


# --------------------------------------------------------------------------------------------
# Cron and time zones
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "tz", "field"), [
    ("0 2 * *", NY, "cron_expr"), ("61 2 * * *", NY, "cron_expr"), ("0 0 * * * *", NY, "cron_expr"),
    ("0 0 30 2 *", NY, "cron_expr"), ("0 2 * * *", "Mars/Olympus", "timezone"), ("0 2 * * *", "", "timezone"),
    ("0 2 * * *", "../../etc/passwd", "timezone"),
])
def test_invalid_cron_or_timezone_is_refused_naming_the_field(expr, tz, field):
    with pytest.raises(ScheduleError) as info:
        Schedule.parse(expr, tz)
    assert info.value.field == field


def _dues(expr: str, tz: str, start: str, end: str) -> list[str]:
    return [d.isoformat().replace("+00:00", "Z") for d in Schedule.parse(expr, tz).due_times(z(start), z(end))]


def test_fixed_time_job_in_the_spring_gap_runs_once_shifted_by_the_gap():
    # 2026-03-08 02:30 does not exist in New York; the run is 03:30 EDT (07:30Z), once.
    assert _dues("30 2 * * *", NY, "2026-03-06T12:00-05:00", "2026-03-09T12:00-04:00") == [
        "2026-03-07T07:30:00Z", "2026-03-08T07:30:00Z", "2026-03-09T06:30:00Z"]
    # 2026-03-29 02:30 does not exist in Budapest; the run is 03:30 CEST (01:30Z), once.
    assert _dues("30 2 * * *", BUD, "2026-03-27T12:00+01:00", "2026-03-30T12:00+02:00") == [
        "2026-03-28T01:30:00Z", "2026-03-29T01:30:00Z", "2026-03-30T00:30:00Z"]


def test_fixed_time_job_in_the_repeated_autumn_hour_runs_once():
    assert _dues("30 1 * * *", NY, "2026-10-30T12:00-04:00", "2026-11-02T12:00-05:00") == [
        "2026-10-31T05:30:00Z", "2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]
    assert _dues("30 2 * * *", BUD, "2026-10-23T12:00+02:00", "2026-10-26T12:00+01:00") == [
        "2026-10-24T00:30:00Z", "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]


def test_wildcard_job_follows_real_time_through_both_changes():
    hourly_fall = _dues("0 * * * *", NY, "2026-11-01T00:00-04:00", "2026-11-02T00:00-05:00")
    assert len(hourly_fall) == 25, "the local day of the autumn change has 25 hours"
    assert hourly_fall[:3] == ["2026-11-01T05:00:00Z", "2026-11-01T06:00:00Z", "2026-11-01T07:00:00Z"]
    hourly_spring = _dues("0 * * * *", NY, "2026-03-08T00:00-05:00", "2026-03-09T00:00-04:00")
    assert len(hourly_spring) == 23, "the local day of the spring change has 23 hours"
    steps = {(z(b) - z(a)) for a, b in zip(hourly_spring, hourly_spring[1:], strict=False)}
    assert steps == {timedelta(hours=1)}
    half_hours = _dues("*/30 * * * *", BUD, "2026-10-24T23:45Z", "2026-10-25T02:00Z")
    assert half_hours == ["2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z",
                          "2026-10-25T01:30:00Z", "2026-10-25T02:00:00Z"], "02:00 and 02:30 run in CEST and CET"


def test_next_after_is_strictly_after_and_aliases_work():
    sched = Schedule.parse("@daily", BUD)
    midnight = z("2026-06-01T00:00+02:00")
    assert sched.next_after(midnight) == z("2026-06-02T00:00+02:00")
    assert sched.next_after(midnight - timedelta(microseconds=1)) == midnight


# --------------------------------------------------------------------------------------------
# Event triggers
# --------------------------------------------------------------------------------------------

@pytest.fixture
def tenant(db):
    return Tenant.objects.create(slug="acme", name="Acme", timezone=NY)


@pytest.fixture
def sync_service(make_service):
    return make_service("sync-dropbox", params_schema={
        "type": "object", "properties": {"provider_id": {"type": "string"}, "path_prefix": {"type": "string"}},
        "required": ["provider_id"], "additionalProperties": False})


def event_trigger(tenant, **fields):
    fields = {"label": "Resync on folder change", "trigger_type": "event", "event_name": "provider.folder.updated",
              "service": "sync-dropbox", "payload_template": {"provider_id": "{{event.provider_id}}",
                                                              "path_prefix": "{{event.folder_path}}"},
              "dedupe_window_seconds": 120, **fields}
    return triggers.create_trigger(tenant=tenant, **fields)


@pytest.mark.django_db
def test_event_starts_a_job_with_the_rendered_payload_and_is_on_the_timeline(tenant, sync_service):
    trig = event_trigger(tenant)
    result = api.emit_event("provider.folder.updated", {"provider_id": "p-1", "folder_path": "/in"}, tenant="acme",
                            correlation_id="req-9")
    [job] = result.jobs
    assert (job.source, job.tenant_id, job.correlation_id) == ("event", tenant.id, "req-9")
    assert job.source_ref.startswith(f"trigger:{trig.id}:")
    assert Task.objects.get(job=job).params == {"provider_id": "p-1", "path_prefix": "/in"}
    app = Event.objects.get(type="app_event")
    assert app.data["name"] == "provider.folder.updated" and app.data["jobs"] == [str(job.id)]
    assert Event.objects.filter(job_id=job.id, type="trigger").exists()
    assert api.emit_event("other.event", {}, tenant="acme").jobs == [], "only triggers naming the event fire"


@pytest.mark.django_db
def test_event_only_fires_triggers_of_its_own_tenant(tenant, sync_service):
    event_trigger(tenant)
    other = Tenant.objects.create(slug="other", name="Other")
    assert api.emit_event("provider.folder.updated", {"provider_id": "p", "folder_path": "/"}, tenant=other).jobs == []
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_missing_context_value_records_the_error_and_starts_no_job(tenant, sync_service):
    trig = event_trigger(tenant)
    result = api.emit_event("provider.folder.updated", {"provider_id": "p-1"}, tenant=tenant)
    assert result.jobs == [] and not Job.objects.exists()
    [(trigger_id, message)] = result.errors
    assert trigger_id == trig.id and "{{event.folder_path}} is missing" in message
    trig.refresh_from_db()
    assert "payload_template.path_prefix: {{event.folder_path}} is missing" in trig.last_error
    error = Event.objects.get(type="trigger", level="error")
    assert "did not start a job" in error.message and error.data["trigger_id"] == str(trig.id)
    # Once the context is complete the trigger fires and its error is cleared.
    api.emit_event("provider.folder.updated", {"provider_id": "p-1", "folder_path": "/x"}, tenant=tenant)
    trig.refresh_from_db()
    assert trig.last_error == "" and Job.objects.count() == 1


@pytest.mark.django_db
def test_params_failing_the_service_schema_start_no_job_but_other_triggers_fire(tenant, sync_service):
    bad = event_trigger(tenant, label="bad", payload_template={"provider_id": "{{event.count}}"})
    good = event_trigger(tenant, label="good", payload_template={"provider_id": "{{event.provider_id}}"})
    result = api.emit_event("provider.folder.updated", {"provider_id": "p", "count": 3}, tenant=tenant)
    assert [j.source_ref.split(":")[1] for j in result.jobs] == [str(good.id)]
    assert [t for t, _ in result.errors] == [bad.id] and "provider_id: 3 is not of type 'string'" in result.errors[0][1]


@pytest.mark.django_db
def test_same_payload_within_the_dedupe_window_starts_no_second_job(tenant, sync_service):
    event_trigger(tenant, dedupe_window_seconds=120)
    ctx = {"provider_id": "p-1", "folder_path": "/in"}
    first = api.emit_event("provider.folder.updated", ctx, tenant=tenant).jobs[0]
    again = api.emit_event("provider.folder.updated", ctx, tenant=tenant)
    assert again.jobs == [] and again.deduplicated[0][1] == first.id
    other = api.emit_event("provider.folder.updated", {**ctx, "folder_path": "/other"}, tenant=tenant)
    assert len(other.jobs) == 1, "a different rendered payload is a different firing"
    Job.objects.filter(pk=first.pk).update(created_at=timezone.now() - timedelta(seconds=121))
    assert len(api.emit_event("provider.folder.updated", ctx, tenant=tenant).jobs) == 1, "after the window it fires"


@pytest.mark.django_db
def test_zero_dedupe_window_fires_every_time(tenant, sync_service):
    event_trigger(tenant, dedupe_window_seconds=0)
    for _ in range(3):
        api.emit_event("provider.folder.updated", {"provider_id": "p", "folder_path": "/"}, tenant=tenant)
    assert Job.objects.count() == 3


@pytest.mark.django_db
def test_emit_event_in_a_rolled_back_transaction_leaves_no_job_task_or_event(tenant, sync_service):
    event_trigger(tenant)
    with pytest.raises(RuntimeError), transaction.atomic():
        result = api.emit_event("provider.folder.updated", {"provider_id": "p", "folder_path": "/"}, tenant=tenant)
        assert Task.objects.filter(job_id=result.jobs[0].id).count() == 1
        raise RuntimeError("caller rolls back")
    assert not Job.objects.exists() and not Task.objects.exists()
    assert not Event.objects.filter(type__in=["app_event", "trigger"]).exists()


@pytest.mark.django_db
def test_event_trigger_for_a_workflow_renders_step_params(tenant, make_service):
    make_service("svc-a", params_schema={"type": "object", "properties": {"x": {"type": "string"}}})
    make_service("svc-b")
    create_workflow(name="flow", steps=[{"key": "a", "service": "svc-a"}, {"key": "b", "service": "svc-b",
                                                                          "depends_on": ["a"]}])
    triggers.create_trigger(tenant=tenant, label="flow on x", trigger_type="event", event_name="x.happened",
                            workflow="flow", payload_template={"a": {"x": "{{event.value}}"}})
    [job] = api.emit_event("x.happened", {"value": "v"}, tenant=tenant).jobs
    assert job.workflow.name == "flow" and job.step_params == {"a": {"x": "v"}}
    with pytest.raises(DefinitionError, match="payload_template.zzz"):
        triggers.create_trigger(tenant=tenant, label="bad", trigger_type="event", event_name="x", workflow="flow",
                                payload_template={"zzz": {}})


@pytest.mark.django_db(transaction=True)
def test_concurrent_identical_events_start_one_job_within_the_window(tenant, sync_service):
    trig = event_trigger(tenant)
    ctx = {"provider_id": "p-1", "folder_path": "/in"}
    emitted, release = threading.Event(), threading.Event()
    results: dict[str, triggers.EmitResult] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                results["first"] = api.emit_event("provider.folder.updated", ctx, tenant=tenant)
                emitted.set()
                assert release.wait(30), "test never released the first emitter"
        finally:
            connection.close()

    def second() -> None:
        try:
            results["second"] = api.emit_event("provider.folder.updated", ctx, tenant=tenant)
        finally:
            connection.close()

    t1 = threading.Thread(target=first)
    t1.start()
    assert emitted.wait(30)
    t2 = threading.Thread(target=second)
    t2.start()

    def second_waits_for_the_first() -> bool:
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
            return cur.fetchone()[0] >= 1

    wait_for(second_waits_for_the_first, timeout=10, message="second emitter blocked on the dedupe lock")
    release.set()
    t1.join(30)
    t2.join(30)
    assert len(results["first"].jobs) == 1 and results["second"].jobs == []
    assert results["second"].deduplicated == [(trig.id, results["first"].jobs[0].id)]
    assert Job.objects.count() == 1


# --------------------------------------------------------------------------------------------
# Trigger validation on save
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize(("fields", "where"), [
    ({"cron_expr": "nope"}, "cron_expr"),
    ({"timezone": "Nowhere/City"}, "timezone"),
    ({"payload_template": {"p": "{{event.x}}"}}, "payload_template.p"),
    ({"payload_template": {"provider_id": 5}}, "payload_template (step 'sync-dropbox' params)"),
    ({"service": "ghost"}, "service"),
    ({"missed_run_policy": "sometimes"}, "missed_run_policy"),
    ({"event_name": "x"}, "event_name"),
])
def test_schedule_trigger_validation_names_the_field(tenant, sync_service, fields, where):
    base = {"label": "nightly", "trigger_type": "schedule", "cron_expr": "0 2 * * *", "timezone": NY,
            "service": "sync-dropbox", "payload_template": {"provider_id": "fixed"}}
    with pytest.raises(DefinitionError) as info:
        triggers.create_trigger(tenant=tenant, **{**base, **fields})
    assert where in [p.where for p in info.value.problems], info.value.problems
    assert not Trigger.objects.exists()


@pytest.mark.django_db
def test_schedule_trigger_defaults_to_the_tenant_time_zone_and_computes_next_run(tenant, sync_service):
    now = z("2026-06-01T12:00Z")
    trig = triggers.create_trigger(tenant=tenant, label="n", trigger_type="schedule", cron_expr="0 2 * * *",
                                   service="sync-dropbox", payload_template={"provider_id": "p"}, now=now)
    assert trig.timezone == NY and trig.next_run_at == z("2026-06-02T02:00-04:00")
    triggers.update_trigger(trig, timezone=BUD, now=now)
    assert Trigger.objects.get(pk=trig.pk).next_run_at == z("2026-06-02T02:00+02:00")


# --------------------------------------------------------------------------------------------
# Schedule firing
# --------------------------------------------------------------------------------------------

def schedule_trigger(tenant, *, cron: str, tz: str, now: datetime, **fields) -> Trigger:
    fields = {"label": f"{cron} {tz}", "trigger_type": "schedule", "cron_expr": cron, "timezone": tz,
              "service": "sync-dropbox",
              "payload_template": {"provider_id": "{{tenant.slug}}", "path_prefix": "{{schedule.due_local}}"},
              **fields}
    return triggers.create_trigger(tenant=tenant, now=now, **fields)


def dues_fired(trig: Trigger) -> list[str]:
    prefix = f"trigger:{trig.id}:"
    ids = Job.objects.filter(external_id__startswith=prefix).values_list("external_id", flat=True)
    return sorted(e[len(prefix):].replace("+00:00", "Z") for e in ids)


@pytest.mark.django_db
def test_schedule_fires_at_its_due_time_with_schedule_context(tenant, sync_service):
    start = z("2026-03-07T06:00Z")
    trig = schedule_trigger(tenant, cron="30 2 * * *", tz=NY, now=start)
    assert fire_due_schedules(now=z("2026-03-07T07:29Z")) == 0
    assert fire_due_schedules(now=z("2026-03-07T07:30Z")) == 1
    assert fire_due_schedules(now=z("2026-03-07T07:31Z")) == 0, "once per due time"
    job = Job.objects.get()
    assert (job.source, job.source_ref) == ("schedule", f"trigger:{trig.id}")
    assert Task.objects.get(job=job).params == {"provider_id": "acme", "path_prefix": "2026-03-07T02:30:00-05:00"}
    trig.refresh_from_db()
    assert trig.next_run_at == z("2026-03-08T07:30Z") and trig.last_fired_at == z("2026-03-07T07:30Z")


@pytest.mark.django_db
def test_missed_runs_fire_once_with_run_once_and_not_at_all_with_skip(tenant, sync_service):
    start = z("2026-05-01T00:00Z")
    once = schedule_trigger(tenant, cron="0 * * * *", tz=BUD, now=start, label="once", missed_run_policy="run_once")
    skip = schedule_trigger(tenant, cron="0 * * * *", tz=BUD, now=start, label="skip", missed_run_policy="skip")
    after_downtime = z("2026-05-03T10:20Z")  # two days and ten hours of hourly runs missed
    assert fire_due_schedules(now=after_downtime) == 1
    assert dues_fired(once) == ["2026-05-01T01:00:00Z"] and dues_fired(skip) == []
    job = Job.objects.get()
    assert "58 missed due times" in Event.objects.get(job_id=job.id, type="trigger").message
    assert "skipped 58 missed run(s)" in Event.objects.get(type="trigger", level="warn").message
    for trig in (once, skip):
        trig.refresh_from_db()
        assert trig.next_run_at == z("2026-05-03T11:00Z"), "the next due time after the downtime"
    assert fire_due_schedules(now=z("2026-05-03T11:00Z")) == 2, "back on time, both fire"


@pytest.mark.django_db
def test_skip_policy_skips_a_run_seen_more_than_five_minutes_late(tenant, sync_service):
    trig = schedule_trigger(tenant, cron="0 2 * * *", tz=BUD, now=z("2026-05-01T00:00Z"), missed_run_policy="skip")
    assert fire_due_schedules(now=z("2026-05-02T00:04Z")) == 1, "4 minutes late is on time"
    assert fire_due_schedules(now=z("2026-05-03T00:06Z")) == 0, "6 minutes late is missed"
    assert dues_fired(trig) == ["2026-05-02T00:00:00Z"]


@pytest.mark.django_db
def test_trigger_saved_without_next_run_is_scheduled_and_bad_cron_is_recorded(tenant, sync_service):
    # The admin form saves raw fields: no validation, no next_run_at.
    ok = Trigger.objects.create(tenant=tenant, label="admin", trigger_type="schedule", cron_expr="0 2 * * *",
                                timezone=BUD, service=sync_service, payload_template={"provider_id": "p"})
    bad = Trigger.objects.create(tenant=tenant, label="broken", trigger_type="schedule", cron_expr="0 25 * * *",
                                 timezone=BUD, service=sync_service, payload_template={})
    now = z("2026-05-01T12:00Z")
    assert fire_due_schedules(now=now) == 0
    ok.refresh_from_db()
    bad.refresh_from_db()
    assert ok.next_run_at == z("2026-05-02T02:00+02:00")
    assert bad.next_run_at is None and bad.last_error.startswith("cron_expr:")
    fire_due_schedules(now=now + timedelta(seconds=5))
    assert Event.objects.filter(type="trigger", level="error").count() == 1, "the same error is reported once"


@pytest.mark.django_db
def test_schedule_whose_payload_fails_records_the_error_and_moves_on(tenant, sync_service):
    trig = schedule_trigger(tenant, cron="0 * * * *", tz=BUD, now=z("2026-05-01T00:00Z"))
    sync_service.is_active = False
    sync_service.save()
    assert fire_due_schedules(now=z("2026-05-01T01:00Z")) == 0
    trig.refresh_from_db()
    assert "not active" in trig.last_error and trig.next_run_at == z("2026-05-01T02:00Z")
    assert not Job.objects.exists()


CASES = {
    "new-york-spring": ("30 2 * * *", NY, "2026-03-06T12:00Z", "2026-03-09T12:00Z",
                        ["2026-03-07T07:30:00Z", "2026-03-08T07:30:00Z", "2026-03-09T06:30:00Z"]),
    "new-york-autumn": ("30 1 * * *", NY, "2026-10-30T12:00Z", "2026-11-02T12:00Z",
                        ["2026-10-31T05:30:00Z", "2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]),
    "budapest-spring": ("30 2 * * *", BUD, "2026-03-27T12:00Z", "2026-03-30T12:00Z",
                        ["2026-03-28T01:30:00Z", "2026-03-29T01:30:00Z", "2026-03-30T00:30:00Z"]),
    "budapest-autumn": ("30 2 * * *", BUD, "2026-10-23T12:00Z", "2026-10-26T12:00Z",
                        ["2026-10-24T00:30:00Z", "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]),
    "new-york-hourly-autumn": ("0 * * * *", NY, "2026-11-01T03:50Z", "2026-11-01T09:00Z",
                               [f"2026-11-01T0{h}:00:00Z" for h in range(4, 10)]),
    "budapest-half-hourly-autumn": ("*/30 * * * *", BUD, "2026-10-24T23:50Z", "2026-10-25T02:10Z",
                                    ["2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z",
                                     "2026-10-25T01:30:00Z", "2026-10-25T02:00:00Z"]),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", list(CASES))
def test_three_builders_fire_each_due_time_once_across_dst(case, tenant, sync_service):
    cron, tz, start, end, expected = CASES[case]
    trig = schedule_trigger(tenant, cron=cron, tz=tz, now=z(start))
    ticks = []
    tick = z(start)
    while tick <= z(end):
        ticks.append(tick)
        tick += timedelta(minutes=10)
    barrier = threading.Barrier(3)
    started: list[int] = []
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            for now in ticks:
                barrier.wait(timeout=30)  # all three builders tick at the same moment
                started.append(fire_due_schedules(now=now))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)
            barrier.abort()
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert dues_fired(trig) == expected
    assert sum(started) == len(expected), "each due time was fired by exactly one builder"
    assert Event.objects.filter(type="trigger", data__trigger_id=str(trig.id)).count() == len(expected)
    locals_ = [datetime.fromisoformat(e.replace("Z", "+00:00")).astimezone(ZoneInfo(tz)) for e in expected]
    assert len({d.strftime("%Y-%m-%d %H:%M %Z") for d in locals_}) == len(expected)


@pytest.mark.django_db
def test_a_schema_error_never_quotes_a_secret_into_the_triggers_stored_error(tenant, make_service):
    """jsonschema's messages repr the failing value; a trigger stores its error for every viewer."""
    make_service("push", params_schema={"type": "object", "properties": {
        "api_token": {"type": "integer"}, "auth": {"type": "object", "properties": {"password": {"pattern": "^x"}}},
        "count": {"type": "integer"}}})
    trig = triggers.create_trigger(tenant=tenant, label="push on event", trigger_type="event", event_name="e",
                                   service="push", payload_template={"api_token": "{{event.t}}",
                                                                     "auth": "{{event.auth}}", "count": "{{event.n}}"})
    result = api.emit_event("e", {"t": "tok-hunter2-value", "auth": {"password": "pw-hunter2-value"}, "n": "many"},
                            tenant=tenant)
    assert result.jobs == []
    trig.refresh_from_db()
    for text in (trig.last_error, result.errors[0][1], Event.objects.get(type="trigger", level="error").message):
        assert "hunter2" not in text, text
        assert "api_token" in text and "auth" in text, "the error still names the failing fields"
        assert "'many' is not of type 'integer'" in text, "a value that is not secret is still quoted"


@given(secret=st.text(min_size=1, max_size=40), key=st.sampled_from(["password", "api_key", "db_secret", "token"]))
@settings(max_examples=60, deadline=None)
def test_schema_errors_hide_any_value_under_a_secret_name(secret, key):
    from workflows.validation import schema_errors
    for schema, instance in (({"properties": {key: {"type": "integer"}}}, {key: secret}),
                             ({"properties": {"outer": {"type": "string"}}}, {"outer": {key: secret}}),
                             ({"properties": {key: {"type": "integer"}}}, {key: [secret]})):
        [error] = schema_errors(schema, instance)
        assert repr(secret) not in error and "hidden" in error
