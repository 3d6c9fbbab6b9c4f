"""ACCS inside a team's own Django site (tests/embedded_site): its own settings, its own app with a
foreign key to ``jobs.Job``, its own ``manage.py`` running ACCS's daemons, and the admin pages in a
real browser."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

from tests import forkserver
from tests.browser import css, log_in, wait
from tests.daemons import Daemons, wait_for
from tests.ops_helpers import PASSWORD

SITE = Path(__file__).resolve().parents[1] / "embedded_site"
MANAGE = SITE / "manage.py"


def _server_url(dbname: str) -> str:
    base = os.environ["ACC_DB_URL"].rsplit("/", 1)[0]
    return f"{base}/{dbname}"


# One worker runs the whole module (make test), so the site's database is created and migrated once.
pytestmark = pytest.mark.xdist_group("embedded-site")


@pytest.fixture(scope="module")
def site_env(tmp_path_factory):
    """A fresh database for the site, migrated by the site's manage.py; dropped afterwards."""
    name = f"accs_embedded_{uuid.uuid4().hex[:8]}"
    admin_url = os.environ["ACC_DB_URL"]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACC_", "DJANGO_SETTINGS"))}
    env.update(SHOP_DB_URL=_server_url(name), PYTHONUNBUFFERED="1", DJANGO_SUPERUSER_PASSWORD=PASSWORD)
    migrated = manage(env, "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    yield env
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(env: dict[str, str], *args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, str(MANAGE), *args], cwd=SITE, env={**env, **(extra or {})},
                          capture_output=True, text=True, timeout=120)


def query(env: dict[str, str], sql: str, *params):
    with psycopg.connect(env["SHOP_DB_URL"], autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def test_site_checks_clean_and_needs_no_migrations_for_accs(site_env):
    checked = manage(site_env, "check")
    assert checked.returncode == 0, checked.stderr
    assert "no issues" in checked.stdout
    pending = manage(site_env, "makemigrations", "--check", "--dry-run")
    assert pending.returncode == 0, pending.stdout + pending.stderr
    assert "No changes detected" in pending.stdout


def test_malformed_acc_value_stops_the_sites_manage_py(site_env):
    bad = manage(site_env, "check", extra={"ACC_SLOT_CAP": "lots"})
    assert bad.returncode != 0
    assert "ACC_SLOT_CAP" in bad.stderr and "accs.E001" in bad.stderr


def test_order_and_job_commit_together_and_site_daemons_run_it(site_env, tmp_path):
    rolled = manage(site_env, "place_order", "R-0", "--rollback")
    assert rolled.returncode == 0 and "rolled back" in rolled.stdout, rolled.stderr
    assert query(site_env, "SELECT count(*) FROM accs_job")[0][0] == 0, "the rollback left no job"

    placed = manage(site_env, "place_order", "R-1")
    assert placed.returncode == 0, placed.stderr
    job_id, receipt_id = placed.stdout.split()
    assert query(site_env, "SELECT job_id::text FROM shop_order WHERE reference = 'R-1'") == [(job_id,)]

    keys = manage(site_env, "accs_tasks", "--keys")
    assert keys.returncode == 0, keys.stderr
    daemons = Daemons(site_env, tmp_path, manage_py=MANAGE)
    try:
        daemons.builder()
        daemons.agent("shop-node", f"shop-pack,{keys.stdout.strip()}")
        wait_for(lambda: query(site_env, "SELECT count(*) FROM accs_job WHERE status = 'done'")[0][0] == 2,
                 timeout=60, message="the order's job and its receipt task done by the site's agent")
    finally:
        daemons.stop_all()
    (results,) = query(site_env, "SELECT t.results FROM accs_task t WHERE t.job_id = %s", uuid.UUID(job_id))[0]
    assert results == {"slip": "SLIP-R-1"}
    (receipt,) = query(site_env, "SELECT t.results FROM accs_task t WHERE t.job_id = %s", uuid.UUID(receipt_id))[0]
    assert receipt == {"return_value": "receipt for R-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def site_server(site_env, tmp_path):
    """The site served by its own manage.py (runserver), with a superuser to log in as."""
    created = manage(site_env, "createsuperuser", "--noinput", "--username", "root", "--email", "root@example.test")
    assert created.returncode == 0 or "already taken" in created.stderr, created.stderr
    port = _free_port()
    log = open(tmp_path / "runserver.log", "w")
    proc = forkserver.Popen([sys.executable, str(MANAGE), "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure"],
                            cwd=SITE, env=site_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return urllib.request.urlopen(f"{base}/api/v1/health", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_for(answers, timeout=30, message="the embedded site's server")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.browser
def test_admin_job_page_dashboard_api_and_metrics_answer_in_the_site(site_env, site_server, browser):
    base = site_server
    scrape = urllib.request.Request(f"{base}/metrics", headers={"Authorization": "Bearer shop-scrape-token"})
    assert urllib.request.urlopen(scrape, timeout=10).status == 200
    assert b"accs_" in urllib.request.urlopen(scrape, timeout=10).read()
    openapi = urllib.request.urlopen(f"{base}/api/v1/openapi.json", timeout=10)
    assert openapi.status == 200 and b"/api/v1/jobs" in openapi.read()
    if not query(site_env, "SELECT 1 FROM accs_job LIMIT 1"):
        assert manage(site_env, "place_order", "R-2").returncode == 0
    (job_id,) = query(site_env, "SELECT id::text FROM accs_job ORDER BY created_at LIMIT 1")[0]

    log_in(browser, base, "root")
    browser.get(f"{base}/admin/jobs/job/{job_id}/change/")
    wait(browser, lambda d: css(d, "svg.accs-dag"), "the job page's DAG picture")
    assert css(browser, "tr.accs-task"), "the job's tasks"
    browser.get(f"{base}/admin/dashboard/")
    wait(browser, lambda d: css(d, "#accs-cards"), "the dashboard's summary cards")
    wait(browser, lambda d: int(css(d, "#accs-dashboard")[0].get_attribute("data-refreshed") or 0) >= 1,
         "the dashboard refreshing itself from data.json")
    browser.get(f"{base}/admin/")
    assert "Server Error" not in browser.page_source
