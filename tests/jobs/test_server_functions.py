"""The claim, the report of successes and job finalisation as server-side functions.

Each function is built from the statements its module holds and created by a migration; these
tests keep the two the same, pin the hot paths to one statement each, and check the behaviour the
functions must share with the general paths (the lock order, fencing, every transition's event).
"""

from __future__ import annotations

import re
import threading

import pytest
from django.db import connection, connections, transaction

from events.models import Event
from events.timeline import unfold
from jobs import api, transitions
from jobs.claim import (
    KEYED_CLAIM_FUNCTION,
    PLAIN_CLAIM_FUNCTION,
    NodeLimits,
    claim_many,
    claim_round,
    keyed_claim_function_sql,
    plain_claim_function_sql,
    service_spec,
)
from jobs.enqueue import (
    NARROW_START_FUNCTION,
    START_FUNCTION,
    narrow_start_function_sql,
    start_function_sql,
    widen_function_sql,
)
from jobs.finalize import FINALIZE_FUNCTION, finalize_function_sql
from jobs.inputs import JSONPATH_FUNCTION, STEP_INPUTS_FUNCTION, jsonpath_function_sql, step_inputs_function_sql
from jobs.models import Task
from jobs.narrow import WIDEN_FUNCTION
from jobs.reports import REPORT_FUNCTION, report_function_sql
from tests.engine_helpers import NODE, claim_for, run_ok
from workflows.api import create_workflow
from workflows.models import Service

pytestmark = pytest.mark.django_db


def _body(create_sql: str) -> str:
    """Return the body of a CREATE FUNCTION statement (between its dollar quotes)."""
    match = re.search(r"AS \$(\w+)\$\n(.*)\$\1\$", create_sql, re.S)
    assert match, "no dollar-quoted body"
    return match.group(2)


@pytest.mark.parametrize(("name", "build"), [(PLAIN_CLAIM_FUNCTION, plain_claim_function_sql),
                                             (KEYED_CLAIM_FUNCTION, keyed_claim_function_sql),
                                             (FINALIZE_FUNCTION, finalize_function_sql),
                                             (REPORT_FUNCTION, report_function_sql),
                                             (STEP_INPUTS_FUNCTION, step_inputs_function_sql),
                                             (JSONPATH_FUNCTION, jsonpath_function_sql),
                                             (START_FUNCTION, start_function_sql),
                                             (NARROW_START_FUNCTION, narrow_start_function_sql),
                                             (WIDEN_FUNCTION, widen_function_sql)])
def test_the_database_function_runs_the_statements_the_code_holds_now(name, build):
    """A change to a statement the function copies needs a migration that replaces the function."""
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc, proconfig FROM pg_proc WHERE proname = %s", [name])
        rows = cur.fetchall()
    assert len(rows) == 1, f"{name} is missing or overloaded: {len(rows)} definitions"
    assert rows[0][0].strip() == _body(build()).strip(), (
        f"{name} differs from what the code builds: add a migration replacing it")
    # The settings the function runs under (its SET clauses) are the code's too.
    settings = dict(item.split("=", 1) for item in rows[0][1] or [])
    assert settings == dict(re.findall(r"^SET (\w+) = (\w+)", build().split("\nAS $")[0], re.M)), settings


@pytest.mark.parametrize("build", [plain_claim_function_sql, keyed_claim_function_sql, finalize_function_sql,
                                   report_function_sql, step_inputs_function_sql, start_function_sql,
                                   narrow_start_function_sql, widen_function_sql])
def test_the_functions_plan_once_and_never_compile(build):
    """Generic plans (planned once per connection) whose estimated cost grows with the backlog: with
    JIT on, a claim with 100k tasks queued compiled its expressions at every call (1.4 s instead of 3 ms)."""
    header = build().split("\nAS $")[0]
    assert re.search(r"^SET plan_cache_mode = force_generic_plan$", header, re.M)
    assert re.search(r"^SET jit = off\b", header, re.M)


def test_a_plain_claim_is_one_statement(make_service, django_assert_num_queries):
    svc = make_service("fn-plain")
    for i in range(3):
        api.start_service("fn-plain", params={"n": i})
    with django_assert_num_queries(1):
        tasks = claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=2, lease_seconds=60)
    assert len(tasks) == 2
    claimed = Task.objects.filter(id__in=[t.id for t in tasks])
    assert {t.status for t in claimed} == {"starting"} and {t.claimed_by for t in claimed} == {"agent-fn"}
    assert Event.objects.filter(task_id__in=[t.id for t in tasks], message="task queued → starting").count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_plain_claim_finds_its_services_work_without_reading_other_services_tasks(make_service):
    """The look for a service's queued work probes its index: planned generically from statistics that
    say half the tasks are this service's queued ones, an EXISTS read the table from its start, past
    every task of the service stored before them (11 ms a claim behind 50,000)."""
    ahead, behind = make_service("fn-ahead"), make_service("fn-behind")
    for key in ("fn-ahead", "fn-behind"):
        api.start_many([api.JobSpec(service=key, params={"n": i}) for i in range(1500)])
        transitions.start_due_jobs(limit=10_000)
    with connection.cursor() as cur:
        cur.execute("ANALYZE accs_task")
    connection.close()  # a new server connection plans the function's statements from these statistics
    reads = "SELECT seq_scan, seq_tup_read FROM pg_stat_xact_user_tables WHERE relname = 'accs_task'"
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(reads)
        before = cur.fetchone()
        tasks = claim_many([service_spec(behind)], NODE, agent_id="agent-fn", free_slots=2, lease_seconds=60)
        cur.execute(reads)
        scanned = tuple(after - b for after, b in zip(cur.fetchone(), before, strict=True))
    assert len(tasks) == 2 and ahead.id != behind.id
    assert scanned == (0, 0), f"the claim scanned the task table: (scans, rows read) {scanned}"


@pytest.mark.django_db(transaction=True)
def test_a_report_finds_its_tasks_waiting_jobs_without_reading_the_other_waiting_jobs(make_service):
    """The reported tasks' jobs move to running by their ids: planned generically from statistics taken when
    no job waited (a burst that had ended), the look walked every waiting job instead (166 ms a report
    behind 12,800, for as long as the connection lived)."""
    svc = make_service("fn-run")
    api.start_many([api.JobSpec(service="fn-run", params={"n": i}) for i in range(20)])
    transitions.start_due_jobs(limit=100)
    run_ok(claim_for(svc, n=20))
    with connection.cursor() as cur:
        cur.execute("ANALYZE accs_job")  # every job done
    api.start_many([api.JobSpec(service="fn-run", params={"n": i}) for i in range(1500)])
    transitions.start_due_jobs(limit=10_000)  # 1,500 jobs waiting
    connection.close()  # a new server connection plans the function's statements from those statistics
    tasks = claim_for(svc, n=2)
    reads = "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables WHERE relname = 'accs_job'"
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(reads)
        before = cur.fetchone()[0]
        assert run_ok(tasks).done == [t.id for t in tasks]
        cur.execute(reads)
        read = cur.fetchone()[0] - before
    # (The walk read every waiting job, 1,500 twice; by id, a few rows per job moved, as the plan goes.)
    assert read < 100, f"the report read {read} job rows to move 2 jobs of 1,500 waiting"


@pytest.mark.parametrize("limits", [{"concurrency_key": "customer", "concurrency_key_limit": 1},
                                    {"rate_key": "customer", "rate_key_limit": 1},
                                    {"rate_limit": 3, "max_concurrent": 5}],
                         ids=["per-key cap", "per-key rate", "capped and rated"])
def test_a_keyed_or_rated_claim_is_one_statement_under_its_limits(make_service, django_assert_num_queries, limits):
    """The keyed claim function: the limits, locks, held counts, claim and settling in one round trip."""
    svc = make_service("fn-keyed", **limits)
    for i in range(6):
        api.start_service("fn-keyed", params={"customer": f"c{i % 2}"})
    with django_assert_num_queries(1):
        tasks = claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60)
    assert len(tasks) == (2 if "rate_key" in limits or "concurrency_key" in limits else 3)
    assert len({t.params["customer"] for t in tasks}) == len(tasks) or "rate_limit" in limits
    with django_assert_num_queries(1):
        again = claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60)
    assert again == [], "every key (or the service's rate) is at its limit"


def test_a_report_of_successes_is_one_statement_and_writes_every_transition(make_service, django_assert_num_queries):
    make_service("fn-a"), make_service("fn-b")
    create_workflow(name="fn-wf", steps=[{"key": "a", "service": "fn-a", "depends_on": []},
                                         {"key": "b", "service": "fn-b", "depends_on": ["a"]}])
    job = api.start_workflow("fn-wf")
    tasks = claim_for(Service.objects.get(key="fn-a"))
    with django_assert_num_queries(2):  # the function, and the NOTIFY for the promoted step
        result = run_ok(tasks)
    assert result.done == [tasks[0].id]
    messages = [line.message for e in Event.objects.filter(job_id=job.id).order_by("id") for line in unfold(e)]
    for expected in ("job waiting → running", "task starting → running", "task running → done",
                     "task waiting → queued"):
        assert expected in messages, (expected, messages)
    b = Task.objects.get(job=job, step_key="b")
    assert b.status == "queued"
    run_ok(claim_for(Service.objects.get(key="fn-b")))
    job.refresh_from_db()
    assert job.status == "done" and job.progress == 1


def test_a_late_success_from_a_fenced_attempt_changes_nothing_and_is_recorded(make_service):
    svc = make_service("fn-fence")
    api.start_service("fn-fence")
    first = claim_for(svc)
    Task.objects.filter(id=first[0].id).update(attempt=first[0].attempt + 1)  # a newer attempt took over
    result = run_ok(first)
    assert result.done == [] and result.fenced == [first[0].id]
    assert Task.objects.get(id=first[0].id).status == "starting"
    assert Event.objects.filter(task_id=first[0].id, type="fenced").count() == 1


def test_a_repeated_success_report_is_known_as_a_repeat(make_service):
    svc = make_service("fn-repeat")
    api.start_service("fn-repeat")
    tasks = claim_for(svc)
    assert run_ok(tasks).done == [tasks[0].id]
    again = run_ok(tasks)
    assert again.done == [] and again.repeated == [tasks[0].id] and again.fenced == []


def test_a_service_that_gained_a_cap_is_claimed_under_it_despite_a_stale_spec(make_service):
    svc = make_service("fn-capped")
    for i in range(4):
        api.start_service("fn-capped", params={"n": i})
    stale = service_spec(svc)
    Service.objects.filter(id=svc.id).update(max_concurrent=1)
    tasks = claim_many([stale], NODE, agent_id="agent-fn", free_slots=4, lease_seconds=60)
    assert len(tasks) == 1


def test_the_node_slot_cap_counts_work_held_by_the_nodes_other_agents(make_service):
    svc = make_service("fn-slots")
    for i in range(6):
        api.start_service("fn-slots", params={"n": i})
    limits = NodeLimits(name="node-fn", slot_cap=3, cpu_budget=100, per_service={})
    first = claim_many([service_spec(svc)], limits, agent_id="agent-1", free_slots=2, lease_seconds=60)
    second = claim_many([service_spec(svc)], limits, agent_id="agent-2", free_slots=5, lease_seconds=60)
    assert (len(first), len(second)) == (2, 1)


@pytest.mark.django_db(transaction=True)
def test_two_agents_claiming_at_once_never_take_the_same_task(make_service):
    svc = make_service("fn-race")
    api.start_many([api.JobSpec(service="fn-race", params={"n": i}) for i in range(40)])
    while transitions.start_due_jobs(limit=100):
        pass
    got: dict[str, list] = {}
    barrier = threading.Barrier(2)

    def agent(name: str) -> None:
        try:
            barrier.wait()
            tasks = []
            for _ in range(10):
                tasks += claim_many([service_spec(svc)], NodeLimits(name=f"node-{name}", slot_cap=100, cpu_budget=100,
                                                                     per_service={}),
                                    agent_id=name, free_slots=3, lease_seconds=60)
            got[name] = tasks
        finally:
            connections.close_all()

    threads = [threading.Thread(target=agent, args=(n,)) for n in ("a1", "a2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ids = [t.id for tasks in got.values() for t in tasks]
    assert len(ids) == len(set(ids)) == 40


def test_a_capped_claim_is_one_statement_and_stops_at_the_cap(make_service, django_assert_num_queries):
    svc = make_service("fn-cap-one", max_concurrent=3)
    for i in range(5):
        api.start_service("fn-cap-one", params={"n": i})
    with django_assert_num_queries(1):
        first = claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=2, lease_seconds=60)
    with django_assert_num_queries(1):
        second = claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60)
    assert (len(first), len(second)) == (2, 1), "the fleet-wide cap of 3 leaves room for one more"
    assert claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60) == []
    run_ok(first[:1])  # a finish frees room for the next claim
    assert len(claim_many([service_spec(svc)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60)) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("try_capped", [False, True], ids=["waiting", "trying"])
def test_claimers_of_a_capped_service_racing_from_many_nodes_never_pass_its_cap(make_service, try_capped):
    """Eight claimers on eight nodes, each with room for 5, race for a service capped at 12, waiting
    for its lock (direct) or trying it (behind a pooler) and claiming again while it is busy."""
    svc = make_service("fn-cap-race", max_concurrent=12)
    api.start_many([api.JobSpec(service="fn-cap-race", params={"n": i}) for i in range(60)])
    while transitions.start_due_jobs(limit=100):
        pass
    got: dict[str, list] = {}
    barrier = threading.Barrier(8)

    def agent(name: str) -> None:
        limits = NodeLimits(name=f"node-{name}", slot_cap=100, cpu_budget=100, per_service={})
        try:
            barrier.wait()
            # As an agent does: a claim that found the service's lock busy is made again.
            got[name] = []
            while True:
                answer = claim_round([service_spec(svc)], limits, agent_id=name, free_slots=5 - len(got[name]),
                                     lease_seconds=60, try_capped=try_capped)
                got[name] += answer.tasks
                if not answer.contended:
                    break
        finally:
            connections.close_all()

    threads = [threading.Thread(target=agent, args=(f"c{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 8, "every claimer answered"
    ids = [t.id for tasks in got.values() for t in tasks]
    assert len(ids) == len(set(ids)) == 12, "exactly the cap, each task once"
    assert Task.objects.filter(service=svc, status__in=["starting", "running"]).count() == 12


def _claim_beside_held_locks(services, *, agent_id: str) -> list | None:
    """Claim ``services`` on NODE from a thread while the caller's connection holds some locks;
    None if the claim was still waiting for them 30 s later."""
    out: dict = {}

    def claim() -> None:
        try:
            out["tasks"] = claim_many([service_spec(s) for s in services], NODE, agent_id=agent_id, free_slots=5,
                                      lease_seconds=60)
        finally:
            connections.close_all()

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    thread.join(timeout=30)
    return None if thread.is_alive() else out["tasks"]


@pytest.mark.django_db(transaction=True)
def test_a_capped_service_with_nothing_to_claim_does_not_wait_for_its_lock(make_service, db_url):
    """Its claimers look first: with the cap full, or nothing queued, they leave it out at once
    instead of queueing for the lock another claimer holds, only to find nothing."""
    import psycopg

    empty = make_service("fn-cap-empty", max_concurrent=5)
    full = make_service("fn-cap-full", max_concurrent=1)
    api.start_many([api.JobSpec(service="fn-cap-full", params={"n": i}) for i in range(2)])
    while transitions.start_due_jobs(limit=100):
        pass
    assert len(claim_many([service_spec(full)], NODE, agent_id="agent-fn", free_slots=5, lease_seconds=60)) == 1
    holder = psycopg.connect(db_url)
    try:
        for svc in (empty, full):
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{svc.id}"])
        assert _claim_beside_held_locks([empty, full], agent_id="agent-fn2") == [], (
            "the claim queued for a lock it had no use for")
    finally:
        holder.rollback()
        holder.close()


@pytest.mark.django_db(transaction=True)
def test_a_claimer_trying_a_busy_capped_lock_leaves_the_service_out_and_says_so(make_service, db_url):
    """Behind a pooler a claimer only tries a capped service's lock (in line, it would hold a pooled
    server connection through the wait): it claims the rest of its services and names the busy
    one, to claim it again soon. Without ``try_capped`` the same claim waits for the lock."""
    import psycopg

    capped = make_service("fn-busy-capped", max_concurrent=5)
    plain = make_service("fn-busy-plain")
    api.start_service("fn-busy-capped", params={})
    api.start_service("fn-busy-plain", params={})
    both = [service_spec(capped), service_spec(plain)]
    out: dict = {}

    def claim(name: str, *, try_capped: bool) -> threading.Thread:
        def run() -> None:
            try:
                out[name] = claim_round(both, NODE, agent_id=name, free_slots=5, lease_seconds=60,
                                        try_capped=try_capped)
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    holder = psycopg.connect(db_url)
    try:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{capped.id}"])
        trying = claim("agent-try", try_capped=True)
        trying.join(timeout=30)
        assert not trying.is_alive(), "the claim queued for the capped service's lock"
        waiting = claim("agent-wait", try_capped=False)
        waiting.join(timeout=1)
        assert waiting.is_alive(), "without try_capped the claim waits for the lock"
    finally:
        holder.rollback()
        holder.close()
    waiting.join(timeout=30)
    assert [t.service_key for t in out["agent-try"].tasks] == ["fn-busy-plain"]
    assert out["agent-try"].contended == {capped.id}
    assert ([t.service_key for t in out["agent-wait"].tasks], out["agent-wait"].contended) == (
        ["fn-busy-capped"], frozenset()), "the waiting claim took the capped task once the lock was free"
    # With the lock free, a claim that tries it takes the capped service's work too.
    api.start_service("fn-busy-capped", params={})
    again = claim_round(both, NODE, agent_id="agent-try", free_slots=5, lease_seconds=60, try_capped=True)
    assert ([t.service_key for t in again.tasks], again.contended) == (["fn-busy-capped"], frozenset())


@pytest.mark.django_db(transaction=True)
def test_an_idle_poll_takes_no_lock_at_all(make_service, db_url):
    """With nothing queued for any of its services, capped or not, a claim returns before taking
    even its node's lock: the idle polls of a large fleet cost a look each, and never queue behind
    a busy claimer."""
    import psycopg

    capped = make_service("fn-idle-capped", max_concurrent=5)
    plain = make_service("fn-idle-plain")
    holder = psycopg.connect(db_url)
    try:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:node:{NODE.name}"])
        assert _claim_beside_held_locks([capped, plain], agent_id="agent-idle") == [], (
            "the idle poll queued for its node's lock")
    finally:
        holder.rollback()
        holder.close()
    # Once tasks are queued, the same claim takes them.
    api.start_service("fn-idle-capped", params={})
    api.start_service("fn-idle-plain", params={})
    got = claim_many([service_spec(capped), service_spec(plain)], NODE, agent_id="agent-idle", free_slots=5,
                     lease_seconds=60)
    assert sorted(t.service_key for t in got) == ["fn-idle-capped", "fn-idle-plain"]


@pytest.mark.django_db(transaction=True)
def test_a_claim_planned_on_stale_statistics_reads_each_hosts_head_through_its_index(make_service):
    """Statistics taken when nothing was queued (after a TRUNCATE, or a backlog that came and went) must not
    make the claim's plan, made once per connection, read each host's head through task_job_open_idx (every
    queued task, sorted per host: 150 ms a claim on a node of 500 hosts) instead of task_claim_host_idx."""
    from nodes.models import Host, Node

    svc = make_service("stale-stats")
    node = Node.objects.create(name="stale-node", slot_cap=1000, cpu_budget=1000)
    names = [Host.objects.create(name=f"stale-h{i}", node=node).name for i in range(100)]
    create_workflow(name="stale-fan", steps=[{"key": "a", "service": "stale-stats", "fan_out": "hosts"}])
    api.start_workflow("stale-fan", options={"hosts": names})
    with connection.cursor() as cur:  # a backlog that came and went, and the statistics taken then
        cur.execute("UPDATE accs_task SET status = 'done', finished_at = now()")
        cur.execute("ANALYZE accs_task")
    api.start_workflow("stale-fan", options={"hosts": names})
    connections.close_all()  # a new connection plans the claim afresh, on those statistics
    plans: list[str] = []
    with connection.cursor() as cur:
        cur.execute("LOAD 'auto_explain'")
        for setting, value in [("log_min_duration", "0"), ("log_nested_statements", "on"), ("log_level", "notice")]:
            cur.execute(f"SET auto_explain.{setting} = {value}")
    connection.connection.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    try:
        limits = NodeLimits("stale-node", 1000, 1000, {}, {})
        answer = claim_round([service_spec(svc)], limits, agent_id="stale-agent", free_slots=1, lease_seconds=60)
    finally:
        connections.close_all()  # auto_explain stays with that connection
    assert len(answer.tasks) == 1
    claim_plan = "\n".join(p for p in plans if "bound_seen" in p or "task_claim_host_idx" in p)
    assert "using task_claim_host_idx on accs_task" in claim_plan, claim_plan
    assert "task_job_open_idx" not in claim_plan, claim_plan
