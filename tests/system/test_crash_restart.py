"""A real crash restart of PostgreSQL, told apart from dead agents by the cluster's pulse.

A backend killed with SIGKILL makes the postmaster end every backend and reinitialise: the
server's start time (``pg_postmaster_start_time()``, the old outage rule) does not move. The pulse
(:mod:`jobs.pulse`) records the outage, so a lease that ended in it is queued again without using
its budget, and an agent's ``lease_lost`` for a lease last renewed before it is an outage too.
Runs on the project-local server only (the crash ends every session of the cluster).
"""

from __future__ import annotations

import os
import signal
import subprocess
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
from django.db import connection

from jobs import api, pulse, transitions
from jobs.models import ClusterPulse, Outage, Task
from jobs.outcomes import Outcome
from jobs.rescue import rescue_expired
from tests.daemons import wait_for
from tests.engine_helpers import claim_for

pytestmark = pytest.mark.django_db(transaction=True)

PG_LOCAL = str(Path(__file__).resolve().parents[2] / "scripts" / "pg_local.sh")


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            return conn.execute("SELECT true").fetchone()[0]
    except psycopg.OperationalError:
        return False


def _crash_restart(url: str) -> None:
    """Kill one backend with SIGKILL (the postmaster reinitialises all) and wait until the server answers."""
    with psycopg.connect(url, autocommit=True) as victim:
        pid = victim.execute("SELECT pg_backend_pid()").fetchone()[0]
        os.kill(pid, signal.SIGKILL)
    connection.close()
    wait_for(lambda: not _answers(url) or _restarted(url), timeout=30, message="the crash restart began")
    wait_for(lambda: _answers(url), timeout=60, message="PostgreSQL answers again after the crash restart")


def _restarted(url: str) -> bool:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            return conn.execute(f"SELECT {pulse.RESTARTED_AT_SQL} > (SELECT seen_at FROM accs_cluster_pulse)"
                                ).fetchone()[0]
    except psycopg.OperationalError:  # the restart is under way
        return True


def test_a_crash_restart_is_an_outage_not_dead_agents(make_service, db_url):
    local = subprocess.run([PG_LOCAL, "url"], capture_output=True, text=True, check=True).stdout.strip()
    if urlparse(db_url).port != urlparse(local).port:
        pytest.skip("a crash restart needs the project-local server (scripts/pg_local.sh)")
    svc = make_service("crash", max_attempts=1)  # a counted failure would dead-letter it
    rescued_job, reported_job = api.start_service("crash"), api.start_service("crash")
    claimed = {t.job_id: t for t in claim_for(svc)}
    rescued, reported = claimed[rescued_job.id], claimed[reported_job.id]
    pulse.stamp()
    began = ClusterPulse.objects.get().seen_at
    with connection.cursor() as cur:
        cur.execute("SELECT pg_postmaster_start_time()")
        postmaster_started = cur.fetchone()[0]

    _crash_restart(db_url)

    with connection.cursor() as cur:
        cur.execute("SELECT pg_postmaster_start_time()")
        assert cur.fetchone()[0] == postmaster_started, "the old signal does not see a crash restart"
    assert pulse.stamp() == began, "the first stamp after the crash records the outage"
    outage = Outage.objects.get()
    assert outage.cause == "restart" and outage.began_at == began
    # The first task's lease ended while the server was down (its agent could not renew it).
    ended = began + (outage.ended_at - began) / 2
    Task.objects.filter(pk=rescued.id).update(lease_expires_at=ended, heartbeat_at=ended - timedelta(seconds=3))
    result = rescue_expired(now=outage.ended_at + timedelta(seconds=4))
    assert result.retried == [rescued.id] and result.failed == []
    t = Task.objects.get(pk=rescued.id)
    assert (t.status, t.max_attempts, t.error_code) == ("queued", 2, "outage")
    # The second task's agent stopped its work for a lease it could not renew across the crash.
    lost = Outcome(task_id=reported.id, attempt=1, status="failed", error_code="lease_lost",
                   error="lease_lost: the agent could not renew the lease")
    result = transitions.report([lost], started=[(reported.id, 1, 123)], agent_id="agent-t", source="agent:test")
    assert result.retried == [reported.id] and result.failed == []
    assert Task.objects.get(pk=reported.id).error_code == "outage"
