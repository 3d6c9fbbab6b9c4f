"""Long work across a PostgreSQL stop: a real builder and agent, PostgreSQL stopped while two long tasks run.

Run twice: at an operator's real lengths (a 90 s stop under the default 120 s lease, a service with
a 300 s lease, the short task's service with a 30 s one; about two and a half minutes) and shortened
in proportion (the site's lease 8 s, so the agent stops work it cannot renew after 6 s; a 12 s stop;
20 s tasks). In both:

* the task whose service has a long lease (60 s, longer than the stop) finishes in ONE attempt;
* the task with the short (site) lease is stopped by the agent during the stop, and queued again
  WITHOUT using its retry budget (its service allows one attempt: a counted failure would have
  dead-lettered it), then finishes;
* the agent's log has no traceback and no ``--- Logging error ---``, although the long task logs
  to its timeline through the log handler all through the stop.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
from django.db import connections

from jobs import api
from tests.daemons import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PG_LOCAL = str(ROOT / "scripts" / "pg_local.sh")
WORK = {"executor": "python", "executor_config": {"callable": "tests.outage_task:work"},
        "params_schema": {"type": "object", "properties": {"seconds": {"type": "number"}}}, "max_attempts": 1}


@dataclass(frozen=True)
class Lengths:
    """Seconds: the site's lease (None: the default), the two services' leases, the stop, the tasks' work."""

    site_lease: int | None
    long_lease: int
    short_lease: int | None  # None: the short task's service takes the site's lease
    outage: int  # longer than the short lease, shorter than the long one
    long_task: int  # still running when PostgreSQL comes back
    short_task: int


REAL = Lengths(site_lease=None, long_lease=300, short_lease=30, outage=90, long_task=110, short_task=40)
SHORT = Lengths(site_lease=8, long_lease=60, short_lease=None, outage=12, long_task=20, short_task=20)


def _rows(url: str, sql: str, params=()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
        return conn.execute(sql, params).fetchall()


def _statuses(url: str, job_ids) -> dict:
    try:
        return dict(_rows(url, "SELECT id, status FROM accs_job WHERE id = ANY(%s)", [list(job_ids)]))
    except psycopg.OperationalError:  # the server is still starting
        return {}


@pytest.mark.parametrize("lengths", [REAL, SHORT], ids=["90s-stop-300s-lease", "shortened"])
def test_long_work_survives_a_postgresql_stop_with_its_services_lease(make_service, daemons, db_url,
                                                                       lengths: Lengths):
    local = subprocess.run([PG_LOCAL, "url"], capture_output=True, text=True, check=True).stdout.strip()
    if urlparse(db_url).port != urlparse(local).port:
        pytest.skip("stopping PostgreSQL needs the project-local server (scripts/pg_local.sh)")
    make_service("long-work", lease_seconds=lengths.long_lease, **WORK)
    make_service("short-lease", lease_seconds=lengths.short_lease, **WORK)
    env = {"ACC_LOG_FORMAT": "json"}
    if lengths.site_lease is not None:
        env["ACC_HEARTBEAT_TTL_SEC"] = str(lengths.site_lease)
    daemons.start("runbuilder", "--tick", "0.2", name="builder", env=env)
    agent = daemons.agent("outage", "long-work,short-lease", "--max-concurrent", "2", env=env)
    long_job = api.start_service("long-work", params={"seconds": lengths.long_task})
    short_job = api.start_service("short-lease", params={"seconds": lengths.short_task})
    jobs = {long_job.id: "long", short_job.id: "short"}
    wait_for(lambda: _rows(db_url, "SELECT count(*) FROM accs_task WHERE job_id = ANY(%s) AND status = 'running'",
                           [list(jobs)])[0][0] == 2, timeout=60, message="both long tasks running")
    connections.close_all()  # this test's own connection would die with the server

    subprocess.run([PG_LOCAL, "stop"], check=True, capture_output=True)
    try:
        time.sleep(lengths.outage)  # the outage itself: how long PostgreSQL stays down
    finally:
        subprocess.run([PG_LOCAL, "start"], check=True, capture_output=True)

    wait_for(lambda: set(_statuses(db_url, jobs).values()) <= {"done", "error", "partial", "canceled"}
             and len(_statuses(db_url, jobs)) == 2,
             timeout=120 + 2 * lengths.long_task, interval=0.5, message="both jobs final")
    assert _statuses(db_url, jobs) == {long_job.id: "done", short_job.id: "done"}, _rows(db_url, """
        SELECT t.job_id, a.attempt_no, a.status, a.error_text, t.error_code, t.max_attempts
          FROM accs_task t JOIN accs_attempt a ON a.task_id = t.id WHERE t.job_id = ANY(%s)""", [list(jobs)])
    attempts = {jobs[job_id]: (n, codes) for job_id, n, codes in _rows(db_url, """
        SELECT t.job_id, count(a.*),
               array_agg(a.status || ':' || split_part(a.error_text, ':', 1) ORDER BY a.attempt_no)
          FROM accs_task t JOIN accs_attempt a ON a.task_id = t.id WHERE t.job_id = ANY(%s) GROUP BY t.job_id""",
        [list(jobs)])}
    assert attempts["long"] == (1, ["succeeded:"]), "the long lease carried the task across the stop"
    # Stopped by the outage, then run again. The agent names it an outage when it saw the database
    # unreachable before its lease deadline; else it reports lease_lost, and the restart since the
    # lease's last renewal makes it one all the same (its attempt row then says interrupted too, so
    # the bound of refunds counts it).
    assert attempts["short"][0] == 2, "stopped by the outage, then run again"
    assert attempts["short"][1] in (["interrupted:outage", "succeeded:"], ["interrupted:lease_lost", "succeeded:"])
    budget = _rows(db_url, "SELECT max_attempts FROM accs_task WHERE job_id = %s", [short_job.id])[0][0]
    assert budget == 2, "the attempt the outage stopped did not use up the one-attempt budget"
    (why,) = _rows(db_url, "SELECT message FROM accs_event WHERE job_id = %s AND type = 'retry'", [short_job.id])
    assert "stopped by a database outage" in why[0]

    agent.terminate()
    agent.wait(timeout=30)
    text = agent.log_path.read_text()
    assert "Traceback" not in text and "Logging error" not in text, text[-3000:]
    assert "the timeline cannot take log lines" in text, "the long task logged through the handler in the stop"
    assert "the timeline takes log lines again" in text


def test_an_attempt_waits_out_a_restart_that_catches_it_reading_its_inputs(make_service, daemons, db_url):
    """PostgreSQL restarts while a claimed attempt reads its parents' outputs, before its work runs.

    The read is held on a lock (a test connection holds the workflow table exclusively) until the
    restart cuts it. The attempt tries the read again once the database answers and runs: one
    attempt, succeeded, nothing logged as an error. (Before, the read's error failed the attempt as
    an executor crash and a second attempt ran the work.)
    """
    local = subprocess.run([PG_LOCAL, "url"], capture_output=True, text=True, check=True).stdout.strip()
    if urlparse(db_url).port != urlparse(local).port:
        pytest.skip("restarting PostgreSQL needs the project-local server (scripts/pg_local.sh)")
    make_service("reads-inputs", backoff_base_seconds=0, backoff_cap_seconds=0)
    job = api.start_service("reads-inputs")  # before the lock: starting a job reads the workflow table too
    blocker = psycopg.connect(db_url)
    try:
        blocker.execute("LOCK TABLE accs_workflow IN ACCESS EXCLUSIVE MODE")
        agent = daemons.agent("inputs", "reads-inputs", env={"ACC_LOG_FORMAT": "json"})
        # The claim's batch read of its tasks' inputs gives up on the lock (it must not hold up the
        # agent's loop); the attempt's own read is then one call of accs_step_inputs (jobs.inputs),
        # waiting on the workflow table's lock.
        wait_for(lambda: _rows(db_url, """
            SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE 'SELECT * FROM accs_step_inputs(%%'""")[0][0] == 1,
                 timeout=60, message="the attempt's read of its inputs waits on the lock")
        connections.close_all()  # this test's own connections die with the server
        subprocess.run([PG_LOCAL, "stop"], check=True, capture_output=True)
        subprocess.run([PG_LOCAL, "start"], check=True, capture_output=True)
    finally:
        blocker.close()  # (a failure before the restart must not leave the agent's read waiting for ever)

    wait_for(lambda: _statuses(db_url, [job.id]).get(job.id) in ("done", "error"), timeout=90, interval=0.3,
             message="the job final")
    attempts = _rows(db_url, """
        SELECT a.attempt_no, a.status, a.error_text FROM accs_task t JOIN accs_attempt a ON a.task_id = t.id
         WHERE t.job_id = %s ORDER BY a.attempt_no""", [job.id])
    assert [(n, status) for n, status, _ in attempts] == [(1, "succeeded")], attempts
    agent.terminate()
    agent.wait(timeout=30)
    text = agent.log_path.read_text()
    assert "could not read its parents' outputs" in text
    assert "inputs waited out a lock; each reads its own" in text
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]
