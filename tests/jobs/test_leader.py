"""The leader lease and its fence, with real connections racing (jobs/leader.py)."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection

from jobs import api, leader, transitions
from jobs.claim import claim
from jobs.models import Attempt, LeaderTerm, Task
from tests.daemons import wait_for
from tests.engine_helpers import NODE, spec

pytestmark = pytest.mark.django_db(transaction=True)


def _expire_lease(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE accs_leader SET expires_at = now() - interval '1 second'")


def _expired_task(make_service, key: str):
    svc = make_service(key, backoff_base_seconds=0, backoff_cap_seconds=0)
    api.start_service(svc)
    [task] = claim(spec(svc), NODE, agent_id="gone", free_slots=1, lease_seconds=0.01)

    def lease_over() -> bool:
        with connection.cursor() as cur:  # autocommit: each check reads a fresh now()
            cur.execute("SELECT lease_expires_at < now() FROM accs_task WHERE id = %s", [task.id])
            return cur.fetchone()[0]

    # The claim stamps its lease from its own statement's time, so a rescue that starts within
    # those 10 ms would still find the lease live: wait until PostgreSQL's clock has passed it.
    wait_for(lease_over, timeout=10, message="the 10 ms lease ends by PostgreSQL's clock")
    return task


def _rescue() -> int:
    result = transitions.rescue_expired(limit=10)
    return len(result.retried) + len(result.failed)


def test_one_holder_at_a_time_and_each_term_a_new_fence(db_url):
    first, second = leader.Lease(seconds=30), leader.Lease(seconds=30)
    fence = first.acquire()
    assert fence is not None
    assert second.acquire() is None, "a live lease is not taken"
    assert first.renew()
    _expire_lease(db_url)
    assert not first.renew(), "an expired lease is not renewed: its holder must take a new term"
    new = second.acquire()
    assert new is not None and new > fence
    assert list(LeaderTerm.objects.order_by("fence").values_list("fence", flat=True)) == [fence, new]


def test_a_deposed_leaders_late_write_does_nothing(make_service, db_url):
    old, new = leader.Lease(seconds=30), leader.Lease(seconds=30)
    old.acquire()
    task = _expired_task(make_service, "orphaned")
    _expire_lease(db_url)
    new.acquire()
    with pytest.raises(leader.NotLeader):
        old.run_fenced(_rescue)
    assert not Attempt.objects.filter(task_id=task.id, status="failed").exists(), "the deposed leader wrote"
    assert not old.held
    assert new.run_fenced(_rescue) == 1
    assert Task.objects.get(pk=task.id).status == "queued"
    terms = dict(LeaderTerm.objects.values_list("fence", "writes"))
    assert terms == {old_fence: 0 for old_fence in terms if old_fence != new.fence} | {new.fence: 1}


def _duty_in_thread(lease: leader.Lease, fn, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            lease.run_fenced(fn)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_leader_frozen_mid_duty_neither_delays_the_takeover_nor_commits_its_work(make_service, db_url):
    old, new = leader.Lease(seconds=1), leader.Lease(seconds=30)
    old_fence = old.acquire()
    task = _expired_task(make_service, "orphaned")
    in_duty, finish = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def frozen_rescue() -> int:
        done = _rescue()  # written, not yet committed
        in_duty.set()
        assert finish.wait(30)
        return done

    thread = _duty_in_thread(old, frozen_rescue, errors)
    assert in_duty.wait(10)
    with psycopg.connect(db_url, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT expires_at < now() FROM accs_leader").fetchone()[0], timeout=10,
                 message="the one-second lease ends while the duty runs")
    fence = new.acquire()
    assert fence is not None, "the takeover does not wait for the frozen leader's duty"
    finish.set()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], leader.NotLeader), errors
    assert not Attempt.objects.filter(task_id=task.id, status="failed").exists(), "the deposed leader's write committed"
    assert LeaderTerm.objects.get(fence=old_fence).writes == 0


def test_a_takeover_waits_for_a_committing_duty(make_service, db_url):
    """The share lock taken just before the commit holds a takeover off until the old term's writes are in."""
    old, new = leader.Lease(seconds=30), leader.Lease(seconds=30)
    old_fence = old.acquire()
    _expired_task(make_service, "orphaned")
    committing, finish = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def rescue_then_hold() -> int:
        done = _rescue()

        def after_check(execute, sql, params, many, context):
            result = execute(sql, params, many, context)
            if "FOR SHARE" in sql:
                committing.set()
                assert finish.wait(30)
            return result

        connection.execute_wrappers.append(after_check)  # this thread's connection only
        return done

    thread = _duty_in_thread(old, rescue_then_hold, errors)
    assert committing.wait(10)
    _expire_lease_without_waiting = "UPDATE accs_leader SET expires_at = now() - interval '1 second'"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute(_expire_lease_without_waiting)
    finish.set()
    thread.join(30)
    assert not errors, errors
    _expire_lease(db_url)
    fence = new.acquire()
    old_term, new_term = LeaderTerm.objects.get(fence=old_fence), LeaderTerm.objects.get(fence=fence)
    assert old_term.writes == 1 and old_term.last_write_at < new_term.acquired_at


def test_no_session_advisory_lock_anywhere():
    """Session-level advisory locks stay with a pooled server session: only transaction-scoped ones are used."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = [str(p.relative_to(root)) for folder in ("jobs", "nodes", "workflows", "events", "accs_site")
                 for p in (root / folder).rglob("*.py")
                 if re.search(r"pg_(try_)?advisory_lock(_shared)?\s*\(", p.read_text())]
    assert offenders == []
