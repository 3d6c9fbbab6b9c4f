"""The keyed claim over a backlog of full keys: found by key, never by passing over their queued tasks.

The database keeps each queued task's key and a row per key where its queue begins
(jobs.limit_keys); the claim reads those rows in order and passes over a key at its limit in its
one row. These tests pin what must hold whatever the layout: the key limits are never exceeded
(racing claimers on their own connections, with tasks queued and finished meanwhile), a claim
still finds the one key with room behind many full ones without reading their tasks, it takes the
same tasks as a plain model of the rules over generated layouts, and every key with a queued task
keeps a row at or before its first task.
"""

from __future__ import annotations

import importlib
import random
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable

import psycopg
import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs import api, transitions
from jobs.claim import NodeLimits, claim_many, claim_statement, service_spec
from jobs.limit_keys import (
    BACKFILL_HELD_SQL,
    KEY_HELD_SQL,
    KEY_HELD_TRIGGERS_SQL,
    KEY_LIMITS_SQL,
    LIMIT_KEY_SQL,
    RATE_START_BLOCK_SQL,
)
from tests.daemons import wait_for
from tests.engine_helpers import KEY_HELD_DRIFT_SQL, run_fail, run_ok
from tests.jobs.test_flow_control import PEAK_TRIGGER  # the held tasks of each claimed key, at commit

NODE = NodeLimits(name="node-kb", slot_cap=1000, cpu_budget=10_000, per_service={})
SCHEMA = {"params_schema": {"type": "object", "properties": {"customer": {"type": "string"},
                                                             "i": {"type": "integer"}}}}

# A key with a queued task (bound to no host) and no row at or before its first queued task: the
# claim could not find it. Must always be empty.
UNCOVERED_SQL = """
SELECT t.service_id, t.tenant_id, t.limit_key
  FROM (SELECT DISTINCT ON (service_id, tenant_id, limit_key) service_id, tenant_id, limit_key, priority,
               order_seq, created_at, id
          FROM accs_task WHERE status = 'queued' AND host_id IS NULL AND limit_key IS NOT NULL
         ORDER BY service_id, tenant_id, limit_key, priority DESC, order_seq, created_at, id) t
 WHERE NOT EXISTS (
    SELECT 1 FROM accs_limit_key_head h
     WHERE h.service_id = t.service_id AND h.tenant_id = t.tenant_id AND h.key = t.limit_key AND NOT h.emptied
       AND (h.priority > t.priority OR (h.priority = t.priority
            AND (h.order_seq, h.created_at, h.task_id) <= (t.order_seq, t.created_at, t.id))))
"""

# Queued tasks whose stored key is not the one their params and service give now.
MISKEYED_SQL = """
SELECT t.id FROM accs_task t JOIN accs_service s ON s.id = t.service_id
 WHERE t.status = 'queued'
   AND t.limit_key IS DISTINCT FROM (
       SELECT CASE WHEN p IS NULL THEN NULL ELSE coalesce(t.params #>> string_to_array(p, '.'), '') END
         FROM accs_limit_key_path(s.concurrency_key_limit, s.concurrency_key, s.rate_key_limit, s.rate_key) AS p)
"""


def enqueue(service_key: str, customers: list[str], *, priorities: list[int] | None = None) -> None:
    prios = priorities or [0] * len(customers)
    api.start_many([api.JobSpec(service=service_key, params={"customer": c, "i": i}, priority=p)
                    for i, (c, p) in enumerate(zip(customers, prios, strict=True))])
    transitions.start_due_jobs(limit=100_000)


def claim(service, n: int, *, agent: str = "agent-kb"):
    service.refresh_from_db()
    return claim_many([service_spec(service)], NODE, agent_id=agent, free_slots=n, lease_seconds=600)


def rows_of(sql: str) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def held_per_key(service_id: int) -> dict[str, int]:
    with connection.cursor() as cur:
        cur.execute("SELECT params->>'customer', count(*) FROM accs_task WHERE service_id = %s"
                    " AND status IN ('starting', 'running') GROUP BY 1", [service_id])
        return dict(cur.fetchall())


@pytest.mark.django_db(transaction=True)
def test_a_claim_finds_the_one_key_with_room_behind_many_full_ones_without_reading_their_tasks(make_service):
    svc = make_service("lonely", concurrency_key="customer", concurrency_key_limit=1, **SCHEMA)
    # 60 keys with 12 tasks each own the head of the queue; one claim fills each of them (limit 1).
    enqueue("lonely", [f"k{k:02d}" for k in range(60) for _ in range(12)])
    assert len(claim(svc, 100, agent="agent-first")) == 60
    enqueue("lonely", ["lonely"])
    svc.refresh_from_db()
    sql, params = claim_statement([(service_spec(svc), 10)], adjust={})
    params.update({"now": None, "hosts": [], "slots": 10, "cpu": 1000, "agent": "plan", "node": "plan",
                   "lease": 60.0, "pid": 1, "source": "plan", "exclude": []})
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("ANALYZE accs_task")
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cur.fetchone()[0]
        transaction.set_rollback(True)
    nodes = list(_plan_nodes(plan[0]["Plan"]))
    # The 660 queued tasks of the full keys: none read (the walk before this read all of them).
    read = sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0) for n in nodes
               if n.get("Relation Name") == "accs_task" and n.get("Index Name") in ("task_claim_idx",
                                                                                     "task_limit_key_idx"))
    assert read <= 4, f"{read} queued tasks read to find the one key with room"
    got = claim(svc, 10)
    assert [t.params["customer"] for t in got] == ["lonely"]
    assert max(held_per_key(svc.id).values()) == 1


@pytest.mark.django_db(transaction=True)
def test_finished_work_gives_its_key_room_again_and_the_next_claim_takes_the_keys_next_task(make_service):
    svc = make_service("next", concurrency_key="customer", concurrency_key_limit=1, **SCHEMA)
    enqueue("next", ["a", "a", "a", "b"])
    first = claim(svc, 10)
    assert sorted(t.params["i"] for t in first) == [0, 3]
    assert claim(svc, 10) == [], "a and b at their limit"
    run_ok([t for t in first if t.params["customer"] == "a"])
    assert [t.params["i"] for t in claim(svc, 10)] == [1], "a's next task, in order"
    assert rows_of(UNCOVERED_SQL) == []


@pytest.mark.django_db(transaction=True)
def test_one_claims_starts_mark_the_keys_whose_window_they_fill_in_one_trigger_call(make_service):
    """A claim records its starts in one statement; the keys whose rate window they fill are marked
    (passed over by the walk until the window frees), each from all of its starts, by one call of the
    marking trigger however many starts and keys the claim took."""
    svc = make_service("marks", rate_key="customer", rate_key_limit=2, rate_period_seconds=3600, **SCHEMA)
    enqueue("marks", ["a", "a", "a", "b", "b", "c"])
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL track_functions = 'pl'")
        got = claim(svc, 10)
        cur.execute("SELECT calls FROM pg_stat_xact_user_functions WHERE funcname = 'accs_rate_start_block'")
        calls = cur.fetchall()
    assert sorted(t.params["customer"] for t in got) == ["a", "a", "b", "b", "c"]
    assert calls == [(1,)], f"the marking trigger ran {calls} times for one claim's five starts"
    with connection.cursor() as cur:
        cur.execute("SELECT h.key, h.rate_until, (SELECT max(r.at) + interval '1 hour' FROM accs_rate_start r"
                    " WHERE r.service_id = h.service_id AND r.key = h.key) FROM accs_limit_key_head h"
                    " WHERE h.service_id = %s AND NOT h.emptied", [svc.id])
        marks = {key: (until, expected) for key, until, expected in cur.fetchall()}
    assert marks["a"][0] is not None and marks["a"][0] == marks["a"][1], "a's two starts fill its window"
    assert marks.get("b", (None,))[0] is None, "b has nothing queued: its row is gone, or unmarked"
    assert "c" not in marks, "c's one task was claimed: its row is gone"
    assert claim(svc, 10) == [], "a's third task waits for the window"


@pytest.mark.parametrize("limits", [{"concurrency_key": "customer", "concurrency_key_limit": 2},
                                    {"rate_key": "customer", "rate_key_limit": 2, "rate_period_seconds": 3600}],
                         ids=["per-key cap", "per-key rate"])
@pytest.mark.django_db(transaction=True)
def test_a_claim_that_fills_keys_writes_each_of_their_rows_once(make_service, limits):
    """The claim moves a key's row past the tasks it took and, when it took all the key's room, marks it
    full in the same update: the triggers that keep the marks find the mark set and write nothing (each
    row was written twice a claim, a second index entry each, before)."""
    svc = make_service("fills", **limits, **SCHEMA)
    enqueue("fills", ["a", "a", "a", "b", "b", "b"])
    counts = ("SELECT n_tup_upd, n_tup_ins, n_tup_del FROM pg_stat_xact_user_tables"
              " WHERE relname = 'accs_limit_key_head'")
    with transaction.atomic(), connection.cursor() as cur:
        # (The counts may still hold earlier transactions' writes not yet reported: the claim's are the difference.)
        cur.execute(counts)
        before = cur.fetchone()
        got = claim(svc, 10)
        cur.execute(counts)
        writes = tuple(after - b for after, b in zip(cur.fetchone(), before, strict=True))
    assert sorted(t.params["customer"] for t in got) == ["a", "a", "b", "b"]
    assert writes == (2, 0, 0), f"key rows updated, inserted, deleted: {writes}"
    marks = rows_of(f"SELECT key, cap_full, rate_until IS NOT NULL FROM accs_limit_key_head"
                    f" WHERE service_id = {svc.id} ORDER BY key")
    full = [(k, True, False) if "concurrency_key" in limits else (k, False, True) for k in "ab"]
    assert marks == full, marks
    assert rows_of(KEY_HELD_DRIFT_SQL) == [] and rows_of(UNCOVERED_SQL) == []
    assert claim(svc, 10) == [], "both keys at their limit"


@pytest.mark.django_db(transaction=True)
def test_a_cap_mark_the_claim_sets_on_a_count_a_finish_lowered_meanwhile_is_cleared(make_service, db_url):
    """The claim reads a key's held count, takes the room it leaves and marks the key full; a finish of
    the key's other held task, committed before the claim's own count, leaves the key with room. The
    count's trigger, which waits for that finish's count row, then clears the mark: a key with room is
    never left marked (the walk would never visit it)."""
    svc = make_service("lowered", concurrency_key="customer", concurrency_key_limit=2, **SCHEMA)
    enqueue("lowered", ["a", "a", "a"])
    (first,) = claim(svc, 1)
    transitions.mark_running([(first.id, first.attempt, 1)], agent_id="agent-kb", source="agent:test")
    claimed: list = []
    # The finish's transaction (its count row taken, held 1 -> 0) stays open while the claim runs.
    race_behind_a_gate(db_url, "UPDATE accs_task SET status = 'done', finished_at = now() WHERE id = %s",
                       [first.id], [("claim", lambda: claimed.extend(claim(svc, 10, agent="agent-2")))], commit=True)
    assert [t.params["customer"] for t in claimed] == ["a"], "the claim read one held: room for one"
    assert rows_of(f"SELECT cap_full FROM accs_limit_key_head WHERE service_id = {svc.id}") == [(False,)]
    assert held_per_key(svc.id) == {"a": 1}
    assert rows_of(KEY_HELD_DRIFT_SQL) == []
    assert [t.params["customer"] for t in claim(svc, 10)] == ["a"], "the key's room, found by the walk"


@pytest.mark.django_db(transaction=True)
def test_a_changed_key_path_keys_the_queued_tasks_again_in_the_same_transaction(make_service):
    from workflows.models import Service

    svc = make_service("path", concurrency_key="customer", concurrency_key_limit=1,
                       params_schema={"type": "object"})
    api.start_many([api.JobSpec(service="path", params={"customer": c, "region": r})
                    for c, r in [("a", "eu"), ("b", "eu"), ("c", "us")]])
    transitions.start_due_jobs(limit=100)
    assert sorted(k for (k,) in rows_of("SELECT limit_key FROM accs_task")) == ["a", "b", "c"]
    Service.objects.filter(id=svc.id).update(concurrency_key="region")
    assert sorted(k for (k,) in rows_of("SELECT limit_key FROM accs_task")) == ["eu", "eu", "us"]
    assert rows_of(MISKEYED_SQL) == [] and rows_of(UNCOVERED_SQL) == []
    assert sorted(t.params["region"] for t in claim(svc, 10)) == ["eu", "us"], "one per region now"


def _waits_for_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                            [pid]).fetchone() == (True,)


def race_behind_a_gate(db_url: str, gate_sql: str, gate_params: list, calls: list[tuple[str, Callable]], *,
                       commit: bool = False) -> None:
    """Run ``calls`` each on a thread (so a connection) of its own, in order, each started once the one
    before waits for a lock, while a third connection holds what ``gate_sql`` locks; then release the
    gate (rolled back, or with ``commit`` committed) and wait for all. Whatever a call raises (a
    deadlock) fails the test."""
    pids: dict[str, int] = {}
    errors: list[BaseException] = []

    def on_own_connection(name: str, fn: Callable) -> None:
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                pids[name] = cur.fetchone()[0]
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            connection.close()

    with psycopg.connect(db_url) as gate:
        gate.execute(gate_sql, gate_params)
        threads = [threading.Thread(target=on_own_connection, args=call) for call in calls]
        for (name, _), thread in zip(calls, threads, strict=True):
            thread.start()
            wait_for(lambda name=name: name in pids and _waits_for_a_lock(db_url, pids[name]), timeout=10,
                     message=f"the {name} should wait for a lock")
        if commit:
            gate.commit()
        else:
            gate.rollback()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert not errors, errors


@pytest.mark.parametrize("first", ["tasks queued", "path changed"])
def test_tasks_queued_while_their_services_path_changes_are_keyed_by_the_new_path(make_service, db_url, first):
    """Queueing reads the path with the service row locked FOR SHARE, which a change of the path conflicts
    with, so whichever comes first, the other waits for its commit and no task is left keyed by a replaced
    path (where the claim, finding tasks by key, would never look). FOR KEY SHARE, the foreign key's lock,
    would not do: it locks the row's old version past an update of other columns, and reads the old path."""
    svc = make_service("racing-path", params_schema={"type": "object"})  # no key path yet: tasks unkeyed
    change = ("UPDATE accs_service SET concurrency_key = 'customer', concurrency_key_limit = 1"
              f" WHERE id = {svc.id}")
    queue_sql = ("INSERT INTO accs_task (id, job_id, tenant_id, task_key, step_key, service_id, exclusive, status,"
                 " depends_on, attempt, max_attempts, next_attempt_at, priority, order_seq, timeout_seconds, params,"
                 " assigned_node, claimed_by, node, error_code, error_message, created_at, updated_at)"
                 " SELECT gen_random_uuid(), j.id, j.tenant_id, 'x', 'x', j.service_id, false, 'queued', '{}', 0, 1,"
                 " now(), 0, j.order_seq, 60, '{\"customer\": \"a\"}', '', '', '', '', '', now(), now()"
                 " FROM accs_job j WHERE j.service_id = %s")
    api.start_many([api.JobSpec(service="racing-path", params={"customer": "a"})])
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url, autocommit=True) as waiter:
        waiter_pid = waiter.info.backend_pid
        if first == "tasks queued":
            holder.execute(queue_sql, [svc.id])
            later = threading.Thread(target=waiter.execute, args=(change,))
        else:
            holder.execute(change)
            later = threading.Thread(target=waiter.execute, args=(queue_sql, [svc.id]))
        later.start()
        wait_for(lambda: _waits_for_a_lock(db_url, waiter_pid), timeout=10,
                 message="the second transaction should wait for the first one's lock on the service row")
        holder.commit()
        later.join(timeout=10)
        assert not later.is_alive()
    keys = [k for (k,) in rows_of(f"SELECT limit_key FROM accs_task WHERE service_id = {svc.id}")]
    assert keys == ["a"], keys
    assert rows_of(MISKEYED_SQL) == [] and rows_of(UNCOVERED_SQL) == []


@pytest.mark.django_db(transaction=True)
def test_each_keys_held_count_follows_claims_failures_a_new_path_deletes_and_the_backfill(make_service):
    """The count the keyed claim trusts stays exact through every way a task enters or leaves held work."""
    from workflows.models import Service

    svc = make_service("counted", concurrency_key="customer", concurrency_key_limit=2, max_attempts=2,
                       backoff_base_seconds=0, params_schema={"type": "object"})
    api.start_many([api.JobSpec(service="counted", params={"customer": c, "region": r})
                    for c, r in [("a", "eu"), ("a", "eu"), ("b", "eu"), ("c", "us")]])
    transitions.start_due_jobs(limit=100)
    kept = "SELECT key, held FROM accs_limit_key_held WHERE service_id = %s AND held <> 0 ORDER BY key" % svc.id
    got = claim(svc, 10)
    assert rows_of(kept) == [("a", 2), ("b", 1), ("c", 1)]
    run_fail([t for t in got if t.params["customer"] == "b"])  # held -> scheduled for a retry
    assert rows_of(kept) == [("a", 2), ("c", 1)]
    # A new path keys the held tasks again and counts them afresh, in the same transaction.
    Service.objects.filter(id=svc.id).update(concurrency_key="region")
    assert rows_of(kept) == [("eu", 2), ("us", 1)]
    assert rows_of(KEY_HELD_DRIFT_SQL) == []
    # A held task deleted (its job pruned or removed) gives its key's room back.
    with connection.cursor() as cur:
        cur.execute("SELECT id FROM accs_task WHERE status IN ('starting', 'running') AND limit_key = 'us'")
        gone = [r[0] for r in cur.fetchall()]
        cur.execute("DELETE FROM accs_event WHERE task_id = ANY(%s)", [gone])
        cur.execute("DELETE FROM accs_attempt WHERE task_id = ANY(%s)", [gone])
        cur.execute("DELETE FROM accs_task WHERE id = ANY(%s)", [gone])
    assert rows_of(kept) == [("eu", 2)]
    # Tasks held before the counts existed (no stored key): the migration's backfill keys and counts them.
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET limit_key = NULL WHERE status IN ('starting', 'running')")
        cur.execute("DELETE FROM accs_limit_key_held")
        cur.execute(BACKFILL_HELD_SQL, {"after": "00000000-0000-0000-0000-000000000000", "limit": 1})
        cur.execute(BACKFILL_HELD_SQL, {"after": "00000000-0000-0000-0000-000000000000", "limit": 100})
    assert rows_of(kept) == [("eu", 2)]
    assert rows_of(KEY_HELD_DRIFT_SQL) == []
    run_ok([t for t in got if t.params["customer"] == "a"])
    assert rows_of(kept) == []
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


@pytest.mark.django_db(transaction=True)
def test_held_counts_are_kept_only_while_a_per_key_cap_reads_them(make_service):
    """A per-key rate alone reads no held count, so its claims and finishes keep none; a cap set later
    counts the held tasks afresh, and a cap removed forgets them."""
    from workflows.models import Service

    svc = make_service("uncounted", rate_key="customer", rate_key_limit=5, rate_period_seconds=3600, **SCHEMA)
    enqueue("uncounted", ["a", "a", "b", "b", "c"])
    kept = f"SELECT key, held FROM accs_limit_key_held WHERE service_id = {svc.id} ORDER BY key"
    got = claim(svc, 3)
    assert rows_of(kept) == [], "a rate alone: no count kept"
    Service.objects.filter(id=svc.id).update(concurrency_key="customer", concurrency_key_limit=2)
    assert rows_of(kept) == [("a", 2), ("b", 1)], "the cap counts the held tasks afresh"
    assert rows_of(KEY_HELD_DRIFT_SQL) == []
    assert [t.params["customer"] for t in claim(svc, 10)] == ["b", "c"], "a is at its cap"
    run_ok(got[:1])
    assert rows_of(kept) == [("a", 1), ("b", 2), ("c", 1)]
    Service.objects.filter(id=svc.id).update(concurrency_key_limit=0)
    assert rows_of(kept) == [], "no cap: the counts go"
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


@pytest.mark.parametrize("first", ["a finish", "the cap"])
@pytest.mark.django_db(transaction=True)
def test_a_cap_set_while_held_tasks_move_counts_every_move(make_service, db_url, first):
    """The change of limits that sets a cap counts the held tasks under a lock every move of the
    service's keyed tasks shares: a finish in flight is committed before the count reads the tasks, and
    a finish after it reads the new cap and counts itself. Either way the count is the held tasks'."""
    svc = make_service("cap-race", rate_key="customer", rate_key_limit=5, rate_period_seconds=3600, **SCHEMA)
    enqueue("cap-race", ["a", "a", "a"])
    held = claim(svc, 3)
    transitions.mark_running([(t.id, t.attempt, 1) for t in held], agent_id="agent-kb", source="agent:test")
    set_cap = f"UPDATE accs_service SET concurrency_key = 'customer', concurrency_key_limit = 5 WHERE id = {svc.id}"
    finish = "UPDATE accs_task SET status = 'done', finished_at = now() WHERE id = %s"
    if first == "a finish":
        race_behind_a_gate(db_url, finish, [held[0].id], [("cap", lambda: _execute(set_cap))], commit=True)
    else:
        race_behind_a_gate(db_url, set_cap, [], [("finish", lambda: _execute(finish, [held[0].id]))], commit=True)
    assert rows_of(f"SELECT key, held FROM accs_limit_key_held WHERE service_id = {svc.id}") == [("a", 2)]
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


def _execute(sql: str, params: list | None = None) -> None:
    with connection.cursor() as cur:
        cur.execute(sql, params)


@pytest.mark.django_db(transaction=True)
def test_tasks_requeued_after_a_failure_are_keyed_and_covered_again(make_service):
    svc = make_service("again", concurrency_key="customer", concurrency_key_limit=1, max_attempts=3,
                       backoff_base_seconds=0, **SCHEMA)
    enqueue("again", ["a", "a", "b"])
    run_fail(claim(svc, 10))
    # The claim promotes the due retries first: each goes back to the head of its key.
    again = claim(svc, 10)
    assert sorted(t.params["i"] for t in again) == [0, 2], "the retried tasks, each first in its key"
    assert rows_of(MISKEYED_SQL) == [] and rows_of(UNCOVERED_SQL) == []


# --------------------------------------------------------------------------------------------
# Racing claimers, each on its own connection
# --------------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_racing_claimers_on_their_own_connections_never_exceed_a_key_limit(make_service):
    """Four claimers, a finisher and an enqueuer race; at every claim's commit each key holds <= 2."""
    svc = make_service("race", concurrency_key="customer", concurrency_key_limit=2, **SCHEMA)
    keys = [f"k{i}" for i in range(12)]
    enqueue("race", [keys[i % 3] for i in range(60)] + keys * 3)  # three busy keys at the head
    with connection.cursor() as cur:
        cur.execute(PEAK_TRIGGER)
    stop = threading.Event()
    errors: list[BaseException] = []
    claimed: Counter[str] = Counter()
    lock = threading.Lock()

    def claimer(n: int) -> None:
        rng = random.Random(n)
        try:
            while not stop.is_set():
                got = claim(svc, rng.randint(1, 6), agent=f"agent-{n}")
                with lock:
                    claimed.update(t.params["customer"] for t in got)
                if got and rng.random() < 0.7:
                    run_ok(got, agent=f"agent-{n}")
                elif got:
                    held.extend(got)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            connection.close()

    def enqueuer() -> None:
        try:
            for round_ in range(8):
                enqueue("race", [keys[(round_ + j) % len(keys)] for j in range(10)])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            connection.close()

    held: list = []
    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    feeder = threading.Thread(target=enqueuer)
    try:
        for t in [*threads, feeder]:
            t.start()
        feeder.join(timeout=120)

        def drained() -> bool:
            # Finish what the claimers left held; done once nothing is queued. Every key with a
            # queued task has its row at every look (each look is one committed snapshot).
            while held:
                run_ok([held.pop()])
            assert rows_of(UNCOVERED_SQL) == []
            return not rows_of("SELECT 1 FROM accs_task WHERE status = 'queued' LIMIT 1")

        wait_for(drained, timeout=120, message="the racing claimers took every queued task")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        peaks = dict(rows_of("SELECT customer, max(held) FROM fc_peak GROUP BY 1"))
    finally:
        stop.set()
        with connection.cursor() as cur:
            cur.execute("DROP TABLE IF EXISTS fc_peak; DROP TRIGGER IF EXISTS fc_record_held ON accs_task;"
                        " DROP FUNCTION IF EXISTS fc_record_held()")
    assert not errors, errors
    assert rows_of("SELECT count(*) FROM accs_task WHERE status = 'queued'") == [(0,)], "every task was claimed"
    assert sum(claimed.values()) >= 60 + 36 + 80
    assert peaks and max(peaks.values()) <= 2, peaks
    assert max(peaks.values()) == 2, "the limit was reached, so the race was real"
    # The counts kept per key followed every claim and finish of the race exactly.
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


@pytest.mark.parametrize("shape", ["one statement", "a start beside them", "a failure beside them"])
@pytest.mark.django_db(transaction=True)
def test_two_reports_whose_keys_interleave_never_deadlock(make_service, db_url, shape):
    """Each report holds tasks of keys a and b, their ids interleaved (a, b | b, a): the keys' count rows
    are taken in (service, key) order in every report, whatever the order of its tasks or of the
    statements that end them. Made deterministic with a third connection holding b's key row: the second
    report waits for it after its counts; the first then waits for the second; once released, the old
    order (each count as its task came) had the second report wait for a's count, held by the first."""
    svc = make_service("interleaved", concurrency_key="customer", concurrency_key_limit=2, max_attempts=3,
                       backoff_base_seconds=0, **SCHEMA)
    # Creation order is id order: t0 a, t1 b, t2 a, t3 b held; one more of each queued keeps the key rows.
    enqueue("interleaved", ["a", "b", "a", "b", "a", "b"])
    got = sorted(claim(svc, 10), key=lambda t: t.id)
    assert [t.params["customer"] for t in got] == ["a", "b", "a", "b"]
    assert rows_of(f"SELECT key FROM accs_limit_key_head WHERE service_id = {svc.id} AND cap_full ORDER BY key") \
        == [("a",), ("b",)], "both keys full: each report flips its keys' rows"
    first, second = [got[0], got[3]], [got[1], got[2]]  # a then b; b then a
    if shape != "a start beside them":
        transitions.mark_running([(t.id, t.attempt, 1) for t in got], agent_id="agent-kb", source="agent:test")
    else:
        # The second report ends b with its start (starting -> done) and a already running: two statements.
        transitions.mark_running([(t.id, t.attempt, 1) for t in [*first, got[2]]], agent_id="agent-kb",
                                 source="agent:test")
    def report(name: str, tasks) -> None:
        outcomes = [transitions.Outcome(task_id=t.id, attempt=t.attempt, status="succeeded") for t in tasks]
        started: list = []
        if name == "second" and shape == "a start beside them":
            started = [(tasks[0].id, tasks[0].attempt, 1)]
        if name == "second" and shape == "a failure beside them":
            outcomes[1] = transitions.Outcome(task_id=tasks[1].id, attempt=tasks[1].attempt, status="failed",
                                              error="boom", exit_code=1)
        transitions.report(outcomes, started=started, agent_id="agent-kb", source="agent:test")

    race_behind_a_gate(db_url, "SELECT 1 FROM accs_limit_key_head WHERE service_id = %s AND key = 'b' FOR UPDATE",
                       [svc.id], [("second report", lambda: report("second", second)),
                                  ("first report", lambda: report("first", first))])
    assert rows_of(f"SELECT status FROM accs_task WHERE service_id = {svc.id} AND status IN ('starting', 'running')"
                   ) == [], "both reports ended their tasks"
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


@pytest.mark.django_db(transaction=True)
def test_a_claim_and_a_report_whose_keys_interleave_never_deadlock(make_service, db_url):
    """A claim takes tasks of keys b then a (in id order) while a report ends tasks of a then b. A third
    connection holds the service's key-limits lock (what a change of its limits takes), which the
    count's trigger waits for: taken per task, the claim waited holding b's count and the report
    holding a's, and on release each wanted the other's."""
    svc = make_service("claim-report", concurrency_key="customer", concurrency_key_limit=3, **SCHEMA)
    enqueue("claim-report", ["a", "b", "a", "b"])
    held = sorted(claim(svc, 10), key=lambda t: t.id)
    assert [t.params["customer"] for t in held] == ["a", "b", "a", "b"]
    transitions.mark_running([(t.id, t.attempt, 1) for t in held], agent_id="agent-kb", source="agent:test")
    enqueue("claim-report", ["b", "a"])
    claimed: list = []
    race_behind_a_gate(db_url, "SELECT pg_advisory_xact_lock(hashtext('accs:key-limits:' || %s))", [svc.id],
                       [("claim", lambda: claimed.extend(claim(svc, 10, agent="agent-2"))),
                        ("report", lambda: run_ok(held[:2]))])
    assert sorted(t.params["customer"] for t in claimed) == ["a", "b"]
    assert rows_of(KEY_HELD_DRIFT_SQL) == []


# --------------------------------------------------------------------------------------------
# Generated layouts against a model of the rules
# --------------------------------------------------------------------------------------------

layouts = st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([0, 0, 0, 5])), min_size=1, max_size=40)
steps = st.lists(st.tuples(st.sampled_from(["claim", "finish"]), st.integers(1, 8)), min_size=1, max_size=8)


def model_claim(queue: list[tuple[int, str, int]], held: dict[str, list[int]], *, limit: int, n: int) -> list[int]:
    """The tasks a claim of ``n`` must take: the first in (priority DESC, enqueue order) whose key has room."""
    taken: list[int] = []
    counts = {k: len(v) for k, v in held.items()}
    for i, key, _ in sorted(queue, key=lambda q: (-q[2], q[0])):
        if len(taken) == n:
            break
        if counts.get(key, 0) < limit:
            counts[key] = counts.get(key, 0) + 1
            taken.append(i)
    return taken


@pytest.mark.django_db(transaction=True)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, ops=steps, limit=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_claims_over_generated_layouts_take_what_a_model_of_the_rules_takes(make_service, layout, ops, limit, seed):
    # A service of its own per example: hypothesis seeds the random module for each example, so a
    # name drawn from it repeats across examples with the same seed; uuid4 reads the OS.
    key = f"gen-{seed}-{uuid.uuid4().hex[:12]}"
    svc = make_service(key, concurrency_key="customer", concurrency_key_limit=limit, **SCHEMA)
    enqueue(key, [c for c, _ in layout], priorities=[p for _, p in layout])
    queue = [(i, c, p) for i, (c, p) in enumerate(layout)]
    held: dict[str, list] = defaultdict(list)
    rng = random.Random(seed)
    for op, n in ops:
        if op == "claim":
            expected = model_claim(queue, {k: [t.params["i"] for t in v] for k, v in held.items()},
                                   limit=limit, n=n)
            got = claim(svc, n)
            assert sorted(t.params["i"] for t in got) == sorted(expected)
            for t in got:
                held[t.params["customer"]].append(t)
            queue = [q for q in queue if q[0] not in set(expected)]
        else:
            running = [t for v in held.values() for t in v]
            done = rng.sample(running, min(n, len(running)))
            if done:
                run_ok(done)
            for t in done:
                held[t.params["customer"]].remove(t)
        assert rows_of(UNCOVERED_SQL) == []
        assert rows_of(KEY_HELD_DRIFT_SQL) == []
        assert all(v <= limit for v in held_per_key(svc.id).values())


# --------------------------------------------------------------------------------------------
# The migration's copy
# --------------------------------------------------------------------------------------------

def test_the_migrations_create_the_triggers_this_module_describes():
    migration = importlib.import_module("jobs.migrations.0039_limit_keys")
    # jobs.0041 replaced the rate marks' trigger (one call per statement of starts).
    per_statement = importlib.import_module("jobs.migrations.0041_rate_start_block_per_statement")
    assert per_statement.RATE_START_BLOCK_SQL == RATE_START_BLOCK_SQL
    assert per_statement.RATE_START_BLOCK_0039.strip() in migration.LIMIT_KEY_SQL
    # jobs.0045 replaced the held counts' triggers (one call per statement, the rows in key order).
    in_order = importlib.import_module("jobs.migrations.0045_key_counts_in_order")
    assert in_order.KEY_HELD_TRIGGERS_SQL == KEY_HELD_TRIGGERS_SQL
    # jobs.0046 counts only the services with a per-key cap on their key path.
    counted = importlib.import_module("jobs.migrations.0046_claims_probe_and_mark_what_they_fill")
    assert (counted.KEY_HELD_SQL, counted.KEY_LIMITS_SQL) == (KEY_HELD_SQL, KEY_LIMITS_SQL)
    assert migration.LIMIT_KEY_SQL.replace(
        per_statement.RATE_START_BLOCK_0039.strip(), RATE_START_BLOCK_SQL.strip()).replace(
        in_order.KEY_HELD_0039, KEY_HELD_SQL).replace(
        in_order.KEY_HELD_TRIGGERS_0039, KEY_HELD_TRIGGERS_SQL).replace(
        counted.KEY_LIMITS_0039, KEY_LIMITS_SQL) == LIMIT_KEY_SQL
    assert migration.BACKFILL_HELD_SQL == BACKFILL_HELD_SQL


def _plan_nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)
