"""Builders under faults, as real processes: a lost leader session, a large due backlog."""

from __future__ import annotations

import time

import psycopg
import pytest

from jobs import api
from jobs.builder import LEADER_LOCK_KEY, LOCK_APPLICATION_NAME
from jobs.claim import claim
from jobs.models import Attempt, Task
from tests.daemons import wait_until
from tests.engine_helpers import NODE, spec

pytestmark = pytest.mark.django_db(transaction=True)

LOCK_HOLDER_SQL = """
SELECT l.pid FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.classid::bigint = (%(key)s::bigint >> 32) AND l.objid::bigint = (%(key)s::bigint & 4294967295)
"""


def _lock_holder(db_url: str) -> int | None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(LOCK_HOLDER_SQL, {"key": LEADER_LOCK_KEY}).fetchone()
        return row[0] if row else None


def _expired_task(make_service, key: str, *, lease: float = 0.5):
    """Return a task claimed by an agent that will never come back (its lease ends in ``lease`` s)."""
    svc = make_service(key, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service(svc)
    [task] = claim(spec(svc), NODE, agent_id="gone", free_slots=1, lease_seconds=lease)
    return job, task


def _rescued(task) -> bool:
    return Attempt.objects.filter(task_id=task.id, attempt_no=task.attempt, status="failed").exists()


def test_leader_whose_lock_session_dies_steps_down_and_a_builder_leads_again(make_service, daemons, db_url):
    builders = [daemons.builder(name=f"builder-{i}") for i in range(2)]
    first = wait_until(lambda: _lock_holder(db_url), timeout=30, message="a builder leads")
    with psycopg.connect(db_url, autocommit=True) as conn:
        application = conn.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", [first]).fetchone()[0]
        assert application == LOCK_APPLICATION_NAME, "the lock lives on the builder's dedicated session"
        assert conn.execute("SELECT pg_terminate_backend(%s)", [first]).fetchone()[0]
    again = wait_until(lambda: (holder := _lock_holder(db_url)) and holder != first and holder, timeout=10,
                       message="a builder holds the leader lock again within a few ticks")
    assert again != first
    _job, task = _expired_task(make_service, "orphaned")
    wait_until(lambda: _rescued(task), timeout=10, message="the new leader rescues expired leases")
    assert Task.objects.get(pk=task.id).status == "queued"
    for proc in builders:
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    logs = "".join(p.log_path.read_text() for p in builders)
    assert "stepping down as leader" in logs or logs.count("this builder is now the leader") >= 2


def test_a_large_due_backlog_does_not_starve_lease_rescue(make_service, daemons, db_url):
    make_service("bulk")
    api.start_many([api.JobSpec(service="bulk", params={}) for _ in range(20_000)])
    _job, task = _expired_task(make_service, "stranded", lease=0.1)
    time.sleep(0.2)  # the lease has ended before the builder starts
    builder = daemons.builder("--batch", "50", name="builder")
    started = time.monotonic()
    wait_until(lambda: _rescued(task), timeout=30, message="rescue runs while the backlog is being instantiated")
    took = time.monotonic() - started
    instantiated = Task.objects.filter(service__key="bulk").count()
    assert builder.poll() is None
    assert instantiated < 20_000, "rescue did not wait for the whole backlog to be instantiated"
    assert took < 5, f"rescued {took:.1f}s after the builder started"
