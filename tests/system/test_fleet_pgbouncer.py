"""A fleet through PgBouncer in transaction mode: two builders, four agents, the web app, a leader kill, a restart.

Everything but the LISTEN connections goes through a real PgBouncer (scripts/pgbouncer_local.sh,
``pool_mode = transaction``) with ``ACC_DB_POOLER=pgbouncer``; LISTEN goes straight to PostgreSQL
(``ACC_LISTEN_DB_URL``). In the middle of the run the leading builder is killed with SIGKILL (and
started again) and PostgreSQL is restarted. From the database: every job done, no task run twice,
no two leader terms whose writes overlap; in the logs, no error lines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest
import requests
from django.db import connections

from jobs import api
from jobs.models import Job, Task
from tests.api_helpers import user_with_token
from tests.daemons import free_port, http_server, overlapping_terms, stop_process, wait_for, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
JOBS = int(os.environ.get("ACC_FLEET_JOBS", "2000"))
AGENTS = 4


def _local_cluster_url() -> str:
    return subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "url"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def pgbouncer(db_url, tmp_path):
    """Start PgBouncer in front of the test database's server; yield the pooled URL."""
    target = urlparse(db_url)
    env = {**os.environ, "ACC_PGBOUNCER_DIR": str(tmp_path / "pgbouncer"), "ACC_PGBOUNCER_PORT": str(free_port()),
           "ACC_PGBOUNCER_TARGET_PORT": str(target.port)}
    script = str(ROOT / "scripts" / "pgbouncer_local.sh")
    if not (shutil.which("pgbouncer") or Path("/usr/sbin/pgbouncer").exists()) and not os.environ.get("CI"):
        pytest.skip("PgBouncer is not installed (scripts/pgbouncer_local.sh install)")
    started = subprocess.run([script, "start"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"PgBouncer did not start: {started.stderr}")
    try:
        yield subprocess.run([script, "url", target.path.lstrip("/")], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True)


@pytest.fixture
def pooled_env(db_url, pgbouncer) -> dict[str, str]:
    """Environment of a process behind PgBouncer, LISTEN straight to PostgreSQL."""
    return {"ACC_DB_URL": pgbouncer, "ACC_DB_POOLER": "pgbouncer", "ACC_LISTEN_DB_URL": db_url,
            "ACC_POLL_INTERVAL_SEC": "0.5", "ACC_LOG_FORMAT": "json"}


@pytest.fixture
def web_app(daemons, pooled_env):
    """Serve the app (tests/wsgi_server.py) through PgBouncer; yield its URL."""
    port = free_port()
    with http_server([sys.executable, str(ROOT / "tests" / "wsgi_server.py"), "127.0.0.1", str(port)],
                     env={**daemons.env, **pooled_env, "ACC_DB_CONN_MAX_AGE": "0"}, port=port,
                     log_path=daemons.log_dir / "web.log", name="web app") as url:
        yield url


def _query(url: str, sql: str, params=()):
    """Run one query, waiting out an outage (the restart) for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
                return conn.execute(sql, params).fetchall()
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the pause between tries of a bounded retry, not a wait for another process


def _done(url: str) -> int:
    return _query(url, "SELECT count(*) FROM accs_job WHERE status = 'done'")[0][0]


def _error_lines(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                level = json.loads(line).get("level", "")
            except ValueError:
                level = "error" if "Traceback" in line else ""
            if level in ("error", "critical"):
                bad.append(f"{path.name}: {line[:300]}")
    return bad


@pytest.mark.slow
def test_a_fleet_through_pgbouncer_survives_a_leader_kill_and_a_restart(make_service, daemons, db_url, pooled_env,
                                                                        web_app):
    if urlparse(db_url).port != urlparse(_local_cluster_url()).port:
        pytest.skip("restarting PostgreSQL needs the project-local server (scripts/pg_local.sh)")
    # A rate limit no claim reaches: each start is recorded and the leader's rate-window duty
    # deletes the old ones every 10 s, a leader-only write in every term that lasts.
    make_service("fleet", backoff_base_seconds=0, backoff_cap_seconds=0, rate_limit=1_000_000, rate_period_seconds=1)
    env = pooled_env

    def builder(name: str):
        return daemons.start("runbuilder", "--tick", "0.2", "--lease-seconds", "3", name=name, env=env)

    _, token = user_with_token("fleet-web", superuser=True)
    builders = [builder(f"builder-{i}") for i in range(2)]
    for i in range(AGENTS):
        daemons.agent(f"fleet-{i}", "fleet", "--max-concurrent", "8", env=env)
    started = time.monotonic()
    total = JOBS + JOBS // 4
    api.start_many([api.JobSpec(service="fleet", params={"n": i}) for i in range(JOBS)])

    wait_for(lambda: _done(db_url) >= JOBS // 4, timeout=90, interval=0.2, message="a quarter of the jobs done")
    holder, first_fence = _query(db_url, "SELECT holder, fence FROM accs_leader WHERE expires_at > now()")[0]
    leader = next(p for p in builders if p.pid == int(holder.split(":")[1]))
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    builders.append(builder("builder-2"))
    wait_for(lambda: _query(db_url, "SELECT fence FROM accs_leader WHERE expires_at > now()"), timeout=30,
             message="a builder leads again after the kill")

    wait_for(lambda: _done(db_url) >= JOBS // 2, timeout=90, interval=0.2, message="half of the jobs done")
    subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "stop"], check=True, capture_output=True)
    time.sleep(1)  # the outage under test, a little longer than a blink: the daemons see their connections fail
    subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "start"], check=True, capture_output=True)
    connections.close_all()  # this test's own connection died with the server
    # Jobs started after the restart: the fleet drains fast enough to finish the first batch during the
    # outage's stop, and these make sure work flows through the pooler again afterwards.
    api.start_many([api.JobSpec(service="fleet", params={"n": i}) for i in range(JOBS, total)])

    wait_for(lambda: _done(db_url) == total, timeout=120, interval=0.5, message=f"all {total} jobs done")
    took = time.monotonic() - started
    # The overlap check below means something only if a leader wrote: the rate-window duty deletes the
    # starts left over every 10 s, and a fleet that drains within a term's first 10 s has not run it yet.
    wait_for(lambda: _query(db_url, "SELECT count(*) FROM accs_leader_term WHERE writes > 0")[0][0] >= 1,
             timeout=30, interval=0.5, message="a leader's term wrote (the rate-window duty)")

    def summary():
        return requests.get(f"{web_app}/api/v1/jobs/summary", headers={"Authorization": f"Bearer {token}"},
                            timeout=30)

    # Until PgBouncer logs in to the restarted server again (server_login_retry after a failed login) the
    # web app answers 503 "retry"; then it answers, the same queries many times over.
    wait_for(lambda: summary().status_code == 200, timeout=30, interval=0.2,
             message="the web app answers through PgBouncer after the restart")
    for _ in range(10):
        answer = summary()
        assert answer.status_code == 200, answer.text[:500]
        assert answer.json()["counts"]["done"] == total
    counts = _query(db_url, """
        SELECT (SELECT count(*) FROM accs_job WHERE status <> 'done'),
               (SELECT count(*) FROM (SELECT task_id FROM accs_attempt GROUP BY task_id HAVING count(*) > 1) t),
               (SELECT count(*) FROM accs_leader_term),
               (SELECT count(*) FROM accs_leader_term WHERE writes > 0),
               (SELECT coalesce(sum(writes), 0) FROM accs_leader_term)""")[0]
    not_done, run_twice, terms, writing_terms, writes = counts
    overlaps = overlapping_terms(db_url)
    for proc in daemons.procs:
        if proc.poll() is None:
            stop_process(proc)
    errors = _error_lines([p.log_path for p in daemons.procs] + [daemons.log_dir / "web.log"])
    print(f"fleet through PgBouncer: {total} jobs in {took:.1f}s, {terms} leader terms ({writing_terms} wrote, "
          f"{writes} units), "
          f"first fence {first_fence}, not done {not_done}, run twice {run_twice}, overlaps {len(overlaps)}")
    assert not_done == 0
    assert run_twice == 0, _query(db_url, """
        SELECT a.task_id, a.attempt_no, a.node, a.status, a.started_at, a.finished_at, left(a.error_text, 200)
        FROM accs_attempt a WHERE a.task_id IN (SELECT task_id FROM accs_attempt GROUP BY task_id HAVING count(*) > 1)
        ORDER BY a.task_id, a.attempt_no""")
    assert terms >= 2, "the killed leader was replaced by a new term"
    assert writing_terms >= 1, "the leaders wrote (the rate-window duty), so the overlap check means something"
    assert overlaps == []
    assert errors == [], "\n".join(errors[:20])


@pytest.mark.parametrize("command", [["runbuilder"], ["runagent", "--node", "refused", "--services", "svc"]])
def test_a_daemon_refused_by_pgbouncer_says_what_to_set_and_exits(command, make_service, daemons, pgbouncer):
    make_service("svc")
    proc = daemons.start(*command, name=command[0], env={"ACC_DB_URL": pgbouncer, "ACC_LOG_FORMAT": "json"})
    assert proc.wait(timeout=60) == 2
    lines = [json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{")]
    errors = [line["msg"] for line in lines if line["level"] == "error"]
    assert len(errors) == 1, lines
    assert "configuration error" in errors[0] and "unsupported startup parameter: options" in errors[0]
    assert "ACC_DB_POOLER=pgbouncer" in errors[0]
    assert not any("waiting for PostgreSQL" in line["msg"] for line in lines)


def test_behind_pgbouncer_without_a_listen_url_agents_say_so_once_and_poll(make_service, daemons, db_url, pgbouncer):
    svc = make_service("polled")
    env = {"ACC_DB_URL": pgbouncer, "ACC_DB_POOLER": "pgbouncer", "ACC_LOG_FORMAT": "json",
           "ACC_POLL_INTERVAL_SEC": "0.3"}
    agent = daemons.agent("polling", "polled", env=env)
    wait_for(lambda: "no NOTIFY wake-ups" in agent.log_path.read_text(), timeout=30, message="the agent says it polls")
    for _ in range(10):
        api.start_service(svc)
    wait_for(lambda: _done(db_url) == 10, timeout=30, message="the agent ran every task by polling")
    assert agent.log_path.read_text().count("no NOTIFY wake-ups") == 1
    listening = _query(db_url, "SELECT count(*) FROM pg_stat_activity"
                               " WHERE application_name LIKE 'accs agent polling%%' AND query LIKE 'LISTEN%%'")[0][0]
    assert listening == 0
    assert _error_lines([agent.log_path]) == []


def _pickup_p50_ms(make_service, daemons, *, key: str, env: dict[str, str], jobs: int = 25) -> float:
    """Start one job at a time to an idle agent; return the median of created → claimed (PostgreSQL's clock)."""
    svc = make_service(key)
    agent = daemons.agent(f"pickup-{key}", key, env=env)
    wait_for(lambda: "started on node" in agent.log_path.read_text(), timeout=60, message="the agent is up")
    wait_for(lambda: _query(daemons.env["ACC_DB_URL"], "SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name = %s AND query LIKE 'LISTEN%%' AND state = 'idle'",
                            (f"accs agent pickup-{key} listen",))[0][0],
             timeout=30, message="the agent's LISTEN connection is open (it opens it as it first waits)")
    ids = []
    for _ in range(jobs):
        ids.append(str(api.start_service(svc).id))
        wait_for(lambda: _query(daemons.env["ACC_DB_URL"], "SELECT count(*) FROM accs_task WHERE job_id = %s::uuid"
                                " AND claimed_at IS NOT NULL", (ids[-1],))[0][0], timeout=10,
                 message="the job is picked up")
    stop_process(agent)
    [(p50,)] = _query(daemons.env["ACC_DB_URL"], "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY"
                      " extract(epoch FROM claimed_at - created_at) * 1000) FROM accs_task"
                      " WHERE job_id = ANY(%s::uuid[])", (ids,))
    return float(p50)


@pytest.mark.slow
def test_pickup_through_pgbouncer_with_a_direct_listen_is_woken_by_notify_like_direct(make_service, daemons,
                                                                                      pooled_env):
    """Behind PgBouncer with a direct LISTEN, an idle agent is woken by NOTIFY as a direct one is.

    The agents poll every 30 s and each job must be picked up within 10 s of its start (in
    ``_pickup_p50_ms``), so every pick-up was a wake-up, not a poll. How the two medians compare is a
    performance figure a loaded machine distorts: bench/fleet.py measures it (direct and pgbouncer modes).
    """
    poll = {"ACC_POLL_INTERVAL_SEC": "30"}
    direct = _pickup_p50_ms(make_service, daemons, key="direct", env=poll)
    pooled = _pickup_p50_ms(make_service, daemons, key="pooled", env={**pooled_env, **poll})
    print(f"pick-up p50: direct {direct:.1f} ms, through PgBouncer with a direct LISTEN {pooled:.1f} ms")


def test_behind_pgbouncer_a_busy_capped_lock_is_claimed_again_soon_not_at_the_next_poll(make_service, daemons,
                                                                                          db_url, pooled_env):
    """Behind a pooler, a claim that finds a capped service's lock held by another transaction does
    not wait for it (that would hold a pooled server connection): its other services are claimed
    meanwhile, and the agent claims again after a short, growing delay, so the capped task starts
    soon after the lock is free although the agent polls every 30 s and no NOTIFY says so."""
    capped = make_service("capped-busy", max_concurrent=2)
    make_service("quick")
    daemons.agent("n1", "capped-busy,quick", "--poll-interval", "30", env=pooled_env)
    first = api.start_service("quick")
    wait_until(lambda: Job.objects.filter(pk=first.pk, status="done").exists(), timeout=30,
               message="the agent runs work (and LISTENs once it first waits)")
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"accs:service:{capped.id}"])
        waiting = api.start_service("capped-busy")
        other = api.start_service("quick")
        wait_until(lambda: Job.objects.filter(pk=other.pk, status="done").exists(), timeout=10,
                   message="the other service's job ran while the capped service's lock was held")
        assert Task.objects.get(job=waiting).status == "queued", "claimed past a lock another transaction held"
        holder.rollback()  # the lock is free again; no NOTIFY tells the agent so
    wait_until(lambda: Job.objects.filter(pk=waiting.pk, status="done").exists(), timeout=10,
               message="the capped job ran within 10 s of the lock's release, not at the 30 s poll")
