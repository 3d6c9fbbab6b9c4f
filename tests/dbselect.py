"""Choose the PostgreSQL server for the test run, before Django reads its settings.

Loaded as an early pytest plugin (``-p tests.dbselect`` in pyproject.toml), so it runs before
pytest-django configures Django. In order of preference:

1. ``ACC_TEST_DB_URL`` when set;
2. a testcontainers Postgres when a Docker engine answers;
3. the project-local server started by ``scripts/pg_local.sh``.

The choice is exported as ``ACC_DB_URL``; pytest-django then creates ``test_<name>`` on it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def _start_local() -> str:
    subprocess.run([str(ROOT / "scripts" / "pg_local.sh"), "start"], check=True)
    return subprocess.run(
        [str(ROOT / "scripts" / "pg_local.sh"), "url"], check=True, capture_output=True, text=True
    ).stdout.strip()


def choose_database() -> tuple[str, str]:
    """Return (url, how it was chosen)."""
    if os.environ.get("ACC_TEST_DB_URL"):
        return os.environ["ACC_TEST_DB_URL"], "ACC_TEST_DB_URL"
    if os.environ.get("ACC_TEST_NO_DOCKER") != "1" and _docker_engine_answers():
        return _start_container(), "testcontainers"
    return _start_local(), "local server (scripts/pg_local.sh)"


# Agents run nothing but the demo tool unless the site lists what its services run: the suite's
# services run any program and callable of the tests, and the daemons it starts inherit this.
os.environ.setdefault("ACC_ALLOWED_EXECUTABLES", "*")
os.environ.setdefault("ACC_ALLOWED_CALLABLES", "*")
os.environ.setdefault("ACC_ALLOWED_TASK_ENV", "GREETING,COLOUR")

_url, _how = choose_database()
os.environ["ACC_DB_URL"] = _url
print(f"accs tests: PostgreSQL from {_how}", file=sys.stderr)
