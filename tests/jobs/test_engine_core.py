"""State machine and claim, driven directly (no daemons): order, promotion, retries, fencing."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from events.models import Event
from events.timeline import unfold
from jobs import api, transitions
from jobs.backoff import backoff_delay
from jobs.models import Attempt, Job, Task
from tests.engine_helpers import claim_for, run_fail, run_ok
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_step(make_service):
    a, b = make_service("svc-a"), make_service("svc-b")
    wf = create_workflow(name="two", steps=[
        {"key": "first", "service": "svc-a", "depends_on": []},
        {"key": "second", "service": "svc-b", "depends_on": ["first"]},
    ])
    return a, b, wf


def test_seed_000_smoke_two_jobs_two_tasks_follow_global_order(two_step):
    a, b, _ = two_step
    j1 = api.start_workflow("two")
    j2 = api.start_workflow("two")
    assert j1.order_seq < j2.order_seq
    first = claim_for(a)
    assert [t.job_id for t in first] == [j1.id, j2.id]
    assert claim_for(b) == [], "second steps wait for their dependency"
    run_ok(first)
    second = claim_for(b)
    assert [t.job_id for t in second] == [j1.id, j2.id], "every service follows the same global job order"
    run_ok(second)
    for job in (j1, j2):
        job.refresh_from_db()
        assert (job.status, job.progress, job.finished_at is not None) == ("done", 1.0, True)


def test_priority_beats_order_seq(make_service):
    svc = make_service("svc")
    low = api.start_service("svc")
    high = api.start_service("svc", priority=5)
    assert [t.job_id for t in claim_for(svc)] == [high.id, low.id]


def test_claim_respects_capacity_and_writes_attempt_and_event(make_service):
    svc = make_service("svc")
    jobs = [api.start_service("svc") for _ in range(5)]
    claimed = claim_for(svc, n=3)
    assert [t.job_id for t in claimed] == [j.id for j in jobs[:3]]
    assert Task.objects.filter(status="starting").count() == 3
    assert Attempt.objects.filter(status="running").count() == 3
    assert Event.objects.filter(message="task queued → starting").count() == 3


def test_every_status_change_writes_an_event(two_step):
    a, b, _ = two_step
    job = api.start_workflow("two")
    run_ok(claim_for(a))
    run_ok(claim_for(b))
    # A job's creation with its tasks is one row, shown as its lines (events.timeline.unfold).
    messages = [line.message for e in Event.objects.filter(job_id=job.id).order_by("id") for line in unfold(e)]
    assert messages == [
        "job created queued", "job queued → waiting (tasks created)", "task created queued", "task created waiting",
        "task queued → starting", "job waiting → running", "task starting → running", "task running → done",
        # The report's moves are one row, the job's folded in; the promotion its finish caused follows it.
        "job running → waiting (no task starting or running)", "task waiting → queued",
        "task queued → starting", "job waiting → running", "task starting → running", "task running → done",
        "job running → done",
    ]


def test_failure_retries_with_backoff_then_dead_letters(make_service):
    svc = make_service("flaky", max_attempts=3, backoff_base_seconds=10, backoff_cap_seconds=15)
    job = api.start_service("flaky")
    now = timezone.now()
    delays = []
    for attempt in (1, 2):
        tasks = claim_for(svc, now=now)
        assert [t.attempt for t in tasks] == [attempt]
        result = run_fail(tasks)
        assert result.retried == [tasks[0].id]
        task = Task.objects.get(pk=tasks[0].id)
        delay = (task.next_attempt_at - timezone.now()).total_seconds()
        delays.append(delay)
        assert claim_for(svc, now=now) == [], "not claimable before next_attempt_at"
        now = task.next_attempt_at + timedelta(milliseconds=1)
    assert 9 <= delays[0] <= 11.1 and 14 <= delays[1] <= 16.6  # 10 s, then capped 15 s, plus ≤10 % jitter
    tasks = claim_for(svc, now=now)
    assert run_fail(tasks).failed == [tasks[0].id]
    job.refresh_from_db()
    assert job.status == "error" and job.finished_at is not None
    attempts = Attempt.objects.filter(task_id=tasks[0].id).order_by("attempt_no")
    assert list(attempts.values_list("status", flat=True)) == ["failed"] * 3
    assert Event.objects.filter(job_id=job.id, data__dead_letter=True).exists()


def test_backoff_schedule_and_jitter_bounds():
    rng = random.Random(1)
    for attempt, base_delay in [(1, 15), (2, 30), (3, 60), (4, 120), (10, 3600)]:
        samples = [backoff_delay(attempt, base=15, cap=3600, rng=rng) for _ in range(500)]
        assert min(samples) >= base_delay and max(samples) < base_delay * 1.1
        assert max(samples) - min(samples) > base_delay * 0.05, "jitter spreads retries"
    with pytest.raises(ValueError):
        backoff_delay(0, base=15, cap=60)


def test_late_report_from_fenced_attempt_is_rejected_and_recorded(make_service):
    svc = make_service("svc")
    api.start_service("svc")
    first = claim_for(svc, agent="agent-1")
    later = timezone.now() + timedelta(minutes=5)
    rescued = transitions.rescue_expired(now=later)
    assert rescued.retried == [first[0].id]
    second = claim_for(svc, agent="agent-2", now=later + timedelta(minutes=5))
    assert second[0].attempt == 2
    late = transitions.report([transitions.Outcome(task_id=first[0].id, attempt=1, status="succeeded", results={})],
                              source="agent:old")
    assert late.fenced == [first[0].id] and late.done == []
    assert Task.objects.get(pk=first[0].id).status == "starting"
    fenced = Event.objects.get(type="fenced")
    assert fenced.attempt == 1 and "late report from attempt 1 rejected" in fenced.message
    assert Attempt.objects.get(task_id=first[0].id, attempt_no=1).error_text.startswith("lease_expired")


def test_a_report_sent_again_after_its_answer_was_lost_is_acknowledged_not_fenced(make_service):
    """An agent whose connection broke after COMMIT cannot know the report landed, so it sends it again."""
    svc = make_service("svc", backoff_base_seconds=0, backoff_cap_seconds=0)
    ok_job, bad_job = api.start_service("svc"), api.start_service("svc")
    claimed = {t.job_id: t for t in claim_for(svc)}
    ok, bad = [claimed[ok_job.id]], [claimed[bad_job.id]]
    assert run_ok(ok).done == [ok[0].id]
    assert run_fail(bad).retried == [bad[0].id]
    again_ok, again_bad = run_ok(ok), run_fail(bad)
    assert (again_ok.repeated, again_ok.done, again_ok.fenced) == ([ok[0].id], [], [])
    assert (again_bad.repeated, again_bad.retried, again_bad.fenced) == ([bad[0].id], [], [])
    assert not Event.objects.filter(type="fenced").exists()
    assert [line.message for e in Event.objects.filter(task_id=ok[0].id) for line in unfold(e)].count(
        "task running → done") == 1
    assert Event.objects.filter(task_id=bad[0].id, type="retry").count() == 1, "one retry, not two"
    assert Task.objects.get(pk=bad[0].id).status == "queued"
    # A report that differs from what is recorded is still a late one: fenced.
    other = run_fail(bad, error="something else")
    assert other.fenced == [bad[0].id] and other.repeated == []


def test_a_late_failure_after_the_lease_was_rescued_stays_fenced(make_service):
    svc = make_service("svc")
    api.start_service("svc")
    first = claim_for(svc, agent="agent-1")
    transitions.rescue_expired(now=timezone.now() + timedelta(minutes=5))
    late = run_fail(first, agent="agent-1")
    assert late.fenced == [first[0].id] and late.repeated == []


def test_a_start_already_recorded_does_not_fence_the_end_reported_with_it(make_service):
    """The start committed on its own but its answer was lost; the agent sends start and end together."""
    svc = make_service("svc")
    job = api.start_service("svc")
    tasks = claim_for(svc)
    transitions.mark_running([(tasks[0].id, tasks[0].attempt, 123)], agent_id="agent-t", source="agent:test")
    result = run_ok(tasks)
    assert result.done == [tasks[0].id] and result.fenced == []
    job.refresh_from_db()
    assert job.status == "done"
    status_events = [line for e in Event.objects.filter(job_id=job.id, type="status").order_by("id")
                     for line in unfold(e) if line.task_id == tasks[0].id]
    assert [line.message for line in status_events] == [
        "task created queued", "task queued → starting", "task starting → running", "task running → done"]


def test_final_failure_skips_unstarted_tasks_of_the_job(two_step):
    a, _b, _ = two_step
    a.max_attempts = 1
    a.save()
    job = api.start_workflow("two")
    run_fail(claim_for(a))
    job.refresh_from_db()
    assert job.status == "error"
    statuses = dict(Task.objects.filter(job=job).values_list("step_key", "status"))
    assert statuses == {"first": "error", "second": "skipped"}


def test_job_created_in_rolled_back_transaction_does_not_exist(make_service):
    from django.db import transaction

    make_service("svc")
    with pytest.raises(RuntimeError), transaction.atomic():
        job = api.start_service("svc")
        assert Task.objects.filter(job_id=job.id).count() == 1
        raise RuntimeError("caller rolls back")
    assert Job.objects.count() == 0 and Task.objects.count() == 0


def _claim_plan(svc, *, hosts: list[int]) -> str:
    """EXPLAIN ANALYZE the real claim statement for 10 tasks (rolled back: nothing is claimed)."""
    from django.db import transaction

    from jobs.claim import claim_statement, service_spec

    sql, params = claim_statement([(service_spec(svc), 10)], adjust={})
    params.update({"now": None, "hosts": hosts, "slots": 10, "cpu": 1000, "agent": "plan", "node": "plan",
                   "lease": 60.0, "pid": 1, "source": "plan", "exclude": []})
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(r[0] for r in cur.fetchall())
        transaction.set_rollback(True)
    return plan


def _rows_read(plan: str, index: str) -> int:
    line = next(line for line in plan.splitlines() if f"using {index} on accs_task" in line)
    return int(line.split("rows=")[-1].split()[0])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("size", [20_000, pytest.param(200_000, marks=pytest.mark.slow)])
def test_the_claim_reads_its_index_and_about_as_many_rows_as_it_claims(make_service, size):
    """The real CLAIM_SQL, with a queue whose head holds retries in backoff and another node's host-bound tasks."""
    from bench.fixtures import fill_queue
    from nodes.models import Host, Node
    from tenants.models import Tenant

    svc = make_service("svc")
    tenant = Tenant.objects.get_or_create(slug="default", defaults={"name": "Default"})[0]
    Node.objects.create(name="other-node")
    Node.objects.create(name="plan")
    other_host = Host.objects.create(name="other-host", node_id="other-node")
    own_host = Host.objects.create(name="own-host", node_id="plan")
    with connection.cursor() as cur:
        fill_queue(cur, n=size, tenant_id=tenant.id, service_id=svc.id, other_host_id=other_host.id)
        cur.execute("ANALYZE accs_task")
    plan = _claim_plan(svc, hosts=[own_host.id])
    assert "Seq Scan on accs_task" not in plan, plan
    assert "using task_claim_idx on accs_task" in plan, plan
    # 10 claimed; the backoff and host-bound rows at the head are not in this index at all.
    assert _rows_read(plan, "task_claim_idx") <= 10, plan


@pytest.mark.django_db(transaction=True)
def test_the_claim_with_per_key_limits_reads_its_index_and_passes_over_full_keys(make_service):
    """The keyed claim (rate and cap per customer) finds tasks by key and never scans the task table."""
    from bench.fixtures import fill_queue
    from nodes.models import Host, Node
    from tenants.models import Tenant

    svc = make_service("keyed", rate_key="customer", rate_key_limit=50, concurrency_key="customer",
                       concurrency_key_limit=1)
    tenant = Tenant.objects.get_or_create(slug="default", defaults={"name": "Default"})[0]
    Node.objects.create(name="other-node")
    other_host = Host.objects.create(name="other-host", node_id="other-node")
    with connection.cursor() as cur:
        fill_queue(cur, n=20_000, tenant_id=tenant.id, service_id=svc.id, other_host_id=other_host.id)
        cur.execute("UPDATE accs_task SET params = jsonb_build_object('customer', 'c' || (order_seq % 50))")
        # Every table the keyed claim reads, so its plan comes from this queue: a table's statistics
        # outlive the TRUNCATE between tests, and an earlier test's key rows could choose the plan.
        cur.execute("ANALYZE accs_task, accs_limit_key_head, accs_limit_key_held, accs_rate_start")
    svc.refresh_from_db()
    plan = _claim_plan(svc, hosts=[])
    assert "Seq Scan on accs_task" not in plan, plan
    assert "using limit_key_head_order_idx on accs_limit_key_head" in plan, plan
    assert "using task_limit_key_idx on accs_task" in plan, plan
    assert _rows_read(plan, "task_limit_key_idx") <= 10 + 8, "a key's first task, for each key read"


def test_retried_dead_letter_task_runs_again_with_fresh_budget_and_new_attempt_numbers(make_service):
    svc = make_service("once", max_attempts=1)
    job = api.start_service("once")
    first = claim_for(svc)
    run_fail(first)
    job.refresh_from_db()
    assert job.status == "error"
    assert transitions.retry_job(job.id, by="op").changed
    again = claim_for(svc)
    assert [t.attempt for t in again] == [2], "attempt numbers never go back"
    late = transitions.report([transitions.Outcome(task_id=first[0].id, attempt=1, status="succeeded")], source="x")
    assert late.fenced == [first[0].id], "a report from the old attempt stays fenced"
    run_ok(again)
    job.refresh_from_db()
    assert job.status == "done"
    assert list(Attempt.objects.filter(task__job=job).order_by("attempt_no").values_list("attempt_no", "status")) == [
        (1, "failed"), (2, "succeeded")]


def _status(job) -> str:
    return Job.objects.values_list("status", flat=True).get(pk=job.pk)


def test_a_job_is_running_only_while_a_task_of_it_is_starting_or_running(make_service):
    """Job status words: tasks created → waiting; a task started → running; its last held task ended → waiting."""
    svc = make_service("fan", max_attempts=2, backoff_base_seconds=30, backoff_cap_seconds=30)
    create_workflow(name="pair", steps=[{"key": "a", "service": "fan", "depends_on": []},
                                        {"key": "b", "service": "fan", "depends_on": []}])
    job = api.start_workflow("pair")
    idle = [api.start_service("fan") for _ in range(3)]
    assert _status(job) == "waiting" and {_status(j) for j in idle} == {"waiting"}
    claimed = [t for t in claim_for(svc, n=10) if t.job_id == job.id]
    assert len(claimed) == 2 and _status(job) == "waiting", "claimed but not started: still waiting"
    transitions.mark_running([(t.id, t.attempt, 1) for t in claimed], agent_id="agent-t", source="agent:test")
    assert _status(job) == "running"
    done, failing = claimed
    transitions.report([transitions.Outcome(task_id=done.id, attempt=done.attempt, status="succeeded")],
                       agent_id="agent-t", source="agent:test")
    assert _status(job) == "running", "the other task still runs"
    result = transitions.report([transitions.Outcome(task_id=failing.id, attempt=failing.attempt, status="failed")],
                                agent_id="agent-t", source="agent:test")
    assert result.retried == [failing.id]
    assert _status(job) == "waiting", "its retry waits out its backoff: nothing of the job runs"
    assert {_status(j) for j in idle} == {"waiting"}, "never-claimed jobs never show running"
    moves = [(line.data["from"], line.data["to"])
             for e in Event.objects.filter(job_id=job.id, type="status").order_by("id")
             for line in unfold(e) if line.task_id is None]
    assert moves == [("created", "queued"), ("queued", "waiting"), ("waiting", "running"), ("running", "waiting")]


def test_progress_is_kept_on_the_task_and_only_quarter_milestones_reach_the_timeline(make_service):
    svc = make_service("slow")
    api.start_service("slow")
    [task] = claim_for(svc)
    transitions.mark_running([(task.id, task.attempt, 1)], agent_id="agent-t", source="agent:test")
    for p in (0.05, 0.1, 0.2, 0.26, 0.3, 0.49, 0.51, 0.8, 0.9):
        assert transitions.report_progress([(task.id, task.attempt, p)], source="agent:test") == 1
    assert Task.objects.get(pk=task.id).progress == pytest.approx(0.9)
    milestones = list(
        Event.objects.filter(task_id=task.id, type="progress").order_by("id").values_list("message", flat=True))
    assert milestones == ["progress reached 25 %", "progress reached 50 %", "progress reached 75 %"]
    assert transitions.report_progress([(task.id, task.attempt + 1, 0.95)], source="agent:test") == 0, "fenced"
