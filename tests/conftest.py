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
    from jobs.models import Tenant

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
