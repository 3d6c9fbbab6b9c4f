"""Shared fixtures: real PostgreSQL (see tests/dbselect.py), sample services and workflows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.daemons import wait_for  # noqa: F401  (the shared bounded poll; tests import it from here)

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.daemons", "tests.s3_fixtures"]


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


STATUS_PAIRS_SQL = """
SELECT DISTINCT task_id IS NULL, data->>'from', data->>'to', message FROM accs_event
 WHERE type IN ('status', 'retry') AND data ? 'from' AND data ? 'to' AND (job_id IS NOT NULL OR task_id IS NOT NULL)
"""


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
    from django.db import connection

    from jobs.states import job_may, task_may

    try:
        with connection.cursor() as cur:
            cur.execute(STATUS_PAIRS_SQL)
            rows = cur.fetchall()
    except Exception:  # noqa: BLE001 - a test that broke its connection on purpose has nothing to check
        return
    bad = [f"{'job' if is_job else 'task'} {frm} → {to} ({message})" for is_job, frm, to, message in rows
           if not (job_may(frm, to) if is_job else task_may(frm, to))]
    if bad:
        outcome.force_exception(AssertionError("status changes outside the transition table: " + "; ".join(bad[:5])))


@pytest.fixture(autouse=True)
def _fresh_definitions():
    """Each test starts with no cached definitions (ids of rolled-back rows must not leak across)."""
    from jobs.definitions import definitions

    definitions.clear()
    yield
    definitions.clear()
