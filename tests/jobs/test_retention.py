"""Retention: finished jobs pruned by age per tenant, exported first on request, orphan objects swept.

Jobs are run through the real engine (claim and report), then their finish is moved back in SQL;
artifacts live in the real local S3 server. The transactional database lets the prune commit, as
it does under the builder, so objects are deleted after a real commit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.checks import run_checks
from django.db import connection

from accs_site.conf import reload
from events.artifacts import delete_scheduled_objects, record_artifact, sweep_orphan_objects
from events.models import Artifact, Event, ObjectDeletion
from events.storage import get_storage
from jobs import api, leader
from jobs.builder import Builder, run_duty
from jobs.duties import prune as prune_duty
from jobs.models import Attempt, Job, JobStep, Task
from jobs.retention import ExportFailed, prune_finished_jobs
from tenants.models import Tenant
from tests import forkserver
from tests.engine_helpers import claim_for, run_fail, run_ok

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("retention_defaults")]


@pytest.fixture
def services(make_service):
    return {"ok": make_service("ret-ok"), "dead": make_service("ret-dead", max_attempts=1)}


def finished_job(services, tenant: Tenant, *, days_ago: float, failed: bool = False) -> Job:
    """Run a one-task job to its end through the engine, then move its finish ``days_ago`` back."""
    service = services["dead" if failed else "ok"]
    job = api.start_service(service.key, tenant=tenant)
    claimed = claim_for(service)
    assert [t.job_id for t in claimed] == [job.id]
    (run_fail if failed else run_ok)(claimed)
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_job SET finished_at = now() - make_interval(secs => %s) WHERE id = %s",
                    [days_ago * 86400, job.id])
        # Its tasks ended with it: a job is due only once its last task's finish is old enough too.
        cur.execute("UPDATE accs_task SET finished_at = now() - make_interval(secs => %s) WHERE job_id = %s",
                    [days_ago * 86400, job.id])
    job.refresh_from_db()
    assert job.status == ("error" if failed else "done"), job.status
    return job


def db_clock_plus(interval: str):
    """Return PostgreSQL's clock moved ``interval`` ahead."""
    with connection.cursor() as cur:
        cur.execute("SELECT now() + %s::interval", [interval])
        return cur.fetchone()[0]


def rows_of(job_ids) -> dict[str, int]:
    """Count every row that belongs to the given jobs."""
    return {
        "jobs": Job.objects.filter(id__in=job_ids).count(),
        "tasks": Task.objects.filter(job_id__in=job_ids).count(),
        "attempts": Attempt.objects.filter(task__job_id__in=job_ids).count(),
        "steps": JobStep.objects.filter(job_id__in=job_ids).count(),
        "artifacts": Artifact.objects.filter(job_id__in=job_ids).count(),
    }


def output(job: Job, name: str) -> Artifact:
    task = job.tasks.get()
    return record_artifact(job_id=job.id, task_id=task.id, attempt=1, kind="output", name=name, data=name.encode())


@pytest.fixture
def tenants(default_tenant):
    """acme keeps finished jobs 10 days (dead letters: the global 90); globex keeps them 60 days."""
    return (Tenant.objects.create(slug="acme", name="Acme", retention_days=10),
            Tenant.objects.create(slug="globex", name="Globex", retention_days=60, retention_dead_days=0))


@pytest.fixture
def ref_table():
    """Another application's table that references jobs, as an embedding site's model would."""
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE test_job_ref (id serial PRIMARY KEY, job_id uuid NOT NULL REFERENCES accs_job(id))")
    yield "test_job_ref"
    with connection.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS test_job_ref")


def test_prune_deletes_exactly_the_jobs_past_their_tenants_retention_with_their_rows_and_objects(
        s3, services, tenants, ref_table):
    acme, globex = tenants
    gone = {
        "acme done 11 days ago": finished_job(services, acme, days_ago=11),
        "acme dead letter 100 days ago": finished_job(services, acme, days_ago=100, failed=True),
        "globex done 61 days ago": finished_job(services, globex, days_ago=61),
    }
    kept = {
        "acme done 9 days ago": finished_job(services, acme, days_ago=9),
        "acme dead letter 40 days ago": finished_job(services, acme, days_ago=40, failed=True),
        "globex done 20 days ago": finished_job(services, globex, days_ago=20),
        "globex dead letter kept for ever": finished_job(services, globex, days_ago=3000, failed=True),
        "acme done 11 days ago, still referenced": finished_job(services, acme, days_ago=11),
        "acme active": api.start_service("ret-ok", tenant=acme),
    }
    with connection.cursor() as cur:
        cur.execute("INSERT INTO test_job_ref (job_id) VALUES (%s)",
                    [kept["acme done 11 days ago, still referenced"].id])
    old_object = output(gone["acme done 11 days ago"], "old/report.txt")
    young_object = output(kept["acme done 9 days ago"], "young/report.txt")
    gone_ids = [j.id for j in gone.values()]
    kept_ids = [j.id for j in kept.values()]
    kept_before = rows_of(kept_ids)
    assert rows_of(gone_ids) == {"jobs": 3, "tasks": 3, "attempts": 3, "steps": 3, "artifacts": 1}
    events_before = Event.objects.filter(job_id__in=gone_ids).count()

    result = prune_finished_jobs(limit=100)

    assert sorted(result.job_ids) == sorted(gone_ids)
    assert (result.jobs, result.tasks, result.attempts, result.steps, result.artifacts) == (3, 3, 3, 3, 1)
    assert result.objects_deleted == 1 and result.export_key is None
    assert rows_of(gone_ids) == {"jobs": 0, "tasks": 0, "attempts": 0, "steps": 0, "artifacts": 0}
    assert rows_of(kept_ids) == kept_before
    assert old_object.key not in s3.keys() and young_object.key in s3.keys()
    # The timeline is not pruned here (its partitions have their own archive), and says what happened.
    assert Event.objects.filter(job_id__in=gone_ids).count() == events_before
    event = Event.objects.get(type="retention")
    assert event.data["jobs"] == 3 and event.data["artifacts"] == 1
    assert prune_finished_jobs(limit=100).jobs == 0, "a second pass finds nothing more"


def test_prune_uses_the_global_default_when_the_tenant_sets_none_and_the_database_clock(services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=29)
    assert prune_finished_jobs(limit=10).jobs == 0
    assert prune_finished_jobs(limit=10, now=db_clock_plus("2 days")).job_ids == [job.id]


def test_prune_without_storage_keeps_jobs_that_have_artifact_rows(s3, services, default_tenant, monkeypatch):
    with_artifact = finished_job(services, default_tenant, days_ago=40)
    output(with_artifact, "kept.txt")
    plain = finished_job(services, default_tenant, days_ago=40)
    monkeypatch.delenv("ACC_MINIO_ENDPOINT")
    reload()
    assert prune_finished_jobs(limit=10).job_ids == [plain.id]
    assert Job.objects.filter(id=with_artifact.id).exists()


def test_export_writes_the_batch_as_jsonl_before_deleting(s3, services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=40)
    artifact = output(job, "out.json")
    task = job.tasks.get()

    result = prune_finished_jobs(limit=10, export=True)

    assert result.job_ids == [job.id] and result.export_key.startswith("retention/")
    assert result.export_key in s3.keys("retention/")
    (line,) = s3.get(result.export_key).decode().splitlines()
    exported = json.loads(line)
    assert exported["job"]["id"] == str(job.id) and exported["job"]["status"] == "done"
    assert [t["id"] for t in exported["tasks"]] == [str(task.id)]
    assert [a["attempt_no"] for a in exported["tasks"][0]["attempts"]] == [1]
    assert [s["step_key"] for s in exported["steps"]] == [task.step_key]
    assert [a["key"] for a in exported["artifacts"]] == [artifact.key]
    assert not Job.objects.filter(id=job.id).exists()
    assert artifact.key not in s3.keys()


def test_export_failure_deletes_nothing(s3, services, default_tenant):
    jobs = [finished_job(services, default_tenant, days_ago=40) for _ in range(2)]
    get_storage()  # ACCS knows the bucket now; removing it behind ACCS's back makes every write fail
    s3.client.delete_bucket(Bucket=s3.bucket)
    before = rows_of([j.id for j in jobs])

    with pytest.raises(ExportFailed, match="nothing was deleted"):
        prune_finished_jobs(limit=10, export=True)

    assert rows_of([j.id for j in jobs]) == before
    assert not Event.objects.filter(type="retention").exists()


def test_export_on_without_storage_prunes_nothing(services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=40)
    assert prune_finished_jobs(limit=10, export=True).jobs == 0
    assert Job.objects.filter(id=job.id).exists()


def test_prune_honours_its_limit_oldest_first(services, default_tenant):
    jobs = [finished_job(services, default_tenant, days_ago=40 + i) for i in range(5)]
    assert sorted(prune_finished_jobs(limit=2).job_ids) == sorted(j.id for j in jobs[3:])
    duty = prune_duty.duties()[0]
    assert run_duty(duty.__class__(duty.name, every=duty.every, limit=2, run=duty.run, max_batches=1)) == 2
    assert list(Job.objects.values_list("id", flat=True)) == [jobs[0].id]


def test_a_job_whose_task_another_transaction_holds_is_skipped_without_waiting(services, default_tenant, db_url):
    held, free = (finished_job(services, default_tenant, days_ago=40) for _ in range(2))
    with psycopg.connect(db_url) as other:
        other.execute("SELECT id FROM accs_task WHERE job_id = %s FOR UPDATE", [held.id])
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '2s'")  # a wait would fail the test instead of hanging it
        assert prune_finished_jobs(limit=10).job_ids == [free.id]
    assert prune_finished_jobs(limit=10).job_ids == [held.id]


def test_a_builder_tick_runs_the_prune_duty(services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=40)
    builder = Builder(once=True, duties=prune_duty.duties())
    try:
        builder.tick()
        assert builder.is_leader, "only the leader runs duties"
    finally:
        builder._drop_session("test over")
    assert not Job.objects.filter(id=job.id).exists()


def test_all_duties_include_pruning_and_the_sweep():
    from jobs.duties import all_duties

    names = [d.name for d in all_duties(batch=100)]
    assert {"prune_finished_jobs", "sweep_orphan_objects"} <= set(names)


# --- orphan objects ----------------------------------------------------------------------------


def test_orphan_sweep_deletes_old_unrecorded_artifact_objects_only(s3, services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=1)
    recorded = output(job, "recorded.txt")
    orphan = f"outputs/{job.id}/{job.tasks.get().task_key}/lost-after-upload.txt"
    s3.put(orphan, b"no row")
    keep = ["retention/2020/01/01/batch.jsonl", "archive/events/2020_01.jsonl", "notes/readme.txt", "outputs/odd"]
    for key in keep:
        s3.put(key, b"not an artifact")

    young = sweep_orphan_objects(limit=100, grace_seconds=3600)
    assert young.deleted == [] and orphan in s3.keys(), "an orphan younger than the grace period is kept"

    result = sweep_orphan_objects(limit=100, grace_seconds=3600, now=db_clock_plus("2 hours"))

    assert result.deleted == [orphan] and result.next_marker is None
    assert set(s3.keys()) == {recorded.key, *keep}


def test_orphan_sweep_covers_a_large_bucket_over_several_bounded_passes(s3):
    get_storage()
    orphans = [f"{kind}/0b7e2f9c-5f4e-4f36-9a51-3d8e0f1c2a77/step/{i}.txt" for kind in ("inputs", "logs", "outputs")
               for i in range(3)]
    for key in orphans:
        s3.put(key, b"x")
    s3.put("retention/2020/01/01/batch.jsonl", b"kept")
    later = db_clock_plus("2 hours")
    marker, passes, deleted = None, 0, []
    while True:
        result = sweep_orphan_objects(limit=4, grace_seconds=3600, start_after=marker, now=later)
        assert result.examined <= 4
        deleted += result.deleted
        passes += 1
        marker = result.next_marker
        if marker is None:
            break
    assert passes == 3 and sorted(deleted) == sorted(orphans)
    assert s3.keys() == ["retention/2020/01/01/batch.jsonl"]


def test_the_sweep_duty_remembers_where_it_stopped(s3, monkeypatch):
    get_storage()
    for i in range(3):
        s3.put(f"outputs/job/step/{i}.txt", b"young")
    sweep = prune_duty.OrphanSweep()
    assert sweep(2) == 0 and sweep.marker == "outputs/job/step/1.txt"
    assert sweep(2) == 0 and sweep.marker is None


# --- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variable, value, expected", [
    ("ACC_RETENTION_DAYS", "-1", "ACC_RETENTION_DAYS: must be at least 0"),
    ("ACC_RETENTION_DEAD_DAYS", "ninety", "ACC_RETENTION_DEAD_DAYS: expected a whole number"),
    ("ACC_RETENTION_EXPORT", "maybe", "ACC_RETENTION_EXPORT: expected true or false"),
    ("ACC_RETENTION_BATCH", "0", "ACC_RETENTION_BATCH: must be at least 1"),
    ("ACC_ORPHAN_GRACE_SEC", "5", "ACC_ORPHAN_GRACE_SEC: must be at least 60"),
])
def test_system_check_rejects_bad_retention_settings(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    reload()
    messages = [m.msg for m in run_checks() if m.id == "accs.E001"]
    assert any(expected in m for m in messages), messages


def test_system_check_rejects_export_without_storage_and_warns_of_short_dead_letter_retention(monkeypatch):
    monkeypatch.delenv("ACC_MINIO_ENDPOINT", raising=False)
    monkeypatch.setenv("ACC_RETENTION_EXPORT", "true")
    monkeypatch.setenv("ACC_RETENTION_DEAD_DAYS", "7")
    reload()
    found = {m.id: m.msg for m in run_checks() if m.id.startswith("accs.")}
    assert "ACC_RETENTION_EXPORT is on" in found["accs.E003"]
    assert "ACC_RETENTION_DEAD_DAYS=7" in found["accs.W001"]


def test_tenant_retention_is_editable_in_the_admin(admin_client, default_tenant):
    page = admin_client.get(f"/admin/tenants/tenant/{default_tenant.id}/change/")
    assert b'name="retention_days"' in page.content and b'name="retention_dead_days"' in page.content


def test_the_due_scan_walks_the_partial_retention_indexes(services, default_tenant):
    from jobs.retention import _DEAD_CUTOFF, _DONE_CUTOFF, CANDIDATES_SQL, _settled

    with connection.cursor() as cur:
        # 20,000 young finished jobs (one in ten a dead letter) and 20,000 active ones.
        cur.execute("""
            INSERT INTO accs_job (id, tenant_id, service_id, status, progress, current_task_key, priority, options,
                                  step_params, scheduled_at, error_code, error_message, source, source_ref,
                                  correlation_id, approval_state, approved_by, created_at, updated_at, finished_at)
            SELECT gen_random_uuid(), %s, %s, CASE WHEN i %% 2 = 0 THEN 'queued' WHEN i %% 20 = 1 THEN 'error'
                   ELSE 'done' END, 0, '', 0, '{}', '{}', now(), '', '', 'manual', '', '', 'not_required', '', now(),
                   now(), CASE WHEN i %% 2 = 1 THEN now() - make_interval(secs => i) END
              FROM generate_series(1, 40000) AS i""", [default_tenant.id, services["ok"].id])
        cur.execute("ANALYZE accs_job")
        cur.execute("ANALYZE accs_tenant")
        cur.execute("EXPLAIN " + CANDIDATES_SQL.format(kept="", settled_done=_settled(_DONE_CUTOFF),
                                                       settled_dead=_settled(_DEAD_CUTOFF)),
                    {"now": default_tenant.created_at, "days": 30, "dead_days": 90, "limit": 500})
        plan = "\n".join(r[0] for r in cur.fetchall())
    assert "job_prune_idx" in plan and "job_prune_dead_idx" in plan, plan
    assert "Seq Scan on accs_job" not in plan, plan


# --------------------------------------------------------------------------------------------
# A job that ended while tasks of it still ran
# --------------------------------------------------------------------------------------------

def _move_back(table: str, job_id, days: float) -> None:
    """Move the finish of a job (or of its finished tasks) ``days`` back."""
    column = "id" if table == "accs_job" else "job_id"
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {table} SET finished_at = now() - make_interval(secs => %s)"
                    f" WHERE {column} = %s AND finished_at IS NOT NULL", [days * 86400, job_id])


@pytest.mark.parametrize("ends", ["fail_job", "cancel"])
def test_a_job_that_ended_while_a_task_still_runs_is_kept_until_that_task_finished_longer_ago_than_retention(
        make_service, default_tenant, ends):
    """A job final by a fail_job failure or a cancel, with a sibling still running, is not pruned."""
    from jobs import transitions
    from workflows.api import create_workflow
    from workflows.models import Service

    make_service("ret-fast", max_attempts=1)
    make_service("ret-slow", max_attempts=1)
    create_workflow(name="ret-wf", steps=[{"key": "fast", "service": "ret-fast"},
                                          {"key": "slow", "service": "ret-slow"}])
    job = api.start_workflow("ret-wf")
    slow = claim_for(Service.objects.get(key="ret-slow"))
    transitions.mark_running([(t.id, t.attempt, 1) for t in slow], agent_id="agent-t", source="agent:test")
    if ends == "fail_job":
        run_fail(claim_for(Service.objects.get(key="ret-fast")))
        expected = "error"
    else:
        assert transitions.cancel_job(job.id, by="op").changed
        expected = "canceled"
    job.refresh_from_db()
    assert job.status == expected
    assert Task.objects.get(id=slow[0].id).status == "running"
    _move_back("accs_job", job.id, 1000)  # past both ages (30 days done, 90 dead)
    _move_back("accs_task", job.id, 1000)
    before = rows_of([job.id])
    assert job.id not in prune_finished_jobs(limit=10).job_ids, "pruned while a task of it still runs"
    assert rows_of([job.id]) == before and before["tasks"] == 2

    outcome = "succeeded" if ends == "fail_job" else "canceled"
    transitions.report([transitions.Outcome(task_id=slow[0].id, attempt=slow[0].attempt, status=outcome)],
                       agent_id="agent-t", source="agent:test")
    assert Task.objects.get(id=slow[0].id).finished_at is not None
    assert job.id not in prune_finished_jobs(limit=10).job_ids, "its last task finished just now"
    _move_back("accs_task", job.id, 1000)
    assert prune_finished_jobs(limit=10).job_ids == [job.id]
    assert rows_of([job.id]) == dict.fromkeys(["jobs", "tasks", "attempts", "steps", "artifacts"], 0)

def test_event_receipts_older_than_their_retention_are_pruned_by_a_duty(default_tenant, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from accs_site.conf import reload
    from jobs.duties import all_duties
    from jobs.receipts import EventReceipt

    def receipt(event_id: str, age: timedelta) -> None:
        EventReceipt.objects.create(tenant=default_tenant, event_id=event_id, name="e", body_digest="0" * 64,
                                    created_at=timezone.now() - age)

    monkeypatch.setenv("ACC_EVENT_RECEIPT_RETENTION_HOURS", "24")
    reload()
    try:
        receipt("old-1", timedelta(hours=25))
        receipt("old-2", timedelta(days=30))
        receipt("fresh", timedelta(hours=23))
        [duty] = [d for d in all_duties(batch=100) if d.name == "prune_event_receipts"]
        assert duty.run(1) == 1, "a bounded batch"
        assert duty.run(100) == 1
        assert duty.run(100) == 0
        assert list(EventReceipt.objects.values_list("event_id", flat=True)) == ["fresh"]
    finally:
        monkeypatch.delenv("ACC_EVENT_RECEIPT_RETENTION_HOURS")
        reload()


# --- object deletions after the commit ----------------------------------------------------------


def assert_no_row_names_a_missing_object(s3) -> None:
    present = set(s3.keys())
    missing = [a.key for a in Artifact.objects.all() if a.key not in present]
    assert missing == [], f"artifact rows name objects that are gone: {missing}"


def test_a_prune_fenced_off_at_its_final_check_deletes_no_object(s3, services, default_tenant, db_url):
    job = finished_job(services, default_tenant, days_ago=40)
    artifact = output(job, "fenced/report.txt")
    lease = leader.Lease(seconds=30)
    assert lease.acquire() is not None

    def prune_then_lose_the_lease(limit: int) -> int:
        pruned = prune_finished_jobs(limit=limit).jobs
        # Another builder takes over while the prune's transaction is still open.
        with psycopg.connect(db_url, autocommit=True) as other:
            other.execute("UPDATE accs_leader SET expires_at = now() - interval '1 second' WHERE name = %s",
                          [leader.LEASE_NAME])
        return pruned

    with pytest.raises(leader.NotLeader):
        lease.run_fenced(lambda: prune_then_lose_the_lease(10))

    assert artifact.key in s3.keys(), "the rolled-back prune deleted the object its row still names"
    assert Job.objects.filter(pk=job.pk).exists() and Artifact.objects.filter(pk=artifact.pk).exists()
    assert not ObjectDeletion.objects.exists()
    assert_no_row_names_a_missing_object(s3)
    next_term = leader.Lease(seconds=30)
    assert next_term.acquire() is not None
    assert next_term.run_fenced(lambda: prune_finished_jobs(limit=10).jobs) == 1
    assert artifact.key not in s3.keys() and not ObjectDeletion.objects.exists()


CRASH_AFTER_COMMIT = """
import os
from events import artifacts
from jobs.retention import prune_finished_jobs

def crash(**_):
    os._exit(9)  # the process dies between the prune's commit and the deletion of its objects

artifacts.delete_scheduled_objects = crash
prune_finished_jobs(limit=10)
"""


def test_a_crash_between_the_commit_and_the_deletion_loses_nothing(s3, services, default_tenant, subprocess_env):
    job = finished_job(services, default_tenant, days_ago=40)
    artifact = output(job, "crash/report.txt")
    env = {**subprocess_env, **{k: v for k, v in os.environ.items() if k.startswith(("ACC_MINIO", "ACC_RETENTION"))}}
    crashed = forkserver.run([sys.executable, "manage.py", "shell", "-c", CRASH_AFTER_COMMIT], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    assert not Job.objects.filter(pk=job.pk).exists(), "the prune committed"
    assert artifact.key in s3.keys(), "the object outlived the crash"
    assert list(ObjectDeletion.objects.values_list("key", flat=True)) == [artifact.key], "its deletion is on record"
    assert_no_row_names_a_missing_object(s3)

    [duty] = [d for d in prune_duty.duties() if d.name == "delete_pruned_objects"]
    assert run_duty(duty) == 1
    assert artifact.key not in s3.keys() and not ObjectDeletion.objects.exists()
    assert run_duty(duty) == 0, "nothing is left to repeat"


def test_a_scheduled_object_already_gone_is_deleted_again_without_error(s3, services, default_tenant):
    job = finished_job(services, default_tenant, days_ago=40)
    artifact = output(job, "twice/report.txt")
    s3.client.delete_object(Bucket=s3.bucket, Key=artifact.key)  # an earlier pass deleted it, then died
    Artifact.objects.filter(pk=artifact.pk).delete()
    ObjectDeletion.objects.create(bucket=s3.bucket, key=artifact.key)
    assert delete_scheduled_objects(limit=10) == 1
    assert not ObjectDeletion.objects.exists()
