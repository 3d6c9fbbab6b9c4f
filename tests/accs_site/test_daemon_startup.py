"""The daemons' start-up against a database that cannot serve them, as real ``manage.py`` processes:
not migrated, one migration behind, or down with ``--once``. Each is one line and exit code 3."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import psycopg
import pytest

from tests import forkserver
from tests.accs_site.test_cli import env_with_database_down
from tests.daemons import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

DAEMONS = {"runbuilder": ("runbuilder", "--tick", "0.2"), "runagent": ("runagent", "--node", "n1", "--services", "x")}


def run(argv: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, str(ROOT / "manage.py"), *argv], cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """Return the message of the single line the process printed; fail unless it was one line, exit 3."""
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    assert result.returncode == 3, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {lines}"
    record = json.loads(lines[0])
    assert record["level"] == "error", record
    return record["msg"]


@pytest.fixture
def empty_database(db_url):
    """A database that exists but was never migrated; dropped afterwards."""
    name = f"accs_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{db_url.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_a_daemon_on_an_unmigrated_database_says_which_migration_is_missing_and_exits(
        daemon, empty_database, subprocess_env):
    message = one_error_line(run(DAEMONS[daemon], {**subprocess_env, "ACC_DB_URL": empty_database}))
    assert "is missing migration " in message and "apply them with `manage.py migrate`" in message, message


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_a_daemon_on_a_schema_one_migration_behind_names_that_migration(daemon, db_url, subprocess_env):
    from django.db import connection
    from django.db.migrations.loader import MigrationLoader

    app, name = max(node for node in MigrationLoader(connection).graph.leaf_nodes() if node[0] == "nodes")
    with psycopg.connect(db_url, autocommit=True) as conn:
        applied = conn.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s RETURNING applied",
                               [app, name]).fetchone()
        try:
            message = one_error_line(run(DAEMONS[daemon], subprocess_env))
        finally:
            conn.execute("INSERT INTO django_migrations (app, name, applied) VALUES (%s, %s, %s)",
                         [app, name, applied[0]])
    assert f"is missing migration {app}.{name}: apply them with `manage.py migrate`" in message, message


def test_runagent_once_with_the_database_down_gives_up_after_its_wait_in_one_line():
    env = env_with_database_down(ACC_LOG_FORMAT="json")
    address = env["ACC_DB_URL"].split("@", 1)[1].split("/", 1)[0]
    message = one_error_line(run(("runagent", "--node", "n1", "--services", "x", "--once", "--database-wait", "1"),
                                 env))
    assert f"PostgreSQL at {address} did not answer within 1s" in message and "giving up" in message, message


def test_a_database_lost_between_the_wait_and_the_schema_check_is_waited_for_again(monkeypatch, caplog):
    """A PostgreSQL restart right after it first answered is an outage to wait out, not exit code 3."""
    import logging

    from django.db import OperationalError

    from accs_site import daemon

    real_check, calls = daemon.check_schema, []

    def restarted_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        real_check()

    monkeypatch.setattr(daemon, "check_schema", restarted_once)
    assert daemon.ready_to_start(logging.getLogger("accs.test"), wait_seconds=10) is None
    assert len(calls) == 2 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_garbled_answer_to_a_command_counts_as_a_lost_connection_not_a_bug():
    """Behind PgBouncer, a PostgreSQL restart can cut a server connection while it answers COMMIT:
    psycopg then reports two results for one command. That is an outage (logged once, retried),
    not an unexpected error; other internal errors stay unexpected."""
    from django.db import utils as dj

    from accs_site.daemon import is_transient

    garbled = psycopg.InternalError("received 2 results from command 'COMMIT'")
    wrapped = dj.InternalError(str(garbled))
    wrapped.__cause__ = garbled
    assert is_transient(garbled) and is_transient(wrapped)
    assert not is_transient(psycopg.InternalError("could not read block 7 in file base/1/2"))


# Every command built on accs_site.cli.OperatorCommand, with its app.
COMMAND_APPS = {"runagent": "nodes", "runbuilder": "jobs", "accs_status": "ops", "accs_redrive": "jobs",
                "demo": "nodes"}


@pytest.mark.parametrize("daemon", sorted(COMMAND_APPS))
def test_a_command_runs_every_check_but_the_url_ones_at_start_and_a_failing_one_stops_it(daemon):
    """The daemons and the operators' commands serve no URL: the URL checks (which import the whole
    HTTP API) are left out at their start. Every other check runs, untagged and tagged, and one that
    fails stops the command in one line; the registry is whole again afterwards."""
    from django.core import checks
    from django.core.checks.registry import registry
    from django.core.management import load_command_class
    from django.core.management.base import CommandError

    ran: list[str] = []

    def untagged(app_configs=None, **kwargs):
        ran.append("untagged")
        return [checks.Error("a site's own check failed", id="site.E001")]

    def models(app_configs=None, **kwargs):
        ran.append("models")
        return []

    def urls(app_configs=None, **kwargs):
        ran.append("urls")
        return []

    registry.register(untagged)
    registry.register(models, checks.Tags.models)
    registry.register(urls, checks.Tags.urls)
    before = set(registry.registered_checks)
    try:
        command = load_command_class(COMMAND_APPS[daemon], daemon)
        with pytest.raises(CommandError) as refused:
            command.check()
        assert registry.registered_checks == before
    finally:
        registry.registered_checks -= {untagged, models, urls}
    assert set(ran) == {"models", "untagged"}, ran
    assert refused.value.returncode == 2 and "a site's own check failed" in str(refused.value)
