"""Builders under faults, as real processes: a frozen leader, killed connections, a large due backlog."""

from __future__ import annotations

import signal

import psycopg
import pytest
from django.db.models.functions import Now

from jobs import api
from jobs.builder import INSTANTIATE_MAX_BATCHES
from jobs.claim import claim
from jobs.models import Attempt, Task
from tests.daemons import overlapping_terms, wait_until
from tests.engine_helpers import NODE, spec

pytestmark = pytest.mark.django_db(transaction=True)

LEADER_SQL = "SELECT holder, fence FROM accs_leader WHERE name = 'builder' AND expires_at > now()"


def _leader(db_url: str) -> tuple[str, int] | None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute(LEADER_SQL).fetchone()


def _locks(db_url: str) -> list:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute("SELECT a.application_name, a.state, a.query, l.mode, l.granted FROM pg_locks l"
                            " JOIN pg_stat_activity a USING (pid)"
                            " WHERE l.relation = 'accs_leader'::regclass").fetchall()


def _pid_of(holder: str) -> int:
    return int(holder.split(":")[1])


def _expired_task(make_service, key: str, *, lease: float = 0.5):
    """Return a task claimed by an agent that will never come back (its lease ends in ``lease`` s)."""
    svc = make_service(key, backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service(svc)
    [task] = claim(spec(svc), NODE, agent_id="gone", free_slots=1, lease_seconds=lease)
    return job, task


def _rescued(task) -> bool:
    return Attempt.objects.filter(task_id=task.id, attempt_no=task.attempt, status="failed").exists()


def test_a_frozen_leader_is_replaced_and_its_late_writes_are_fenced(make_service, daemons, db_url):
    builders = {p.pid: p for p in (daemons.builder("--lease-seconds", "4", name=f"builder-{i}") for i in range(2))}
    holder, fence = wait_until(lambda: _leader(db_url), timeout=30, message="a builder leads")
    frozen = builders[_pid_of(holder)]
    # Alive, holding its connections, renewing nothing. Frozen in the instant between a duty's
    # final fence check and its commit, it holds the takeover off until the server ends that
    # idle transaction (30 s): hence the long wait below.
    frozen.send_signal(signal.SIGSTOP)
    try:
        new_holder, new_fence = wait_until(lambda: (row := _leader(db_url)) and row[1] != fence and row, timeout=60,
                                           message=f"another builder takes the lease once it expires; {_locks(db_url)}")
        assert new_fence > fence and _pid_of(new_holder) != frozen.pid
        _job, task = _expired_task(make_service, "orphaned")
        wait_until(lambda: _rescued(task), timeout=10, message="the new leader rescues expired leases")
    finally:
        frozen.send_signal(signal.SIGCONT)
    wait_until(lambda: "stepping down as leader" in frozen.log_path.read_text(), timeout=15,
               message="the thawed builder finds its term over and steps down")
    assert Task.objects.get(pk=task.id).status == "queued"
    for proc in builders.values():
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
    assert overlapping_terms(db_url) == []


def test_killing_the_leaders_connections_does_not_end_its_term(make_service, daemons, db_url):
    builder = daemons.builder(name="builder")
    holder, fence = wait_until(lambda: _leader(db_url), timeout=30, message="the builder leads")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                     " WHERE application_name LIKE 'accs builder%%'")
    _job, task = _expired_task(make_service, "orphaned")
    wait_until(lambda: _rescued(task), timeout=15, message="the leader rescues after reconnecting")
    assert _leader(db_url) is not None and builder.poll() is None, builder.log_path.read_text()[-3000:]


def test_a_large_due_backlog_does_not_starve_lease_rescue(make_service, daemons, db_url):
    """The rescue comes within the builder's first ticks, not after the backlog: told by what was
    instantiated before it (PostgreSQL's order of commits), not by a stopwatch a loaded machine slows."""
    batch, backlog = 50, 2_000
    make_service("bulk")
    api.start_many([api.JobSpec(service="bulk", params={}) for _ in range(backlog)])
    _job, task = _expired_task(make_service, "stranded", lease=0.1)
    wait_until(lambda: Task.objects.filter(pk=task.id, lease_expires_at__lt=Now()).exists(), timeout=10,
               message="the lease has ended (by PostgreSQL's clock) before the builder starts")
    builder = daemons.builder("--batch", str(batch), name="builder")
    wait_until(lambda: _rescued(task), timeout=60, message="rescue runs while the backlog is being instantiated")
    assert builder.poll() is None
    rescued_at = Attempt.objects.get(task_id=task.id, attempt_no=task.attempt).finished_at
    # A tick instantiates at most INSTANTIATE_MAX_BATCHES batches before the duties run, and a lone
    # builder leads from its first tick: the rescue committed within the first two ticks' budget.
    before = Task.objects.filter(service__key="bulk", created_at__lte=rescued_at).count()
    assert before <= 2 * INSTANTIATE_MAX_BATCHES * batch < backlog, (
        f"{before} of {backlog} backlog tasks were instantiated before the rescue")
