"""Agents and builders as real processes: races, every claim limit (per node, service, host, key), crashes,
fencing, timeouts.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import psycopg
import pytest

from events.models import Event
from jobs import api, transitions
from jobs.models import Attempt, Job, Task
from nodes import verbs as node_verbs
from nodes.models import Host, HostBlock, Node
from tenants.models import Tenant
from tests.daemons import Sampler, wait_all_final, wait_for, wait_until
from workflows.api import create_workflow

pytestmark = pytest.mark.django_db(transaction=True)

SLEEP = {"executor": "python", "executor_config": {"callable": "tests.callables:sleep"},
         "params_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}}}
HELD = "status IN ('starting', 'running')"


def sleep_service(make_service, key: str = "slow", **fields):
    return make_service(key, **{**SLEEP, **fields})


def jobs_of(service_key: str, n: int, seconds: float = 0.3, **options) -> list:
    return [api.start_service(service_key, params={"seconds": seconds}, **options) for _ in range(n)]


@pytest.mark.slow
def test_four_agents_race_2000_tasks_each_done_exactly_once_in_order(make_service, daemons, db_url):
    make_service("race")
    api.start_many([api.JobSpec(service="race", params={}) for _ in range(2000)])
    # The tasks are queued once all four agents run, so they race for them from the first claim.
    agents = daemons.agents_together([f"race-{i}" for i in range(4)], "race", "--max-concurrent", "16")
    assert len(transitions.start_due_jobs(limit=5000)) == 2000
    wait_for(lambda: Task.objects.filter(status="done").count() == 2000, timeout=180, message="2000 tasks done")
    for proc in agents:
        proc.terminate()
    for proc in agents:
        assert proc.wait(timeout=60) == 0, proc.log_path.read_text()[-2000:]
    assert Task.objects.filter(status="done").count() == 2000
    assert Task.objects.exclude(attempt=1).count() == 0, "no task was claimed twice"
    assert Attempt.objects.count() == 2000 and Attempt.objects.filter(status="succeeded").count() == 2000
    assert not Event.objects.filter(type="fenced").exists()
    claims = Event.objects.filter(message="task queued → starting").values_list("task_id", "ts", "data")
    per_task = defaultdict(int)
    batches = defaultdict(list)
    seq = dict(Task.objects.values_list("id", "order_seq"))
    for task_id, ts, data in claims:
        per_task[task_id] += 1
        batches[(data["agent"], ts)].append(seq[task_id])
    assert len(per_task) == 2000 and set(per_task.values()) == {1}, "every task claimed by exactly one agent"
    agents_seen = {agent for agent, _ in batches}
    assert len(agents_seen) == 4, "all four agents took part"
    for agent in agents_seen:
        mine = sorted((ts, sorted(s)) for (a, ts), s in batches.items() if a == agent)
        heads = [s[0] for _, s in mine]
        assert heads == sorted(heads), f"{agent}: each claim batch starts after the previous one (global order)"
    assert Job.objects.filter(status="done").count() == 2000


def test_per_node_per_service_cap(make_service, daemons, db_url):
    svc = sleep_service(make_service)
    Node.objects.create(name="n1", max_concurrency={"slow": 2})
    jobs_of("slow", 8)
    held_on_n1 = f"SELECT count(*) FROM accs_task WHERE {HELD} AND node = 'n1' AND service_id = %s"
    with Sampler(db_url, held_on_n1, (svc.id,)) as s:
        daemons.agent("n1", "slow", "--max-concurrent", "6")
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [2]


def test_node_slot_cap_is_min_of_cap_and_eligible_hosts(make_service, daemons, db_url):
    sleep_service(make_service)
    node = Node.objects.create(name="n1", slot_cap=20)
    for i in range(3):
        Host.objects.create(name=f"h{i}", node=node)
    from django.utils import timezone
    Host.objects.create(name="bad", node=node, status="error", quarantined_at=timezone.now())
    jobs_of("slow", 9)
    with Sampler(db_url, f"SELECT count(*) FROM accs_task WHERE {HELD} AND node = 'n1'") as s:
        daemons.agent("n1", "slow", "--max-concurrent", "10")
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [3], "3 eligible hosts (the quarantined one does not count) cap the node at 3 slots"


def test_node_cpu_weight_budget(make_service, daemons, db_url):
    sleep_service(make_service, cpu_weight=3)
    Node.objects.create(name="n1", cpu_budget=8)
    jobs_of("slow", 6)
    with Sampler(db_url, f"SELECT count(*) FROM accs_task WHERE {HELD} AND node = 'n1'") as s:
        daemons.agent("n1", "slow", "--max-concurrent", "10")
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [2], "weight 3 × 2 = 6 ≤ 8 < 9"


def test_service_global_max_concurrent_across_nodes(make_service, daemons, db_url):
    svc = sleep_service(make_service, max_concurrent=3)
    with Sampler(db_url, f"SELECT count(*) FROM accs_task WHERE {HELD} AND service_id = %s", (svc.id,)) as s:
        # Two slots per node: reaching 3 needs both nodes, and the global cap keeps it at 3, not 4. Both
        # are up before the work arrives, so neither drains it alone while the other starts.
        daemons.agent("n1", "slow", "--max-concurrent", "2")
        daemons.agent("n2", "slow", "--max-concurrent", "2")
        jobs_of("slow", 12)
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [3]


def test_one_running_task_per_exclusive_host(make_service, daemons, db_url):
    sleep_service(make_service, exclusive_per_host=True)
    node = Node.objects.create(name="n1")
    for name in ("h1", "h2"):
        Host.objects.create(name=name, node=node)
    create_workflow(name="fleet", steps=[{"key": "op", "service": "slow", "fan_out": "hosts",
                                          "default_params": {"seconds": 0.2}}])
    for _ in range(4):
        api.start_workflow("fleet", options={"hosts": ["h1", "h2"]})
    sql = (f"SELECT coalesce(max(c), 0), coalesce(sum(c), 0) FROM (SELECT count(*) c FROM accs_task"
           f" WHERE {HELD} GROUP BY host_id) x")
    with Sampler(db_url, sql) as s:
        daemons.agent("n1", "slow", "--max-concurrent", "8")
        wait_all_final(db_url, timeout=60)
    assert s.maxima[0] == 1, "never two held tasks on one exclusive host"
    assert s.maxima[1] == 2, "both hosts worked in parallel"
    assert Task.objects.filter(status="done").count() == 8


def test_workflow_max_active_jobs_one_runs_strictly_one_job_oldest_first(make_service, daemons, db_url):
    sleep_service(make_service)
    wf = create_workflow(name="serial", max_active_jobs=1,
                         steps=[{"key": "a", "service": "slow", "default_params": {"seconds": 0.2}},
                                {"key": "b", "service": "slow", "depends_on": ["a"],
                                 "default_params": {"seconds": 0.1}}])
    jobs = [api.start_workflow("serial") for _ in range(4)]
    assert all(j.status == "queued" for j in jobs), "limited workflows are started by the builder"
    with Sampler(db_url, "SELECT count(*) FROM accs_job WHERE status = 'running' AND workflow_id = %s", (wf.id,)) as s:
        daemons.builder()
        daemons.agent("n1", "slow", "--max-concurrent", "4")
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [1]
    started = list(Job.objects.order_by("started_at").values_list("order_seq", flat=True))
    assert started == sorted(started), "oldest first"


def test_tenant_max_in_flight(make_service, daemons, db_url):
    sleep_service(make_service)
    tenant = Tenant.objects.create(slug="acme", name="Acme", max_in_flight=2)
    jobs_of("slow", 6, tenant=tenant)
    with Sampler(db_url, "SELECT count(*) FROM accs_job WHERE status = 'running' AND tenant_id = %s",
                 (tenant.id,)) as s:
        daemons.builder()
        daemons.agent("n1", "slow", "--max-concurrent", "6")
        wait_all_final(db_url, timeout=60)
    assert s.maxima == [2]


def test_host_block_makes_task_blocked_and_it_never_runs(make_service, daemons, db_url):
    svc = sleep_service(make_service)
    node = Node.objects.create(name="n1")
    h1, _h2 = Host.objects.create(name="h1", node=node), Host.objects.create(name="h2", node=node)
    HostBlock.objects.create(host=h1, service=svc, reason="maintenance")
    create_workflow(name="fleet", steps=[{"key": "op", "service": "slow", "fan_out": "hosts",
                                          "default_params": {"seconds": 0.05}}])
    job = api.start_workflow("fleet", options={"hosts": ["h1", "h2"]})
    daemons.agent("n1", "slow")
    wait_all_final(db_url, timeout=30)
    statuses = dict(Task.objects.filter(job=job).values_list("task_key", "status"))
    assert statuses == {"op@h1": "blocked", "op@h2": "done"}
    assert not Attempt.objects.filter(task__task_key="op@h1").exists()
    job.refresh_from_db()
    assert job.status == "partial" and "1 of 2" in job.error_message, "a blocked host is never a plain done"


def test_quarantined_host_gets_no_work_until_cleared(make_service, daemons, db_url):
    from django.utils import timezone

    sleep_service(make_service)
    node = Node.objects.create(name="n1")
    bad = Host.objects.create(name="h1", node=node, status="error", quarantined_at=timezone.now())
    Host.objects.create(name="h2", node=node)
    create_workflow(name="fleet", steps=[{"key": "op", "service": "slow", "fan_out": "hosts",
                                          "default_params": {"seconds": 0.05}}])
    api.start_workflow("fleet", options={"hosts": ["h1", "h2"]})
    daemons.agent("n1", "slow", "--poll-interval", "0.2")
    wait_until(lambda: Task.objects.filter(task_key="op@h2", status="done").exists(), timeout=30, message="h2 done")
    # A later job on h2, run to its end: the agent claimed again after h1's task was queued (and h1's
    # task comes first in order), so it had its chance at h1's task and passed it over.
    later = api.start_workflow("fleet", options={"hosts": ["h2"]})
    wait_until(lambda: Job.objects.filter(pk=later.pk, status="done").exists(), timeout=30,
               message="the later h2 job done")
    assert Task.objects.get(task_key="op@h1").status == "queued"
    assert node_verbs.clear_quarantine(bad.id, by="test").changed
    wait_all_final(db_url, timeout=30)
    assert Task.objects.get(task_key="op@h1").status == "done"


def test_final_failure_quarantines_host(make_service, daemons, db_url):
    make_service("broken", executor_config={"callable": "tests.callables:fail"}, max_attempts=1,
                 quarantine_host_on_final_failure=True)
    node = Node.objects.create(name="n1")
    Host.objects.create(name="h1", node=node)
    create_workflow(name="fleet", steps=[{"key": "op", "service": "broken", "fan_out": "hosts"}])
    api.start_workflow("fleet", options={"hosts": ["h1"]})
    daemons.agent("n1", "broken")
    wait_all_final(db_url, timeout=30)
    host = Host.objects.get(name="h1")
    assert host.status == "error" and "failed for good" in host.quarantine_reason


def _long_command(make_service, key: str = "long", *, first_seconds: float = 30, timeout: int = 600):
    script = (f"import os, time; time.sleep({first_seconds} if os.environ['ACCS_ATTEMPT'] == '1' else 0.05); "
              "print(chr(123) + chr(125))")
    return make_service(key, executor="command", executor_config={"argv": ["python", "-c", script]},
                        timeout_seconds=timeout, backoff_base_seconds=0, backoff_cap_seconds=0)


def test_killed_agent_task_is_rescued_after_lease_and_completed_elsewhere(make_service, daemons, db_url):
    _long_command(make_service)
    job = api.start_service("long")
    victim = daemons.agent("n1", "long", "--lease-seconds", "3")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="task running")
    child_pid = Attempt.objects.get(task__job=job, attempt_no=1).pid
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    try:
        daemons.builder()
        daemons.agent("n2", "long", "--lease-seconds", "3")
        wait_all_final(db_url, timeout=60)
    finally:
        if child_pid:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    job.refresh_from_db()
    assert job.status == "done"
    attempts = {a.attempt_no: a for a in Attempt.objects.filter(task__job=job)}
    assert attempts[1].status == "failed" and attempts[1].error_text.startswith("lease_expired")
    assert attempts[2].status == "succeeded" and attempts[2].node == "n2"


def test_frozen_agent_late_report_is_fenced_and_recorded(make_service, daemons, db_url):
    sleep_service(make_service, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service("slow", params={"seconds": 1.5})
    frozen = daemons.agent("n1", "slow", "--lease-seconds", "3")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="task running")
    frozen.send_signal(signal.SIGSTOP)
    daemons.builder()
    daemons.agent("n2", "slow", "--lease-seconds", "3")
    wait_all_final(db_url, timeout=60)
    frozen.send_signal(signal.SIGCONT)
    event = wait_until(lambda: Event.objects.filter(type="fenced", task__job=job).first(), timeout=20,
                       message="the frozen agent's late report is fenced")
    assert event.attempt == 1 and event.data["current_attempt"] == 2
    task = Task.objects.get(job=job)
    assert (task.status, task.attempt, task.node) == ("done", 2, "n2"), "the late report changed nothing"


def test_task_over_its_timeout_is_killed_with_its_children_and_retried(make_service, daemons, db_url):
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print('child', p.pid, file=sys.stderr, flush=True); time.sleep(60)")
    make_service("hang", executor="command", executor_config={"argv": ["python", "-c", script]}, timeout_seconds=1,
                 max_attempts=2, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service("hang")
    daemons.agent("n1", "hang")
    wait_all_final(db_url, timeout=60)
    attempts = list(Attempt.objects.filter(task__job=job).order_by("attempt_no"))
    assert [a.status for a in attempts] == ["timeout", "timeout"], "a timeout is retried like a failure"
    assert all("timeout" in a.error_text for a in attempts)
    children = [int(m.split()[1]) for m in Event.objects.filter(job_id=job.id, type="log", message__startswith="child ")
                .values_list("message", flat=True)]
    assert len(children) == 2

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as fh:
                return "State:\tZ" in fh.read()
        except FileNotFoundError:
            return True

    wait_until(lambda: all(gone(pid) for pid in children), timeout=10, message="child processes killed")
    job.refresh_from_db()
    assert job.status == "error"


LISTENING_SQL = ("SELECT count(*) FROM pg_stat_activity"
                 " WHERE application_name = %s AND query LIKE 'LISTEN%%' AND state = 'idle'")


def _listening(db_url: str, node: str) -> bool:
    """True once the agent's LISTEN connection has run its LISTEN and sits idle (a NOTIFY now reaches it)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute(LISTENING_SQL, (f"accs agent {node} listen",)).fetchone()[0] > 0


def test_notify_wakes_idle_agent_long_before_its_poll(make_service, daemons, db_url):
    make_service("quick")
    daemons.agent("n1", "quick", "--poll-interval", "30")
    wait_until(lambda: _listening(db_url, "n1"), timeout=20,
               message="the agent LISTENs (it opens LISTEN as it first waits)")
    job = api.start_service("quick")
    wait_until(lambda: Job.objects.filter(pk=job.pk, status="done").exists(), timeout=5,
               message="done within 5 s although the agent polls every 30 s")


def test_sigterm_drains_running_task_then_exits(make_service, daemons, db_url):
    sleep_service(make_service)
    job = api.start_service("slow", params={"seconds": 1.0})
    proc = daemons.agent("n1", "slow")
    wait_until(lambda: Task.objects.filter(job=job, status="running").exists(), timeout=20, message="task running")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    job.refresh_from_db()
    assert job.status == "done", "the running task finished before the agent exited"


def test_command_contract_results_logs_progress(make_service, daemons, db_url):
    script = ("import sys, json; print('::progress:: 0.5', file=sys.stderr); print('line one', file=sys.stderr); "
              "print('token=s3cr3t-value', file=sys.stderr); print(json.dumps({{'n': int(sys.argv[1]) * 2}}))")
    make_service("dbl", executor="command", executor_config={"argv": ["python", "-c", script, "{n}"]},
                 params_schema={"type": "object",
                                "properties": {"n": {"type": "integer"}, "api_token": {"type": "string"}}})
    job = api.start_service("dbl", params={"n": 21, "api_token": "s3cr3t-value"})
    daemons.agent("n1", "dbl")
    wait_all_final(db_url, timeout=30)
    task = Task.objects.get(job=job)
    assert task.results == {"n": 42}
    logs = list(Event.objects.filter(task=task, type="log").order_by("id").values_list("message", flat=True))
    assert logs == ["line one", "token=***"], "stderr lines become log events in order, secrets redacted"
    assert "s3cr3t" not in Attempt.objects.get(task=task).stderr_tail
    assert Event.objects.filter(task=task, type="progress").exists() or task.progress == 1


@pytest.mark.django_db(transaction=True)
def test_the_agent_defers_services_blocked_by_a_governor_condition_until_it_clears(make_service, daemons, db_url):
    make_service("heavy", block_during=["live_session"])
    make_service("light")
    api.raise_condition("live_session", reason="studio is live", by="test")
    heavy = [api.start_service("heavy") for _ in range(2)]
    light = [api.start_service("light") for _ in range(2)]
    daemons.agent("gov", "heavy,light", "--poll-interval", "0.2")
    wait_for(lambda: Job.objects.filter(pk__in=[j.pk for j in light], status="done").count() == 2, timeout=30,
             message="the agent runs the unblocked service")
    # One claim covers both services: had heavy not been blocked, it would have gone with light.
    assert not Attempt.objects.filter(task__job__in=heavy).exists(), "a blocked service was claimed"
    api.clear_condition("live_session", by="test")
    wait_for(lambda: Job.objects.filter(pk__in=[j.pk for j in heavy], status="done").count() == 2, timeout=30,
             message="the blocked service runs once the condition clears")
