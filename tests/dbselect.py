"""Choose the PostgreSQL server for the test run, before Django reads its settings.

Loaded as an early pytest plugin (``-p tests.dbselect`` in pyproject.toml), so it runs before
pytest-django configures Django. In order of preference:

1. ``ACC_TEST_DB_URL`` when set;
2. a testcontainers Postgres when a Docker engine answers;
3. the project-local server started by ``scripts/pg_local.sh``.

The choice is exported as ``ACC_DB_URL``; pytest-django then creates ``test_<name>`` on it.

Under pytest-xdist (``make test`` runs ``-n``) every worker is a test session of its own with a
server of its own: the local choice is a cluster per worker (``.local/pg-gw0``, ``.local/pg-gw1``...,
each on a port of its own, exported as ``ACC_PG_DIR`` so that ``scripts/pg_local.sh`` and the tests
that stop, crash or replicate the server reach that worker's cluster and no other). A test that
restarts PostgreSQL therefore disturbs only the tests of its own worker, which run one at a time. The
controller process runs no test and chooses no server.

What the run started it stops at the end (the worker clusters, and the default cluster and the local
S3 server when they were not running before); what was running before it leaves running.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PG_LOCAL = ROOT / "scripts" / "pg_local.sh"
S3_LOCAL = ROOT / "scripts" / "s3_local.sh"

# Agents run nothing but the demo tool unless the site lists what its services run: the suite's
# services run any program and callable of the tests, and the daemons it starts inherit this.
os.environ.setdefault("ACC_ALLOWED_EXECUTABLES", "*")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "*")
os.environ.setdefault("ACC_ALLOWED_TASK_ENV", "GREETING,COLOUR")


def _docker_engine_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_container() -> str:
    from testcontainers.postgres import PostgresContainer

    container = PostgresContainer("postgres:15", driver=None)
    container.start()
    atexit.register(container.stop)
    return container.get_connection_url()


def _running(script: Path) -> bool:
    return subprocess.run([str(script), "status"], capture_output=True).returncode == 0


def _stop_when_done(script: Path) -> None:
    """Stop the server of ``script`` when this process exits (it was not running before this run)."""
    atexit.register(subprocess.run, [str(script), "stop"], capture_output=True, timeout=120)


def _start_local(*, always_stop: bool = False) -> str:
    if always_stop or not _running(PG_LOCAL):
        _stop_when_done(PG_LOCAL)
    subprocess.run([str(PG_LOCAL), "start"], check=True)
    return subprocess.run([str(PG_LOCAL), "url"], check=True, capture_output=True, text=True).stdout.strip()


def use_worker_cluster(worker: str) -> None:
    """Point ``scripts/pg_local.sh`` (and so every test and daemon of this process) at the worker's own cluster.

    The folder is the checkout's cluster folder with the worker's name appended; the port is the first
    free one when the run starts it (``ACC_PG_PORT`` would give every worker the same one).
    """
    base = os.environ.get("ACC_PG_DIR") or ".local/pg"
    os.environ["ACC_PG_DIR"] = f"{base}-{worker}"
    os.environ.pop("ACC_PG_PORT", None)
    if not _running(PG_LOCAL):
        # Nothing outside this run knows a worker cluster's port: a stopped one takes the first free
        # port again (its port from an earlier run may belong to another server by now). Restarts
        # within the run keep the port this start remembers.
        (ROOT / os.environ["ACC_PG_DIR"] / "port").unlink(missing_ok=True)


def choose_database() -> tuple[str, str]:
    """Return (url, how it was chosen)."""
    if os.environ.get("ACC_TEST_DB_URL"):
        return os.environ["ACC_TEST_DB_URL"], "ACC_TEST_DB_URL"
    if os.environ.get("ACC_TEST_NO_DOCKER") != "1" and _docker_engine_answers():
        return _start_container(), "testcontainers"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        use_worker_cluster(worker)  # a cluster only this worker's tests use, stopped when the worker ends
        return _start_local(always_stop=True), f"{worker}'s own local cluster (ACC_PG_DIR={os.environ['ACC_PG_DIR']})"
    return _start_local(), "local server (scripts/pg_local.sh)"


def _is_xdist_controller(config: pytest.Config) -> bool:
    workers = getattr(config.known_args_namespace, "numprocesses", None)
    return bool(workers) and not os.environ.get("PYTEST_XDIST_WORKER")


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> Generator[None, None, None]:
    """Choose the server before pytest-django imports the settings (its hook runs inside this wrapper)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") and not _running(S3_LOCAL):
        # The tests start the local S3 server when they first need it; a run that found it stopped stops it.
        _stop_when_done(S3_LOCAL)
    if not _is_xdist_controller(early_config):
        url, how = choose_database()
        os.environ["ACC_DB_URL"] = url
        print(f"accs tests: PostgreSQL from {how}", file=sys.stderr)
    return (yield)
