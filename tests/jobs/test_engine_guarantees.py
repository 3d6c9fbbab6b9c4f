"""Engine guarantees that the state machine, admission and claim keep (issue: guarantees under faults).

Driven directly, without daemon processes, on a real PostgreSQL: job end states, interrupted
attempts, admission exactness, the cost of a report in a large fan-out, lock order under a storm
of verbs, PostgreSQL's clock, and the smaller claim rules.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.db.utils import OperationalError
from django.utils import timezone

from accs_site.conf import accs
from events.models import Event
from events.timeline import unfold
from jobs import api, transitions
from jobs.claim import claim_many
from jobs.models import Attempt, Job, JobStep, Task
from jobs.notify import notify, service_channel
from nodes.models import Host, HostBlock, Node
from tenants.models import Tenant
from tests.engine_helpers import NODE, claim_for, racing_builders, run_fail, run_ok, spec
from workflows.api import create_workflow
from workflows.models import Service
from workflows.validation import DefinitionError, validate_service

pytestmark = pytest.mark.django_db


def _hosts(node: str, names: list[str]) -> list[Host]:
    Node.objects.get_or_create(name=node)
    return [Host.objects.create(name=n, node_id=node) for n in names]


# --------------------------------------------------------------------------------------------
# How jobs end
# --------------------------------------------------------------------------------------------

def test_a_canceled_task_ends_its_job_canceled_not_done(make_service):
    make_service("c-a"), make_service("c-b")
    create_workflow(name="cj", steps=[{"key": "a", "service": "c-a", "depends_on": []},
                                      {"key": "b", "service": "c-b", "depends_on": []}])
    job = api.start_workflow("cj")
    task_b = Task.objects.get(job=job, step_key="b")
    assert transitions.cancel_task(task_b.id, by="op").changed
    run_ok(claim_for(Service.objects.get(key="c-a")))
    job.refresh_from_db()
    assert job.status == "canceled" and job.error_code == "canceled", (job.status, job.error_code)
    assert "1 task(s) canceled" in job.error_message


def test_fan_out_with_blocked_hosts_ends_partial_and_says_how_many(make_service):
    svc = make_service("ping")
    create_workflow(name="fan", steps=[{"key": "ping", "service": "ping", "depends_on": [], "fan_out": "hosts"}])
    hosts = _hosts("node-t", ["h1", "h2", "h3"])
    HostBlock.objects.create(host=hosts[2], service=svc)
    job = api.start_workflow("fan", options={"hosts": ["h1", "h2", "h3"]})
    run_ok(claim_for(svc))
    job.refresh_from_db()
    assert job.status == "partial", job.status
    assert job.error_code == "hosts_blocked" and "1 of 3" in job.error_message, job.error_message
    assert any(line.message.startswith("job running → partial (1 of 3")
               for e in Event.objects.filter(job_id=job.id) for line in unfold(e))


def test_interrupted_attempt_is_queued_again_at_once_without_using_its_budget(make_service):
    svc = make_service("int", max_attempts=1)
    job = api.start_service("int")
    [task] = claim_for(svc)
    result = transitions.report([transitions.Outcome(task_id=task.id, attempt=task.attempt, status="interrupted")],
                                started=[(task.id, task.attempt, 1)], agent_id="agent-t", source="agent:test")
    assert result.retried == [task.id]
    row = Task.objects.get(pk=task.id)
    assert row.status == "queued" and row.max_attempts == 2 and row.next_attempt_at <= timezone.now()
    assert Attempt.objects.get(task_id=task.id, attempt_no=1).status == "interrupted"
    run_ok(claim_for(svc))
    job.refresh_from_db()
    assert job.status == "done"


@pytest.mark.parametrize("code", ["interrupted", "outage"])
def test_refunds_are_bounded_then_interruptions_count_until_the_task_dead_letters(make_service, two_refunds, code):
    """Two refunds, then each interrupted attempt spends the budget of two: the fourth interruption is final."""
    svc = make_service(f"int-bound-{code}", max_attempts=2, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service(svc.key)
    counted: list[bool] = []
    for _ in range(10):  # unbounded refunds would requeue forever
        claimed = claim_for(svc)
        if not claimed:
            break
        [task] = claimed
        transitions.report([transitions.Outcome(task_id=task.id, attempt=task.attempt, status="interrupted",
                                                error_code=code)],
                           started=[(task.id, task.attempt, 1)], agent_id="agent-t", source="agent:test")
        ev = Event.objects.filter(task_id=task.id, attempt=task.attempt, data__has_key="counted").get()
        counted.append(ev.data["counted"])
    assert counted == [False, False, True, True], counted
    row = Task.objects.get(job=job)
    assert (row.status, row.error_code, row.attempt, row.max_attempts) == ("error", code, 4, 4)
    assert set(Attempt.objects.filter(task=row).values_list("status", flat=True)) == {"interrupted"}
    final = Event.objects.filter(task_id=row.id, data__dead_letter=True).get()
    assert final.data["counted"] is True and "it counts" in final.message, final.message


def test_an_operators_cancel_stays_a_cancel_even_when_the_agent_reports_interrupted(make_service):
    svc = make_service("int-c")
    job = api.start_service("int-c")
    [task] = claim_for(svc)
    assert transitions.cancel_job(job.id, by="op").changed
    transitions.report([transitions.Outcome(task_id=task.id, attempt=task.attempt, status="interrupted")],
                       started=[(task.id, task.attempt, 1)], agent_id="agent-t", source="agent:test")
    assert Task.objects.get(pk=task.id).status == "canceled"


# --------------------------------------------------------------------------------------------
# Cost of a report in a large fan-out
# --------------------------------------------------------------------------------------------

def _task_rows_read_by_one_report(svc: Service, task) -> int:
    """Task rows the report of ``task`` reads: the transaction's read counters before and after it.

    The counters of ``pg_stat_xact_user_tables`` cover the whole (test) transaction, so the report's
    own share is the difference.
    """
    def rows_read() -> int:
        with connection.cursor() as cur:
            cur.execute("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
                        " WHERE relname = 'accs_task'")
            return cur.fetchone()[0]

    before = rows_read()
    run_ok([task])
    return rows_read() - before


@pytest.mark.parametrize("size", [1000])
def test_a_report_reads_as_many_task_rows_in_a_large_fan_out_as_in_a_small_one(make_service, size):
    """Defect 10: each report used to re-aggregate every task of the job under its lock."""
    a, _b = make_service("fa"), make_service("fb")
    create_workflow(name="ff", steps=[
        {"key": "a", "service": "fa", "depends_on": [], "fan_out": "hosts"},
        {"key": "b", "service": "fb", "depends_on": ["a"], "fan_out": "hosts"},
    ])
    names = [f"fh{i}" for i in range(size)]
    _hosts("node-t", names)
    small = api.start_workflow("ff", options={"hosts": names[:2]})
    big = api.start_workflow("ff", options={"hosts": names})
    limits = NODE.__class__(name="node-t", slot_cap=size + 10, cpu_budget=10 * size, per_service={})
    claimed = {t.job_id: t for t in reversed(claim_many([spec(a)], limits, agent_id="agent-t", free_slots=size + 2,
                                                         lease_seconds=60))}
    read_small = _task_rows_read_by_one_report(a, claimed[small.id])
    read_big = _task_rows_read_by_one_report(a, claimed[big.id])
    assert read_big <= read_small + 5, (read_small, read_big)
    assert JobStep.objects.get(job=big, step_key="a").done == 1


def test_finishing_a_fan_out_promotes_the_next_fan_out_once(make_service):
    a, b = make_service("pa"), make_service("pb")
    create_workflow(name="pp", steps=[
        {"key": "a", "service": "pa", "depends_on": [], "fan_out": "hosts"},
        {"key": "b", "service": "pb", "depends_on": ["a"], "fan_out": "hosts"},
        {"key": "c", "service": "pa", "depends_on": ["a", "b"]},
    ])
    names = [f"ph{i}" for i in range(20)]
    _hosts("node-t", names)
    job = api.start_workflow("pp", options={"hosts": names})
    limits = NODE.__class__(name="node-t", slot_cap=100, cpu_budget=100, per_service={})
    first = claim_many([spec(a)], limits, agent_id="agent-t", free_slots=100, lease_seconds=60)
    assert len(first) == 20
    for t in first[:-1]:
        run_ok([t])
    assert Task.objects.filter(job=job, step_key="b", status="queued").count() == 0
    run_ok(first[-1:])
    assert Task.objects.filter(job=job, step_key="b", status="queued").count() == 20
    assert Event.objects.filter(job_id=job.id, message="task waiting → queued").count() == 20
    second = claim_many([spec(b)], limits, agent_id="agent-t", free_slots=100, lease_seconds=60)
    run_ok(second)
    run_ok(claim_many([spec(a)], limits, agent_id="agent-t", free_slots=100, lease_seconds=60))
    job.refresh_from_db()
    assert job.status == "done" and job.progress == 1.0


def test_a_failed_step_skips_its_dependents_transitively(make_service):
    a, _b, _c = make_service("sa", max_attempts=1), make_service("sb"), make_service("sc")
    create_workflow(name="sk", steps=[
        {"key": "a", "service": "sa", "depends_on": []},
        {"key": "b", "service": "sb", "depends_on": ["a"]},
        {"key": "c", "service": "sc", "depends_on": ["b"]},
    ])
    job = api.start_workflow("sk")
    run_fail(claim_for(a))
    statuses = dict(Task.objects.filter(job=job).values_list("step_key", "status"))
    assert statuses == {"a": "error", "b": "skipped", "c": "skipped"}
    job.refresh_from_db()
    assert job.status == "error"


# --------------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------------

def test_two_workflows_of_one_tenant_share_its_cap_within_one_builder_tick(make_service):
    """Defect 7: each (tenant, workflow) pair was counted before earlier pairs' jobs started."""
    make_service("ad")
    tenant = Tenant.objects.create(slug="capped", name="Capped", max_in_flight=2)
    for name in ("w1", "w2", "w3"):
        create_workflow(name=name, steps=[{"key": "s", "service": "ad", "depends_on": []}])
    for name in ("w1", "w2", "w3"):
        api.start_workflow(name, tenant=tenant)
        api.start_workflow(name, tenant=tenant)
    started = transitions.start_due_jobs()
    assert len(started) == 2
    assert Job.objects.filter(tenant=tenant, status="waiting").count() == 2
    # Oldest first across the workflows: the two admitted jobs are the two oldest.
    oldest = list(Job.objects.filter(tenant=tenant).order_by("order_seq").values_list("id", flat=True)[:2])
    assert sorted(map(str, started)) == sorted(map(str, oldest))


def test_admission_is_exact_with_three_builders_racing(make_service, transactional_db):
    make_service("race-ad")
    tenant = Tenant.objects.create(slug="race", name="Race", max_in_flight=3)
    for name in ("r1", "r2"):
        create_workflow(name=name, steps=[{"key": "s", "service": "race-ad", "depends_on": []}], max_active_jobs=2)
    for _ in range(10):
        api.start_workflow("r1", tenant=tenant)
        api.start_workflow("r2", tenant=tenant)
    racing_builders(rounds=5, limit=3)
    assert Job.objects.filter(tenant=tenant, status="waiting").count() == 3
    running = list(Job.objects.filter(tenant=tenant, status="waiting").values_list("workflow__name", flat=True))
    assert max(running.count("r1"), running.count("r2")) <= 2


def test_a_retried_job_goes_back_through_admission(make_service):
    svc = make_service("re-ad", max_attempts=1)
    create_workflow(name="one-at-a-time", steps=[{"key": "s", "service": "re-ad", "depends_on": []}],
                    max_active_jobs=1)
    first = api.start_workflow("one-at-a-time")
    transitions.start_due_jobs()
    run_fail(claim_for(svc))
    first.refresh_from_db()
    assert first.status == "error"
    second = api.start_workflow("one-at-a-time")
    assert transitions.start_due_jobs() == [second.id]
    result = transitions.retry_job(first.id, by="op")
    assert result.changed and "waiting for admission" in result.message, result.message
    first.refresh_from_db()
    assert first.status == "queued"
    assert claim_for(svc) and True  # the second job's task
    assert Task.objects.get(job=first).status == "waiting", "the retried job's task must wait for admission"
    assert transitions.start_due_jobs() == [], "the workflow's one slot is taken"


# --------------------------------------------------------------------------------------------
# Lock order: a storm of verbs at once
# --------------------------------------------------------------------------------------------

def test_cancel_retry_report_and_rescue_at_once_never_deadlock(make_service, transactional_db):
    svc = make_service("storm", max_attempts=50, backoff_base_seconds=0, backoff_cap_seconds=0)
    create_workflow(name="storm", steps=[{"key": f"s{i}", "service": "storm", "depends_on": []} for i in range(6)])
    jobs = [api.start_workflow("storm").id for _ in range(8)]
    deadlocks: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def guarded(fn):
        def run() -> None:
            try:
                while not stop.is_set():
                    try:
                        fn()
                    except OperationalError as exc:
                        if "deadlock" in str(exc):
                            deadlocks.append(str(exc))
                        else:
                            raise
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                connections.close_all()
        return run

    def agent() -> None:
        tasks = claim_for(svc, 30)
        run_fail(tasks[: len(tasks) // 2])
        run_ok(tasks[len(tasks) // 2:])

    def operator() -> None:
        for jid in jobs:
            transitions.cancel_job(jid, by="storm")
        for jid in reversed(jobs):
            transitions.retry_job(jid, by="storm")

    def rescuer() -> None:
        with connection.cursor() as cur:
            cur.execute("UPDATE accs_task SET lease_expires_at = now() - interval '1 second'"
                        " WHERE id IN (SELECT id FROM accs_task WHERE status = 'running' ORDER BY id LIMIT 5)")
        transitions.rescue_expired(limit=50)

    def task_operator() -> None:
        for tid in Task.objects.filter(job_id__in=jobs).order_by("?").values_list("id", flat=True)[:10]:
            transitions.cancel_task(tid, by="storm")
            transitions.retry_task(tid, by="storm")

    threads = [threading.Thread(target=guarded(f)) for f in (agent, agent, operator, rescuer, task_operator)]
    for t in threads:
        t.start()
    timer = threading.Timer(8.0, stop.set)
    timer.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert deadlocks == [], f"{len(deadlocks)} deadlock(s): {deadlocks[:1]}"
    assert Event.objects.filter(type="status").count() > 100, "the storm did real work"


def test_a_transient_database_error_on_the_api_is_a_503_with_json(make_service, transactional_db, db_url):
    import psycopg

    from tests.api_helpers import client_for, user_with_token

    make_service("lockme")
    job = api.start_service("lockme")
    user, token = user_with_token("locker", superuser=True)
    http = client_for(token)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT id FROM accs_job WHERE id = %s FOR UPDATE", [job.id])
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '200ms'")
        response = http.post(f"/api/v1/jobs/{job.id}/cancel")
        holder.rollback()
    assert response.status_code == 503, response.content
    assert response["Content-Type"].startswith("application/json")
    assert "retry" in response.json()["detail"] and response["Retry-After"] == "1"


# --------------------------------------------------------------------------------------------
# Smaller rules
# --------------------------------------------------------------------------------------------

def test_a_long_service_key_gets_a_notify_channel_postgres_accepts(make_service):
    key = "x" * 100
    channel = service_channel(key)
    assert len(channel.encode()) <= 63 and channel != service_channel("x" * 99)
    with connection.cursor() as cur:
        notify(cur, [channel])  # raised "identifier too long" before
    svc = make_service(key)
    api.start_service(svc)


def test_a_stale_exclusive_flag_never_breaks_the_claim(make_service):
    """Defect 12: tasks created while a service was exclusive, claimed after it no longer is."""
    svc = make_service("excl", exclusive_per_host=True)
    _hosts("node-t", ["xh", "xh-other"])  # two hosts: the node's slot cap is not what stops a second claim
    create_workflow(name="ex", steps=[{"key": "e", "service": "excl", "depends_on": [], "fan_out": "hosts"}])
    for _ in range(3):
        api.start_workflow("ex", options={"hosts": ["xh"]})
    Service.objects.filter(pk=svc.pk).update(exclusive_per_host=False)
    svc.refresh_from_db()
    first = claim_for(svc)
    assert len(first) == 1, "the tasks' own exclusive flag still allows one per host"
    assert claim_for(svc) == [], "and none while it is held"
    run_ok(first)
    assert len(claim_for(svc)) == 1


def test_required_labels_are_checked_at_claim(make_service):
    svc = make_service("gpu-work", required_labels={"gpu": "true"})
    api.start_service(svc)
    plain = NODE
    gpu = NODE.__class__(name="node-gpu", slot_cap=20, cpu_budget=8, per_service={}, labels={"gpu": "true"})
    assert claim_many([spec(svc)], plain, agent_id="a", free_slots=5, lease_seconds=60) == []
    assert len(claim_many([spec(svc)], gpu, agent_id="b", free_slots=5, lease_seconds=60)) == 1


def test_one_claim_follows_the_global_order_across_an_agents_services(make_service):
    """Defect 12: a busy first service used to starve the agent's other services."""
    busy, other = make_service("busy"), make_service("other")
    ids = []
    for i in range(6):
        ids.append(api.start_service(busy if i % 2 == 0 else other).id)
    claimed = claim_many([spec(busy), spec(other)], NODE, agent_id="a", free_slots=4, lease_seconds=60)
    assert [t.job_id for t in claimed] == ids[:4]
    assert {t.service_key for t in claimed} == {"busy", "other"}


def test_the_backoff_cap_setting_bounds_every_retry_delay(make_service, monkeypatch):
    svc = make_service("capped-backoff", max_attempts=5, backoff_base_seconds=100, backoff_cap_seconds=3600)
    monkeypatch.setattr(accs, "backoff_cap_sec", 7.0)
    api.start_service(svc)
    run_fail(claim_for(svc))
    task = Task.objects.get(service=svc)
    delay = (task.next_attempt_at - task.updated_at).total_seconds()
    assert 7.0 <= delay <= 7.0 * 1.1 + 0.01, delay


def test_a_job_whose_service_is_gone_fails_alone_and_the_builder_goes_on(make_service):
    """Defect 11: a renamed or deleted service crash-looped every builder."""
    make_service("doomed"), make_service("fine")
    create_workflow(name="uses-doomed", steps=[{"key": "d", "service": "doomed", "depends_on": []}])
    later = timezone.now() + timedelta(seconds=1)
    doomed_job = api.start_workflow("uses-doomed", scheduled_at=later)
    fine_job = api.start_service("fine", scheduled_at=later)
    Service.objects.filter(key="doomed").update(is_active=False)
    started = transitions.start_due_jobs(now=later + timedelta(seconds=1))
    assert started == [fine_job.id]
    doomed_job.refresh_from_db()
    assert doomed_job.status == "error" and doomed_job.error_code == "unknown_service", doomed_job.error_code
    assert "'doomed'" in doomed_job.error_message
    assert Event.objects.filter(job_id=doomed_job.id, level="error").exists()


def test_a_service_key_in_use_cannot_be_renamed_away(make_service):
    svc = make_service("renamed")
    create_workflow(name="uses-renamed", steps=[{"key": "r", "service": "renamed", "depends_on": []}])
    svc.key = "renamed-2"
    with pytest.raises(DefinitionError) as excinfo:
        validate_service(svc)
    assert "cannot be renamed" in str(excinfo.value) and "uses-renamed" in str(excinfo.value)
    unused = make_service("unused")
    unused.key = "unused-2"
    validate_service(unused)  # nothing names it: renaming is fine


def test_job_creation_writes_an_event_so_a_gated_job_has_a_timeline(make_service):
    make_service("gated", requires_approval=True)
    job = api.start_service("gated")
    [event] = Event.objects.filter(job_id=job.id)
    assert event.message == "job created queued, waiting for approval"
    assert event.data["approval"] == "pending"


def test_lease_times_come_from_postgres_clock_not_the_callers(make_service):
    """Defect 9: a claim whose process clock is 80 s behind still gets a lease from now on."""
    svc = make_service("clock")
    api.start_service(svc)
    [task] = claim_for(svc)
    with connection.cursor() as cur:
        # clock_timestamp(): the claim's instant is its statement's start (after its locks), later than
        # now(), which here is the start of the test's own transaction.
        cur.execute("SELECT lease_expires_at - clock_timestamp(), claimed_at - clock_timestamp() FROM accs_task"
                    " WHERE id = %s", [task.id])
        lease_left, claimed_skew = cur.fetchone()
    assert timedelta(seconds=55) <= lease_left <= timedelta(seconds=60)
    assert abs(claimed_skew) < timedelta(seconds=1)


def test_a_transient_error_raised_outside_a_view_is_a_503_too(rf):
    """A middleware that cannot reach the database (sessions, auth) gets the same answer as a view."""
    from accs_site.middleware import server_error

    for path, kind in (("/api/v1/jobs", "application/json"), ("/admin/", "text/html")):  # the styled 503 page
        try:
            raise OperationalError("server closed the connection unexpectedly")
        except OperationalError:
            response = server_error(rf.get(path))
        assert response.status_code == 503 and response["Content-Type"].startswith(kind)
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        response = server_error(rf.get("/api/v1/jobs"))
    assert response.status_code == 500 and response["Content-Type"] == "application/json"


def test_a_governor_priority_shift_reorders_one_claim_across_services(make_service):
    light, heavy = make_service("render"), make_service("whisper")
    first = [api.start_service(heavy).id for _ in range(2)]  # older, so first in the global order
    later = [api.start_service(light).id for _ in range(2)]
    claimed = claim_many([spec(heavy), spec(light)], NODE, agent_id="a", free_slots=2, lease_seconds=60,
                         priority_adjust={heavy.id: -3})
    assert [t.job_id for t in claimed] == later, "a condition's -3 puts the older heavy tasks behind"
    assert first


def test_a_retry_waits_out_its_backoff_scheduled_then_the_builder_duty_queues_it(make_service):
    from jobs.reports import promote_scheduled

    svc = make_service("later", max_attempts=3, backoff_base_seconds=30, backoff_cap_seconds=30)
    api.start_service(svc)
    run_fail(claim_for(svc))
    task = Task.objects.get(service=svc)
    assert task.status == "scheduled", "a retry that must wait is out of the claim index"
    assert promote_scheduled() == 0, "not before its time"
    assert promote_scheduled(now=task.next_attempt_at + timedelta(seconds=1)) == 1
    assert Task.objects.get(pk=task.pk).status == "queued"
    assert Event.objects.filter(task_id=task.id, message="task scheduled → queued (backoff over)").exists()
