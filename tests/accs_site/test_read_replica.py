"""ACC_READ_DB_URL against a real streaming replica (scripts/pg_replica_local.sh, pg_basebackup -R).

The replica's replay is paused while a job is created on the primary: a page or API read that does
not show the job read the replica, a read that shows it read the primary. Writes go to the primary;
the engine's reads (outside a request, or inside a transaction) never go to the replica; without
ACC_READ_DB_URL there is no replica and nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections, router, transaction
from django.test import RequestFactory

from accs_site import dbrouter
from jobs import api
from jobs.ids import short_id
from jobs.models import Job
from tests.api_helpers import client_for, user_with_token
from tests.daemons import wait_for
from tests.ops_helpers import make_user

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pg_replica_local.sh"

# One worker runs the whole module (make test), so its replica is copied and started once.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.xdist_group("read-replica")]


def _local_port() -> str:
    base = Path(os.environ.get("ACC_PG_DIR") or ROOT / ".local" / "pg")
    return ((base if base.is_absolute() else ROOT / base) / "port").read_text().strip()


@pytest.fixture(scope="module")
def replica_port(django_db_blocker) -> Iterator[str]:
    """Start the local streaming replica of the cluster the tests use; return its port."""
    with django_db_blocker.unblock():
        primary = connection.settings_dict
    if str(primary["PORT"]) != _local_port():
        pytest.skip("the test database is not on scripts/pg_local.sh's cluster (ACC_TEST_DB_URL or a container),"
                    " so scripts/pg_replica_local.sh cannot replicate it")
    done = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"scripts/pg_replica_local.sh start failed:\n{done.stderr}"
    url = subprocess.run([str(SCRIPT), "url"], capture_output=True, text=True, check=True).stdout.strip()
    yield url.rsplit(":", 1)[1].split("/", 1)[0]
    # The suite leaves nothing running that it started.
    subprocess.run([str(SCRIPT), "stop"], capture_output=True, timeout=120, check=False)


@pytest.fixture
def replica(replica_port, settings):
    """Add the ``replica`` alias and the router, as ACC_READ_DB_URL does; return a direct connection to it."""
    cfg = {**connection.settings_dict, "HOST": "127.0.0.1", "PORT": replica_port}
    cfg["OPTIONS"] = {**cfg.get("OPTIONS", {}), "application_name": "accs-read"}
    cfg["CONN_MAX_AGE"] = None  # one connection for the test, opened here:
    connections.settings[dbrouter.REPLICA] = cfg
    # Django's test case refuses to open a connection to an alias it was not told about; open it first.
    connections[dbrouter.REPLICA].connect()
    settings.DATABASE_ROUTERS = ["accs_site.dbrouter.ReadReplicaRouter"]
    direct = psycopg.connect(host="127.0.0.1", port=replica_port, user=cfg["USER"] or "postgres", dbname=cfg["NAME"],
                             autocommit=True)
    try:
        yield direct
    finally:
        direct.execute("SELECT pg_wal_replay_resume()")
        direct.close()
        connections[dbrouter.REPLICA].close()
        del connections[dbrouter.REPLICA]
        del connections.settings[dbrouter.REPLICA]


def _replayed(direct, job_id) -> bool:
    return direct.execute("SELECT 1 FROM accs_job WHERE id = %s", [job_id]).fetchone() is not None


def test_page_and_api_reads_go_to_the_replica_and_writes_to_the_primary(replica, client, make_service):
    make_service("work")
    root = make_user("root", superuser=True)
    _user, token = user_with_token("reader", superuser=True)
    seen = api.start_service("work")
    wait_for(lambda: _replayed(replica, seen.pk), timeout=30, message="the replica replays the first job")
    replica.execute("SELECT pg_wal_replay_pause()")
    wait_for(lambda: replica.execute("SELECT pg_get_wal_replay_pause_state()").fetchone()[0] == "paused",
             timeout=30, message="the replica's replay pauses")
    hidden = api.start_service("work")  # committed on the primary, not replayed on the replica
    assert Job.objects.filter(pk=hidden.pk).exists()  # outside a request: the primary

    client.force_login(root)  # the session and the user are the primary's: a login works at once
    listing = client.get("/admin/jobs/job/").content.decode()
    assert short_id(seen.pk) in listing and short_id(hidden.pk) not in listing
    assert client.get(f"/admin/jobs/job/{hidden.pk}/change/").status_code == 302  # "doesn't exist" on the replica
    dashboard = client.get("/admin/dashboard/").content.decode()
    assert 'id="accs-replica"' in dashboard and "Read replica" in dashboard
    lag = client.get("/admin/dashboard/data.json").json()["data"]["replica"]
    assert lag["error"] == "" and lag["seconds"] is not None and lag["receiving"] is True

    http = client_for(token)  # a token made a moment ago authenticates (tokens are read on the primary)
    ids = [j["id"] for j in http.get("/api/v1/jobs").json()["items"]]
    assert str(seen.pk) in ids and str(hidden.pk) not in ids
    assert http.get(f"/api/v1/jobs/{hidden.pk}").status_code == 404

    created = http.post("/api/v1/jobs", {"service": "work"}, content_type="application/json")
    assert created.status_code == 201, created.content
    new_id = created.json()["id"]
    assert Job.objects.filter(pk=new_id).exists()  # the write went to the primary
    assert http.get(f"/api/v1/jobs/{new_id}").status_code == 404  # and the replica has not replayed it yet

    replica.execute("SELECT pg_wal_replay_resume()")
    wait_for(lambda: http.get(f"/api/v1/jobs/{new_id}").status_code == 200, timeout=30,
             message="once replay resumes, the API reads the new job from the replica")
    assert short_id(hidden.pk) in client.get("/admin/jobs/job/").content.decode()


def test_the_engine_never_reads_the_replica(replica):
    """Outside a request, inside a transaction, or for tokens: the primary, whatever the request."""
    assert router.db_for_read(Job) == DEFAULT_DB_ALIAS  # a daemon or a command: no request
    chosen = {}

    def view(request):
        chosen["page"] = router.db_for_read(Job)
        chosen["raw"] = dbrouter.read_connection().alias
        from tenants.models import ApiToken
        chosen["token"] = router.db_for_read(ApiToken)
        with transaction.atomic():
            chosen["in_transaction"] = router.db_for_read(Job)
            chosen["raw_in_transaction"] = dbrouter.read_connection().alias
        chosen["write"] = router.db_for_write(Job)

    dbrouter.ReadReplicaMiddleware(view)(RequestFactory().get("/admin/jobs/job/"))
    assert chosen == {"page": "replica", "raw": "replica", "token": "default", "in_transaction": "default",
                      "raw_in_transaction": "default", "write": "default"}
    chosen.clear()
    dbrouter.ReadReplicaMiddleware(view)(RequestFactory().post("/admin/jobs/job/"))
    assert chosen["page"] == chosen["raw"] == "default"  # a POST (an action) reads the primary


def test_without_acc_read_db_url_nothing_changes(client, make_service):
    assert dbrouter.REPLICA not in connections.settings
    assert dbrouter.replica_lag() is None
    seen = {}
    dbrouter.ReadReplicaMiddleware(lambda request: seen.update(db=router.db_for_read(Job),
                                                                raw=dbrouter.read_connection().alias))(
        RequestFactory().get("/admin/"))
    assert seen == {"db": "default", "raw": "default"}
    make_service("work")
    job = api.start_service("work")
    client.force_login(make_user("root", superuser=True))
    assert short_id(job.pk) in client.get("/admin/jobs/job/").content.decode()
    assert 'id="accs-replica"' not in client.get("/admin/dashboard/").content.decode()


@pytest.mark.parametrize("value, databases", [
    ("", "['default']"),
    ("postgres://postgres@127.0.0.1:5999/accs", "['default', 'replica']"),
])
def test_the_setting_adds_the_replica_alias_and_the_router(value, databases):
    code = ("import django; django.setup(); from django.conf import settings;"
            "print(sorted(settings.DATABASES), getattr(settings, 'DATABASE_ROUTERS', []),"
            " settings.DATABASES.get('replica', {}).get('PORT'))")
    env = {**os.environ, "ACC_READ_DB_URL": value, "DJANGO_SETTINGS_MODULE": "accs_site.settings"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(databases)
    if value:
        assert "accs_site.dbrouter.ReadReplicaRouter" in out.stdout and "5999" in out.stdout
    bad = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                         env={**env, "ACC_READ_DB_URL": "mysql://x@h/db"})
    assert bad.returncode != 0 and "ACC_READ_DB_URL" in bad.stderr
