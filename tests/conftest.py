"""Shared fixtures: real PostgreSQL (see tests/dbselect.py), daemon processes, S3, a browser, users and tenants.

Every fixture more than one test module uses lives here (or in a folder's own conftest.py); the helper
modules beside it (tests/daemons.py, tests/ops_helpers.py, tests/browser.py, tests/s3_fixtures.py, ...)
hold plain functions and classes that tests import.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import s3_fixtures
from tests.browser import CHROMEDRIVER, chromium_binary, reset, start_chromium
from tests.daemons import START_TIMEOUT, Daemons, free_port, http_server
from tests.ops_helpers import Tenants, make_user, two_tenants
from tests.s3_fixtures import S3

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _fast_transactional_teardown() -> None:
    """Transactional tests empty only the tables they wrote (tests/fast_flush.py)."""
    from tests import fast_flush

    fast_flush.install()


@pytest.fixture
def db_url(transactional_db) -> str:
    """URL of the test database, for daemons started as subprocesses."""
    from django.db import connection

    s = connection.settings_dict
    return f"postgres://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


@pytest.fixture
def subprocess_env(db_url) -> dict[str, str]:
    """Environment for manage.py subprocesses: the test database, quick polls, JSON logs."""
    env = dict(os.environ)
    env.update(
        ACC_DB_URL=db_url,
        ACC_POLL_INTERVAL_SEC=env.get("ACC_POLL_INTERVAL_SEC", "0.5"),
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def default_tenant(db):
    from tenants.models import Tenant

    # Transactional tests flush the data migration's row, so make sure it exists.
    return Tenant.objects.get_or_create(slug="default", defaults={"name": "Default tenant"})[0]


@pytest.fixture
def make_service(db):
    """Create a valid service; keyword arguments override the defaults."""
    from workflows.api import save_service

    def make(key: str, **fields: Any):
        fields.setdefault("executor", "python")
        if fields["executor"] == "python":
            fields.setdefault("executor_config", {"callable": "tests.callables:noop"})
        fields.setdefault("params_schema", {"type": "object"})
        return save_service(key=key, **fields)

    return make


@pytest.fixture
def live_server_url(subprocess_env, tmp_path: Path):
    """Serve the app (Django's threaded server, see tests/wsgi_server.py) on the test database; yield its URL."""
    port = free_port()
    argv = [sys.executable, str(ROOT / "tests" / "wsgi_server.py"), "127.0.0.1", str(port)]
    with http_server(argv, env={**subprocess_env, "ACC_DB_CONN_MAX_AGE": "0"}, port=port,
                     log_path=tmp_path / "server.log", name="runserver", timeout=START_TIMEOUT) as url:
        yield url


@pytest.fixture
def daemons(subprocess_env, tmp_path) -> Iterator[Daemons]:
    """Start agents and builders as ``manage.py`` processes; all are stopped at teardown."""
    d = Daemons(subprocess_env, tmp_path)
    yield d
    d.stop_all()


@pytest.fixture(scope="session")
def s3_server() -> dict[str, str]:
    """Start the local S3 server (idempotent) and return its ACC_MINIO_* variables."""
    return s3_fixtures.start_server()


@pytest.fixture
def s3(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """Point ACCS at a fresh, not yet created bucket (ACCS creates it on first use)."""
    from accs_site.conf import reload

    bucket = f"accs-test-{uuid.uuid4().hex[:16]}"
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACC_MINIO_BUCKET", bucket)
    monkeypatch.setenv("ACC_MINIO_REGION", "us-east-1")
    reload()
    client = s3_fixtures.client(s3_server)
    yield S3(endpoint=s3_server["ACC_MINIO_ENDPOINT"], bucket=bucket, client=client)
    monkeypatch.undo()
    reload()
    s3_fixtures.remove_bucket(client, bucket)


@pytest.fixture
def tenants() -> Tenants:
    """Two tenants, acme and globex (tests/ops_helpers.py)."""
    return two_tenants()


@pytest.fixture
def root(client):
    """A superuser, logged in on the test client."""
    user = make_user("root", superuser=True)
    client.force_login(user)
    return user


@pytest.fixture(scope="session")
def _chromium(django_db_setup, django_db_blocker) -> Iterator[dict[str, Any]]:
    """The worker's one headless Chromium, started when a test first needs it and quit at the end.

    Quit before the test database is dropped, and waited for: a live server's thread holds a database
    connection while the browser keeps its socket open, and the drop would find it still there.
    """
    held: dict[str, Any] = {}
    yield held
    if held.get("driver") is None:
        return
    held["driver"].quit()
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cur:
        deadline = time.monotonic() + 10  # past it, the drop's own warning names what is left
        while time.monotonic() < deadline:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND pid <> pg_backend_pid()")
            if cur.fetchone()[0] == 0:
                break
            time.sleep(0.1)
    connection.close()


@pytest.fixture
def browser(_chromium, tmp_path_factory, request):
    """A headless Chromium (own profile, no background network) as a fresh one looks: no cookies, no
    stored data, no overrides, one window at 1440 × 1000 (helpers: tests/browser.py).

    One browser serves the worker's tests in turn (a start costs 0.4 s to a second of CPU); after each
    test it is put back (:func:`tests.browser.reset`), and one that cannot be is replaced.
    """
    if not (chromium_binary() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium-headless-shell (or chromium) and chromium-driver (make test installs them)")
        pytest.skip("install chromium-headless-shell (or chromium) and chromium-driver (apt-get) to run the "
                    "browser tests")
    if _chromium.get("driver") is None:
        _chromium["driver"] = start_chromium(tmp_path_factory.mktemp("chromium"))
    driver = _chromium["driver"]
    yield driver
    servers = [request.getfixturevalue(name) for name in ("live_server", "live_server_url")
               if name in request.fixturenames]
    if not reset(driver, origins=[getattr(server, "url", server) for server in servers]):
        _chromium["driver"] = None
        try:
            driver.quit()
        except Exception:  # noqa: BLE001 - a browser that is gone is what we wanted
            pass


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where screenshots go: ACCS_SCREENSHOT_DIR (docs/screenshots to refresh the README's), else the test's tmp."""
    target = Path(os.environ.get("ACCS_SCREENSHOT_DIR") or tmp_path / "screenshots")
    target.mkdir(parents=True, exist_ok=True)
    return target


def _uses_db(item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & {"db", "transactional_db"}) or item.get_closest_marker("django_db") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Check every status change the test wrote against the transition table (jobs.states).

    Runs right after the test body, while its rows are still there, so each test proves the
    verbs it drove moved tasks and jobs only along allowed edges.
    """
    outcome = yield
    if outcome.excinfo is not None or not _uses_db(item):
        return
    from events.models import Event
    from events.timeline import unfold
    from jobs.states import job_may, task_may

    # The lines operators see: a row that stands for several moves (a creation, a report's folded row)
    # is checked move by move.
    try:
        rows = list(Event.objects.filter(type__in=("status", "retry"))
                    .exclude(job_id__isnull=True, task_id__isnull=True))
    except Exception:  # noqa: BLE001 - a test that broke its connection on purpose has nothing to check
        return
    pairs = {(line.task_id is None, line.data["from"], line.data["to"], line.message)
             for row in rows for line in unfold(row)
             if isinstance(line.data, dict) and "from" in line.data and "to" in line.data}
    bad = [f"{'job' if is_job else 'task'} {frm} → {to} ({message})"
           for is_job, frm, to, message in sorted(pairs, key=str)
           if not (job_may(frm, to) if is_job else task_may(frm, to))]
    if bad:
        outcome.force_exception(AssertionError("status changes outside the transition table: " + "; ".join(bad[:5])))


# Seconds each long test took in a recent full run (setup + call + teardown, under make test's
# parallel workers), written by hand from ``--durations``; a test not listed counts as short.
DURATIONS = json.loads((Path(__file__).parent / "durations.json").read_text())


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each test's group in its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the longest tests first: the ones ``tests/durations.json`` lists, longest first, then the
    other ``slow`` ones, then the rest (each in its collected order).

    Under ``make test``'s parallel workers the longest tests then start at once instead of ending
    the run on one worker while the others sit idle. The tests of an ``xdist_group`` run one after
    another on one worker, so the group counts as long as all of them together. Every worker sorts
    alike, as xdist requires.

    A test whose ``xdist_group`` mark would do nothing fails at its setup, saying so: pytest-xdist's
    ``loadgroup`` sends a group's tests to one worker by the group's name it appends to their node
    ids, and a pytest whose node ids ignore that (9.2.0 with xdist 3.8) spread each group over every
    worker, each building the group's costly module fixture again (a migrated database, a replica).
    """
    if getattr(config.option, "loadgroup", False):  # set in a worker of --dist loadgroup only
        for item in items:
            group = _xdist_group(item)
            if group and not item.nodeid.endswith(f"@{group}"):
                item.stash[_GROUP_LOST] = (f"xdist_group was not applied (pytest {pytest.__version__}): this test's "
                                           "node id names no group, so --dist loadgroup spreads its group")
    groups: dict[str, float] = {}
    for item in items:
        group = _xdist_group(item)
        if group:
            groups[group] = groups.get(group, 0.0) + DURATIONS.get(item.nodeid.removesuffix(f"@{group}"), 0.0)

    def key(item: pytest.Item) -> tuple[float, bool]:
        group = _xdist_group(item)
        seconds = groups[group] if group else DURATIONS.get(item.nodeid, 0.0)
        return -seconds, item.get_closest_marker("slow") is None

    items.sort(key=key)


_GROUP_LOST = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _GROUP_LOST in item.stash:
        pytest.fail(item.stash[_GROUP_LOST], pytrace=False)


def _xdist_group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return str(marker.args[0] if marker.args else marker.kwargs.get("name"))


@pytest.fixture(autouse=True)
def _fresh_definitions():
    """Each test starts with no cached definitions (ids of rolled-back rows must not leak across)."""
    from jobs.definitions import definitions

    definitions.clear()
    yield
    definitions.clear()
