"""A real failover: a hot standby promoted while leases run out, told apart from dead agents by the pulse.

A builder runs on the primary (the project-local cluster) and stamps the cluster's pulse; agents
hold tasks there. The primary's builder is killed (the failover, as the engine sees it: nothing
reaches the primary any more), the standby replays everything, the leases end and more than the
pulse's gap passes, then the standby is promoted (``pg_ctl promote``) and a builder is started
against it. The promoted server's ``pg_postmaster_start_time()`` is the standby's start, before
the leases' last renewal, so the old outage rule saw no outage there; the pulse's stamps were
replicated, and the new builder's first stamp finds the last one older than the gap: the leases
that ended during the failover are queued again without using their budget, while the task of an
agent that died before the failover is dead-lettered as ``lease_expired``.

Runs on the project-local server only (the standby is a base backup of it). The standby lives in
its own folder and port (not the read-replica test's), and is stopped and removed at the end; the
primary is never stopped or moved.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
from django.db import connection

from jobs import api, pulse, transitions
from jobs.models import Task
from tests.daemons import Daemons, free_port, stop_process, wait_for
from tests.engine_helpers import claim_for

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
PG_LOCAL = str(ROOT / "scripts" / "pg_local.sh")
REPLICA = str(ROOT / "scripts" / "pg_replica_local.sh")
LEASE = 3  # seconds: the service's lease, the shortest a service may ask for


class Standby:
    """A streaming standby of the local cluster in a folder and on a port of its own."""

    def __init__(self, *, folder: Path, port: int, dbname: str) -> None:
        self.folder, self.port, self.dbname = folder, port, dbname
        self.env = {**os.environ, "ACC_PG_REPLICA_DIR": str(folder), "ACC_PG_REPLICA_PORT": str(port)}

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def run(self, command: str) -> None:
        done = subprocess.run([REPLICA, command], env=self.env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, f"scripts/pg_replica_local.sh {command} failed:\n{done.stderr}"

    def query(self, sql: str, params: tuple = ()) -> tuple:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchone()

    def rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()


@pytest.fixture
def standby(db_url: str) -> Iterator[Standby]:
    """Start a standby of the test database's cluster; stop and remove it at the end."""
    local = subprocess.run([PG_LOCAL, "url"], capture_output=True, text=True, check=True).stdout.strip()
    if urlparse(db_url).port != urlparse(local).port:
        pytest.skip("a promotion needs a standby of the project-local server (scripts/pg_local.sh)")
    # Under .local (the server's OS user can enter it, unlike a root-owned pytest tmp folder).
    s = Standby(folder=ROOT / ".local" / f"pg-failover-{uuid.uuid4().hex[:8]}", port=free_port(),
                dbname=urlparse(db_url).path.lstrip("/"))
    try:
        s.run("start")
        yield s
    finally:
        # Nothing the test started is left running, nor its copy of the cluster.
        subprocess.run([REPLICA, "stop"], env=s.env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(s.folder, ignore_errors=True)


def _pulse_at() -> object:
    with connection.cursor() as cur:
        cur.execute("SELECT seen_at FROM accs_cluster_pulse WHERE name = %s", [pulse.PULSE_NAME])
        row = cur.fetchone()
    return row[0] if row else None


def _leader_term() -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM accs_leader WHERE expires_at > now()")
        return cur.fetchone()[0] > 0


def _caught_up(standby: Standby, lsn: str) -> bool:
    return standby.query("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))[0]


def test_leases_that_ended_during_a_promotion_are_an_outage_not_dead_agents(standby, make_service, daemons: Daemons):
    svc = make_service("failover", max_attempts=1, lease_seconds=LEASE)  # a counted failure dead-letters it
    primary_builder = daemons.start("runbuilder", "--tick", "0.2", "--lease-seconds", "3", name="builder-primary")
    first = _pulse_at()
    wait_for(lambda: _pulse_at() not in (None, first) and _leader_term(), timeout=60,
             message="the primary's builder stamps the pulse and leads")

    # An agent that died before the failover: the primary's leader rescues its task as lease_expired.
    dead_job = api.start_service("failover")
    (dead,) = claim_for(svc)
    with connection.cursor() as cur:
        cur.execute("UPDATE accs_task SET heartbeat_at = now() - interval '63 s',"
                    " lease_expires_at = now() - interval '60 s' WHERE id = %s", [dead.id])
    wait_for(lambda: Task.objects.get(pk=dead.id).status == "error", timeout=30,
             message="the primary's leader dead-letters the dead agent's task")

    # Agents hold two tasks and renew their leases; then the primary is lost to the engine.
    jobs = [api.start_service("failover") for _ in range(2)]
    held = claim_for(svc)
    assert sorted(t.job_id for t in held) == sorted(j.id for j in jobs)
    lost, _ = transitions.heartbeat([(t.id, t.attempt) for t in held], agent_id="agent-t", lease_seconds=LEASE)
    assert lost == set()
    stop_process(primary_builder, sig=9)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn()::text")
        lsn = cur.fetchone()[0]
    last_stamp = _pulse_at()
    lease_ends = sorted(Task.objects.get(pk=t.id).lease_expires_at for t in held)
    assert lease_ends[0] > last_stamp, "the leases end after the primary's last stamp: during the failover"
    connection.close()

    wait_for(lambda: _caught_up(standby, lsn), timeout=60, message="the standby replays the primary's last writes")
    # The failover takes longer than the pulse's gap, and the agents' leases end during it.
    wait_for(lambda: standby.query(
        "SELECT clock_timestamp() > %s AND clock_timestamp() > %s",
        (last_stamp + timedelta(seconds=pulse.GAP_SECONDS + 0.5), lease_ends[-1]))[0],
        timeout=30, message="the gap and the leases pass on the standby's clock")
    assert standby.query("SELECT pg_is_in_recovery()")[0] is True
    standby.run("promote")
    wait_for(lambda: standby.query("SELECT NOT pg_is_in_recovery()")[0], timeout=60,
             message="the promoted standby accepts writes")
    # The old rule's signal: the promoted server started before the leases were last renewed.
    renewed = standby.query("SELECT min(heartbeat_at) FROM accs_task WHERE id = ANY(%s)", ([t.id for t in held],))[0]
    assert standby.query("SELECT pg_postmaster_start_time()")[0] < renewed

    daemons.start("runbuilder", "--tick", "0.2", name="builder-promoted", env={"ACC_DB_URL": standby.url})
    ids = [t.id for t in held]
    wait_for(lambda: standby.query("SELECT count(*) FROM accs_task WHERE id = ANY(%s)"
                                   " AND status NOT IN ('starting', 'running')", (ids,))[0] == len(ids),
             timeout=60, message="the promoted server's leader rescues the leases that ended in the failover")

    (outage,) = standby.rows("SELECT began_at, ended_at, cause FROM accs_outage")
    assert outage[0] == last_stamp and outage[2] == "gap" and outage[1] > lease_ends[-1]
    tasks = standby.rows("SELECT status, attempt, max_attempts, error_code FROM accs_task WHERE id = ANY(%s)", (ids,))
    assert tasks == [("queued", 1, 2, "outage")] * 2, "queued again, the budget untouched (one more attempt)"
    attempts = standby.rows("SELECT status FROM accs_attempt WHERE task_id = ANY(%s)", (ids,))
    assert attempts == [("interrupted",)] * 2
    counted = standby.rows("SELECT data->'counted' FROM accs_event WHERE type = 'retry' AND task_id = ANY(%s)", (ids,))
    assert counted == [(False,)] * 2
    assert standby.query("SELECT status, error_code FROM accs_task WHERE id = %s", (dead.id,)) == (
        "error", "lease_expired"), "the agent that died before the failover is still a dead agent"
    assert standby.query("SELECT status FROM accs_job WHERE id = %s", (dead_job.id,))[0] == "error"
